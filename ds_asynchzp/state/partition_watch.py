"""In-place writes into a partition that the layout cannot follow, found at the next optimizer step.

Where a parameter shard has more than one row (d_p < d_o), other ranks hold copies of this rank's own atoms and
refresh them only after a step; where optimizer states are replicated (d_o < N), the other replicas' gathers never
read them. Code that writes a partition in place through `param.ds_tensor.data` (no version counter sees such a
write) changes the own atom alone: under stock ZeRO-3 every gather would read the new value until the next step
overwrites it from the fp32 master; here other ranks keep gathering the old one. A rebinding is caught at the
gather (`comm/param_gather.py`); an in-place write only by its contents.

So the own rows are fingerprinted whenever the package itself has finished writing them (construction, after
each step's write and after a checkpoint load or a `GatheredParameters` edit), and checked at the start of the
next step: one pass over the own rows (1/d_o of the model) and one host read per step, next to the one stock's
step makes for its gradient norm. A fingerprint is the exact integer sum of the stored bits, per span of whole
parameters (about SPANS_PER_BUFFER spans a buffer), so a mismatch names the parameters of its span.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from ..errors import PartitionWriteError
from ..platform import streams
from .sharded_buffer import ShardedBuffer

SPANS_PER_BUFFER = 32
_BITS = {4: torch.int32, 2: torch.int16, 1: torch.int8}


def _spans(buffer: ShardedBuffer) -> List[Tuple[int, int, list]]:
    """Column ranges of whole parameters, about SPANS_PER_BUFFER of them."""
    target = max(1, -(-buffer.width // SPANS_PER_BUFFER))
    spans, start, members = [], 0, []
    for param in buffer.params:
        c = buffer.columns[param.ds_id]
        members.append(param)
        if c.offset + c.atom - start >= target:
            spans.append((start, c.offset + c.atom, members))
            start, members = c.offset + c.atom, []
    if members:
        spans.append((start, buffer.width, members))
    return [span for span in spans if span[1] > span[0]]


class PartitionWatch:
    def __init__(self, buffers: Sequence[ShardedBuffer], names: Dict[int, str]):
        """`buffers`: the parameter shards whose own rows other ranks' gathers do not all read
        (`ParamShards.own_writes_reach_every_gather` false)."""
        self.names = names
        self.buffers = [b for b in buffers if b.width]
        self._spans = {id(b): _spans(b) for b in self.buffers}
        self._recorded: Dict[int, torch.Tensor] = {}

    def _fingerprints(self, buffer: ShardedBuffer) -> torch.Tensor:
        own = buffer.own.view(_BITS[buffer.data.element_size()])
        return torch.stack([own[start:end].sum(dtype=torch.int64) for start, end, _ in self._spans[id(buffer)]])

    @torch.no_grad()
    def record(self) -> None:
        """The package has just written the own rows (on the current stream)."""
        for buffer in self.buffers:
            self._recorded[id(buffer)] = self._fingerprints(buffer)

    @torch.no_grad()
    def check(self) -> None:
        """Before the step overwrites the own rows: raise if any was written since the last `record`."""
        written = []
        for buffer in self.buffers:
            recorded = self._recorded.get(id(buffer))
            if recorded is None:
                continue
            changed = (self._fingerprints(buffer) != recorded).nonzero().flatten().tolist()
            # Made on the stream current at `record`, read here on this one, replaced at the next `record`.
            streams.keep_alive(recorded)
            for index in changed:
                written += [self.names.get(p.ds_id, f"ds_id {p.ds_id}") for p in self._spans[id(buffer)][index][2]]
        if written:
            listed = ", ".join(written[:8]) + (f" and {len(written) - 8} more" if len(written) > 8 else "")
            raise PartitionWriteError(
                f"a partition (param.ds_tensor) of one of these parameters was written in place outside DeepSpeed "
                f"since the last step: {listed}. Under async_hzp with param_shard_size < optimizer_shard_size, or "
                "optimizer_shard_size < the world, other ranks gather copies of it that kept the old value, so the "
                "forwards since then mixed old and new weights. Write parameters with "
                "deepspeed.zero.GatheredParameters(params, modifier_rank=r) on every rank, or set "
                "async_hzp.param_shard_size and optimizer_shard_size to the world size.")
