"""The parameter shards: every rank's d_o / d_p atoms of every parameter, the only copy of the parameters.

DeepSpeed's partition of each parameter (`param.ds_tensor`, one atom) is a view into the own row of these
buffers; the optimizer step writes the updated atom there, and the once-per-step refresh fills the other rows
from the ranks that own them. Trainable parameters live in one buffer whose own row *is* Stage 3's flat
parameter buffer (same column order); frozen parameters in one buffer per dtype, so a gather never mixes
dtypes.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from ..layout import HierarchicalLayout
from .sharded_buffer import ShardedBuffer


class ParamShards:
    def __init__(self, layout: HierarchicalLayout, dp_rank: int):
        self.layout = layout
        self.rows = layout.param_rows
        self.own_row = layout.param_row_of_own_atom(dp_rank)
        self.own_atom_index = layout.own_atom(dp_rank)       # q: which atom of every parameter this rank owns
        # (buffer, column, first padding column, view): views of the own row past each parameter's end, with that
        # parameter's column
        self._padding: List[tuple] = []
        self.shard_index = dp_rank % layout.param_shard_size   # j: this rank's index in its shard group
        self.buffers: List[ShardedBuffer] = []
        self._buffer_of: Dict[int, ShardedBuffer] = {}

    def _add(self, buffer: ShardedBuffer) -> ShardedBuffer:
        self.buffers.append(buffer)
        for param in buffer.params:
            self._buffer_of[param.ds_id] = buffer
            c = buffer.columns[param.ds_id]
            valid = max(0, min(c.atom, param.ds_numel - self.own_atom_index * c.atom))
            if valid < c.atom:
                self._padding.append((buffer, c.offset, c.offset + valid,
                                      buffer.own.narrow(0, c.offset + valid, c.atom - valid)))
        self.zero_padding()
        return buffer

    def zero_padding(self) -> None:
        """Zero the own atoms' padding (past each parameter's last element).

        DeepSpeed leaves that padding uninitialised, and the step writes back whatever its fp32 copy holds
        there. Unquantized gathers drop it, but a quantized one would let it into a block's absmax (a NaN
        there poisons the whole block), and its bytes would differ between runs. Every rank zeroes its own
        atoms, so every row of every shard, refreshed from its owner, holds zeros there."""
        for _, _, _, view in self._padding:
            view.zero_()
        for buffer in self.buffers:
            buffer.note_host_access()

    def zero_padding_in(self, buffer: ShardedBuffer, start: int, end: int) -> None:
        """`zero_padding` for the parameters of `buffer` whose columns begin in [start, end) only: what the step
        just wrote, while the refresh of other columns may still read them (optimizer offload)."""
        for owner, column, _, view in self._padding:
            if owner is buffer and start <= column < end:
                view.zero_()
        buffer.note_host_access()

    def padding_in(self, buffer: ShardedBuffer, start: int, end: int) -> List[Tuple[int, int]]:
        """The column ranges of `buffer`'s own-row padding (`zero_padding`) that fall in [start, end)."""
        spans = []
        for owner, _, first, view in self._padding:
            if owner is buffer:
                lo, hi = max(first, start), min(first + view.numel(), end)
                if lo < hi:
                    spans.append((lo, hi))
        return spans

    def adopt_trainable(self, params_in_flat_order: Sequence[torch.nn.Parameter]) -> ShardedBuffer:
        """Take over Stage 3's partitions of these parameters: their contents become the own row of a new shard
        buffer (same column order), and each `ds_tensor` a view of its own atom there.

        Returns the buffer; the caller points DeepSpeed's flat buffers at its own row."""
        params = list(params_in_flat_order)
        first = params[0].ds_tensor
        buffer = ShardedBuffer("params", params, self.rows, self.own_row, first.dtype, first.device,
                               atom_of=lambda p: p.partition_numel())
        for param in params:
            buffer.own_atom(param).copy_(param.ds_tensor.data.view(-1))
            param.ds_tensor.data = buffer.own_atom(param)
        return self._add(buffer)

    def adopt_frozen(self, params: Sequence[torch.nn.Parameter]) -> List[ShardedBuffer]:
        """Frozen parameters (no optimizer state): one buffer per dtype, each `ds_tensor` a view of its own row."""
        by_dtype: Dict[torch.dtype, List[torch.nn.Parameter]] = {}
        for param in sorted(params, key=lambda p: p.ds_id):
            by_dtype.setdefault(param.ds_tensor.dtype, []).append(param)
        made = []
        for dtype, group in by_dtype.items():
            buffer = ShardedBuffer(f"frozen_{str(dtype).replace('torch.', '')}", group, self.rows, self.own_row,
                                   dtype, group[0].ds_tensor.device, atom_of=lambda p: p.ds_tensor.numel())
            for param in group:
                buffer.own_atom(param).copy_(param.ds_tensor.data.view(-1))
                param.ds_tensor.data = buffer.own_atom(param)
            made.append(self._add(buffer))
        return made

    @property
    def own_writes_reach_every_gather(self) -> bool:
        """Whether a write into this rank's own atoms reaches every gather of the parameter, as a write into a stock
        partition does: only with one row and one optimizer replica (d_p = d_o = N). Otherwise other ranks hold
        copies of the atoms (more rows), or other replicas' gathers never read them (d_o < N)."""
        return self.rows == 1 and self.layout.optimizer_shard_size == self.layout.world

    def buffer_of(self, param) -> ShardedBuffer:
        return self._buffer_of[param.ds_id]

    def holds(self, param) -> bool:
        return getattr(param, "ds_id", None) in self._buffer_of

    @property
    def params(self) -> List[torch.nn.Parameter]:
        return [p for buffer in self.buffers for p in buffer.params]

    def set_full(self, param, full: torch.Tensor) -> None:
        """Rewrite every row of one parameter's shard from its full value (a caller modified the parameter
        while it was gathered on every rank, e.g. `GatheredParameters(modifier_rank=...)`)."""
        atoms = self.buffer_of(param).atoms(param)        # [T_p, atom]; row t holds atom j + t*d_p
        atom = atoms.shape[1]
        flat = full.detach().reshape(-1)
        with torch.no_grad():
            for t in range(self.rows):
                start = (self.shard_index + t * self.layout.param_shard_size) * atom
                count = max(0, min(atom, flat.numel() - start))
                if count:
                    atoms[t, :count].copy_(flat[start:start + count])
                atoms[t, count:].zero_()
        self.buffer_of(param).note_host_access()

    def nbytes(self) -> int:
        return sum(b.nbytes() for b in self.buffers)
