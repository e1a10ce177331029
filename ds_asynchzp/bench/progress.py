"""A progress bar for a running arm, fed by rank 0's log.

Ranks run in other processes (possibly inside other network namespaces), so the launcher cannot count steps
itself; rank 0 prints one marker line per optimizer step into its log, and a thread here follows that file.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from .worker import PROGRESS_MARK


class StepProgress:
    """`with StepProgress(log_path, total_steps, label):` around a blocking launch."""

    def __init__(self, log_path: Path, total_steps: int, label: str, poll_s: float = 0.5):
        self.log_path = Path(log_path)
        self.total_steps = total_steps
        self.label = label
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="bench-progress", daemon=True)
        self._bar = None

    def __enter__(self) -> "StepProgress":
        self._bar = tqdm(total=self.total_steps, desc=self.label, unit="step", file=sys.stderr,
                         dynamic_ncols=True, leave=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._bar.close()

    def _steps_logged(self) -> int:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return 0
        return text.count(PROGRESS_MARK)

    def _follow(self) -> None:
        shown = 0
        while not self._stop.is_set():
            done = min(self._steps_logged(), self.total_steps)
            if done > shown:
                self._bar.update(done - shown)
                shown = done
            time.sleep(self.poll_s)
