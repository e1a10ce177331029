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
step makes for its gradient norm. A fingerprint is taken per span of whole parameters (about SPANS_PER_BUFFER
spans a buffer), so a mismatch names the parameters of its span. It is three sums over the span's stored bits x_i
read as integers, at positions i = 0, 1, ... of the span, in 64-bit integers (wrapping: exact modulo 2^64):

* S0 = sum x_i sees every change of one value: it moves S0 by less than 2^32, never by a multiple of 2^64;
* S1 = sum i * x_i sees every swap of two different values, which keeps S0: it moves S1 by (i - j)(x_j - x_i),
  nonzero and under 2^63 in size (a span holds fewer than 2^31 elements);
* S2 = sum i^2 * x_i: a longer permutation (a roll, a reversal, a shuffle) that keeps S1 too would have to keep
  the second positional moment as well.

The positional weights come from one cached arange of CHUNK elements, so the pass needs no buffer of the span's
size.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from ..errors import PartitionWriteError
from ..platform import streams
from .sharded_buffer import ShardedBuffer

SPANS_PER_BUFFER = 32
# Elements per pass of a span: the temporaries are a few CHUNK-long int64 tensors (8 MiB each).
CHUNK = 1 << 20
_BITS = {4: torch.int32, 2: torch.int16, 1: torch.int8}


def span_fingerprint(bits: torch.Tensor, weights: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """[S0, S1, S2] of one span's stored bits (1-D integer tensor), int64 (see the module's docstring);
    `weights`: (arange(CHUNK), arange(CHUNK) squared) as int64 on the bits' device."""
    k, k2 = weights
    total = torch.zeros(3, dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), CHUNK):
        x = bits[start:start + CHUNK].to(torch.int64)
        n = x.numel()
        s0, s1, s2 = x.sum(), (x * k[:n]).sum(), (x * k2[:n]).sum()
        # Positions start + k: sum (start + k) x = start*S0 + S1, sum (start + k)^2 x = start^2*S0 + 2*start*S1 + S2.
        total += torch.stack([s0, start * s0 + s1, start * start * s0 + 2 * start * s1 + s2])
    return total


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
        self._weights: Dict[object, Tuple[torch.Tensor, torch.Tensor]] = {}

    def _fingerprints(self, buffer: ShardedBuffer) -> torch.Tensor:
        own = buffer.own.view(_BITS[buffer.data.element_size()])
        weights = self._weights.get(own.device)
        if weights is None:
            k = torch.arange(CHUNK, dtype=torch.int64, device=own.device)
            weights = self._weights[own.device] = (k, k * k)
        return torch.stack([span_fingerprint(own[start:end], weights) for start, end, _ in self._spans[id(buffer)]])

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
            changed = (self._fingerprints(buffer) != recorded).any(dim=1).nonzero().flatten().tolist()
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
