"""Test-only: a delay before and after every collective the package issues, to widen race windows and to model
latency. Off unless DS_ASYNCHZP_COMM_DELAY_MS is set in the environment when the first collective runs:

* `D` (e.g. `20`): sleep D ms before and after each collective;
* `LO:HI:SEED` (e.g. `0:20:7`): a uniform random delay in [LO, HI] ms, drawn from a generator seeded with
  SEED, the rank and the issuing thread's name, so a run is reproducible.

Sleeping leaves the results untouched: any difference it makes to a loss is a race.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Optional

_ENV = "DS_ASYNCHZP_COMM_DELAY_MS"
_local = threading.local()
_spec: Optional[tuple] = None
_read = False


def _parse(text: str) -> Optional[tuple]:
    parts = text.split(":")
    try:
        if len(parts) == 1:
            value = float(parts[0]) / 1000.0
            return (value, value, 0) if value > 0 else None
        if len(parts) == 3:
            return float(parts[0]) / 1000.0, float(parts[1]) / 1000.0, int(parts[2])
    except ValueError:
        pass
    raise ValueError(f"{_ENV}={text!r}: expected D or LO:HI:SEED in milliseconds, e.g. 20 or 0:20:7")


def _delay() -> bool:
    global _spec, _read
    if not _read:
        text = os.environ.get(_ENV, "")
        _spec = _parse(text) if text else None
        _read = True
    if _spec is None:
        return False
    low, high, seed = _spec
    if low == high:
        time.sleep(low)
        return True
    generator = getattr(_local, "generator", None)
    if generator is None:
        rank = os.environ.get("RANK", "0")
        generator = _local.generator = random.Random(f"{seed}:{rank}:{threading.current_thread().name}")
    time.sleep(generator.uniform(low, high))
    return True


def reset() -> None:
    """Read DS_ASYNCHZP_COMM_DELAY_MS again at the next collective (a test changes it between runs)."""
    global _read
    _read = False
    _local.__dict__.clear()


def around() -> bool:
    """Call before a collective and once more after it; True when it slept."""
    return _delay()
