"""Per micro-step: gather full parameters from the parameter shards, inside the d_p shard group.

Replaces DeepSpeed's per-parameter `all_gather_coalesced`, which the parameter coordinator calls for every
module in forward and backward. One all-gather per dtype (a concatenation would silently promote a bf16
parameter gathered with an fp32 one); each member contributes its T_p atoms of every requested parameter, and
the gathered [d_p, T_p, atom] block is transposed locally into atom order.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import torch

from ..accounting import ledger
from ..runtime.deepspeed_internals import mark_available, mark_inflight
from ..runtime.process_groups import Group
from ..state.param_shards import ParamShards
from .collectives import Work, all_gather


class _DtypeGather:
    """One all-gather in flight for the parameters of one dtype."""

    def __init__(self, params: List[torch.nn.Parameter], shards: ParamShards, group: Group):
        self.params = params
        self.shards, self.group = shards, group
        rows = shards.rows
        self.sizes = [rows * shards.buffer_of(p).columns[p.ds_id].atom for p in params]
        width = sum(self.sizes)
        first = shards.buffer_of(params[0]).data
        send = torch.empty(width, dtype=first.dtype, device=first.device)
        offset = 0
        for param, size in zip(params, self.sizes):
            send[offset:offset + size].view(rows, -1).copy_(shards.buffer_of(param).atoms(param))
            offset += size
        # Both stay referenced until wait(): the collective reads `send` and writes `recv` in the background.
        self.send = send
        self.recv = torch.empty(group.size * width, dtype=send.dtype, device=send.device)
        self.work: Work = all_gather(self.recv, send, group, async_op=True)

    def finish(self, into: Callable[[torch.nn.Parameter], torch.Tensor] = None) -> List[torch.Tensor]:
        """Wait, then lay each parameter out in atom order: a fresh tensor per parameter, or `into(param)`."""
        self.work.wait()
        d_p, rows, width = self.group.size, self.shards.rows, sum(self.sizes)
        gathered = self.recv.view(d_p, width)
        out, offset = [], 0
        for param, size in zip(self.params, self.sizes):
            block = gathered[:, offset:offset + size].view(d_p, rows, -1)
            offset += size
            if rows == 1 and into is None:
                # d_p = d_o: member j holds atom j, so the block is already in order; keep it as a view.
                full = block.reshape(-1)
            else:
                full = torch.empty(d_p * size, dtype=self.recv.dtype, device=self.recv.device)
                full.view(rows, d_p, -1).copy_(block.transpose(0, 1))
            full = full.narrow(0, 0, param.ds_numel).view(param.ds_shape)
            if into is not None:
                into(param).copy_(full)
            out.append(full)
        self.send = self.recv = None
        return out


class GatherHandle:
    """What the parameter coordinator waits on; `wait` publishes the full parameters (idempotent: the
    coordinator calls it once per parameter of a coalesced fetch)."""

    def __init__(self, gathers: List[_DtypeGather]):
        self.gathers = gathers
        self.complete = False

    def wait(self, handle_dependency: bool = True) -> None:
        if self.complete:
            return
        for gather in self.gathers:
            for param, full in zip(gather.params, gather.finish()):
                mark_available(param, full)
        self.complete = True


class ParamGather:
    def __init__(self, shards: ParamShards, group: Group):
        self.shards = shards
        self.group = group

    def _start(self, params: Sequence[torch.nn.Parameter]) -> List[_DtypeGather]:
        by_dtype: Dict[torch.dtype, List[torch.nn.Parameter]] = {}
        # Same order on every rank: the concatenation order is part of the collective's contract.
        for param in sorted(params, key=lambda p: p.ds_id):
            by_dtype.setdefault(self.shards.buffer_of(param).data.dtype, []).append(param)
        return [_DtypeGather(group, self.shards, self.group) for _, group in sorted(by_dtype.items(), key=lambda kv: str(kv[0]))]

    def all_gather_coalesced(self, params, safe_mode: bool = False, quantize: bool = False,
                             tag: str = "asynchzp.param_gather") -> GatherHandle:
        """Drop-in for DeepSpeed's per-parameter `all_gather_coalesced` (same arguments, same handle protocol)."""
        params = list(params)
        mark_inflight(params)
        with ledger.tagged(tag):
            return GatherHandle(self._start(params))

    def regather_in_place(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Rewrite already-gathered parameters (ZeRO-3 persistent ones) from their refreshed shards, in place."""
        if not params:
            return
        with ledger.tagged("asynchzp.persistent_regather"):
            for gather in self._start(params):
                gather.finish(into=lambda p: p.data)
