"""Host<->device bytes as CUDA counts them, for the offload arms of the GPU check: one optimizer step after the
measured ones runs under torch's profiler, and every copy the device ran is summed by direction from the trace's
memcpy records (their ``bytes``), for stock ZeRO-3 with offload and for AsyncHZP alike. The package's own notes of
what it copied play no part, so the ratio is measured independently of the formulas it is set against
(`formulas.traffic.host_device_bytes`).

What CUDA counts is every copy between host and device: the offload path's, and the few the training loop makes
(the batch, a loss read back), which are the same in both arms and a few KiB per step.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Callable, Dict, List, Optional

DIRECTIONS = {"Memcpy HtoD": "host_to_device", "Memcpy DtoH": "device_to_host"}
# The counted ratio (AsyncHZP over stock) may differ from the formula's by this much: the training loop's own small
# copies, in both arms.
RATIO_RTOL = 0.10


def copy_bytes_in_trace(trace: dict) -> Dict[str, int]:
    """Bytes copied per direction in a chrome trace exported by torch's profiler (Kineto): its memcpy records
    are named ``Memcpy HtoD (...)`` / ``Memcpy DtoH (...)`` and carry their size in ``args.bytes``."""
    counted = {direction: 0 for direction in DIRECTIONS.values()}
    for event in trace.get("traceEvents", []):
        name = str(event.get("name", ""))
        for prefix, direction in DIRECTIONS.items():
            if name.startswith(prefix):
                counted[direction] += int((event.get("args") or {}).get("bytes", 0))
    return counted


def count_copies(run: Callable[[], None]) -> Dict[str, int]:
    """Run `run` (one optimizer step, ending in a device synchronisation) under the profiler; the bytes CUDA
    copied per direction."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as trace:
            return copy_bytes_in_trace(json.load(trace))


def copy_check(results: Dict, world: int, node_size: int, grad_accum: int, model: str, seq_len: int,
               offload_arms=("zero3-offload", "offload")) -> Optional[Dict]:
    """The report's row: CUDA's counted bytes per direction, per rank and step, of both offload arms, next to the
    formulas', and the counted ratio against the formula's. None where an arm has no count (not CUDA)."""
    from ..formulas import traffic
    from ..models.presets import element_counts

    counted = {}
    for arm in offload_arms:
        ranks: List[dict] = [r.get("host_device_bytes_counted") for r in results.get(arm) or []]
        if not ranks or any(r is None for r in ranks):
            return None
        counted[arm] = {d: sum(r[d] for r in ranks) / len(ranks) for d in DIRECTIONS.values()}
    predicted = {}
    for arm, formula_arm, multiple in (("zero3-offload", "zero3", world), ("offload", "asynchzp", world)):
        counts = element_counts(model, 0, seq_len, world, multiple=multiple)
        inputs = traffic.TrafficInputs(world=world, node_size=node_size, grad_accum=grad_accum,
                                       gathered_elements=counts["gathered"], reduced_elements=counts["reduced"],
                                       trainable_elements=counts["trainable"])
        copies = traffic.host_device_bytes(formula_arm, inputs, world)
        predicted[arm] = {"host_to_device": copies["to_device"], "device_to_host": copies["to_host"]}
    total = {arm: sum(values.values()) for arm, values in counted.items()}
    formula = {arm: sum(values.values()) for arm, values in predicted.items()}
    ratio = total["offload"] / max(total["zero3-offload"], 1)
    formula_ratio = formula["offload"] / formula["zero3-offload"]
    passed = abs(ratio / formula_ratio - 1) <= RATIO_RTOL
    rows = [{"arm": arm, **{f"counted {d}": counted[arm][d] for d in DIRECTIONS.values()},
             **{f"formula {d}": predicted[arm][d] for d in DIRECTIONS.values()}} for arm in offload_arms]
    return {"name": "host<->device bytes counted by CUDA (offload)", "passed": passed,
            "summary": f"per rank, one optimizer step of GA {grad_accum}, fp32, counted from the profiler's memcpy "
                       f"records: AsyncHZP {total['offload'] / 1e6:.3f} MB, stock offload "
                       f"{total['zero3-offload'] / 1e6:.3f} MB, ratio {ratio:.3f} (the formulas': {formula_ratio:.3f}, "
                       f"bound {RATIO_RTOL:.0%} apart)",
            "details": {"rows": rows}}
