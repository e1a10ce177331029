"""Scratch buffers of one flow (send, receive and staging buffers of its collectives), reused from job to job.

Each (purpose, dtype) has one flat buffer, handed out as a view of its first `numel` elements: allocated at the
first request, grown when a larger one comes, so the steady state allocates nothing. `trim`, once per optimizer
step, shrinks each buffer to the largest request since the previous trim and drops those not asked for since: a
large request seen once (the rebuild of every persistent parameter at construction, a frozen buffer's refresh at a
load, a bucket of an unusual step) does not stay for the rest of the run. In a steady loop every step makes the
same requests, so a trim finds each buffer at its size and changes nothing.

Only the flow's own jobs use its scratch, on its thread and stream (or inline, on the flow's stream), and `trim`
runs as one of those jobs (`runtime.buffer_trim`): it sees every job submitted before it and none after, so what
"the last step" asked for depends on the order of submission on the training thread, never on thread timing. A
buffer it drops was allocated on the flow's stream and is touched by no other, so the caching allocator may hand
its memory to the next allocation on that stream at once.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch


class Scratch:
    def __init__(self):
        self._buffers: Dict[Tuple[str, torch.dtype], torch.Tensor] = {}
        self._largest: Dict[Tuple[str, torch.dtype], int] = {}   # largest request since the last trim
        self.allocations = 0
        self.frees = 0

    def get(self, key: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A flat buffer of `numel` elements for `key` (the view of a reused one)."""
        slot = (key, dtype)
        if self._largest.get(slot, -1) < numel:
            self._largest[slot] = numel
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.numel() < numel or buffer.device != torch.device(device):
            if buffer is not None:
                self.frees += 1
            buffer = self._buffers[slot] = torch.empty(numel, dtype=dtype, device=device)
            self.allocations += 1
        return buffer.narrow(0, 0, numel)

    def trim(self) -> None:
        """Inside a job of the flow: drop the buffers not asked for since the last trim, and reallocate those larger
        than their largest request since then at that size."""
        largest, self._largest = self._largest, {}
        for slot, buffer in list(self._buffers.items()):
            wanted = largest.get(slot)
            if wanted is None:
                del self._buffers[slot]
                self.frees += 1
            elif buffer.numel() > wanted:
                self._buffers[slot] = torch.empty(wanted, dtype=buffer.dtype, device=buffer.device)
                self.frees += 1
                self.allocations += 1

    def nbytes(self) -> int:
        # Read from other threads (reports) while the flow's thread may change it: from a copy.
        return sum(t.numel() * t.element_size() for t in list(self._buffers.values()))
