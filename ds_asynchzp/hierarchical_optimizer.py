"""DeepSpeed's ZeRO-3 optimizer with the hierarchical placement.

Subclassing Stage 3 (rather than writing a new engine) keeps everything the engine dispatches on the
optimizer's type: loss scaling, gradient clipping, checkpoint format, `zero.Init` parameters, HF
integration. Only three places change:

* the per-bucket gradient reduce-scatter goes to the grad shard group and into `GradShards`;
* `step` first finishes the gradient reduction across nodes, once;
* `_post_step` refreshes the parameter shards from the updated primary partitions instead of dropping them.

Who owns what: DeepSpeed owns the primary 1/world partitions (bf16/fp32 params, fp32 master, Adam moments,
fp32 gradient partition). `ParamShards` owns the 1/d_p parameter shards; `GradShards` owns the 1/d_g
gradient accumulation buffer; `ProcessGroups` owns every group.
"""

from __future__ import annotations

from typing import List

import torch
from deepspeed.utils import log_dist

from . import ledger
from .config import ResolvedLayout
from .deepspeed_internals import (STAGE3_AVG_SCATTER_GRADS, DeepSpeedZeroOptimizer_Stage3,
                                  grad_partition_of, is_zero_param, partition_rank_of)
from .grad_shards import GradShards
from .param_shards import ParamShards
from .rank_grid import build_process_groups


class HierarchicalZeroOptimizer(DeepSpeedZeroOptimizer_Stage3):
    """Set `layout` on a subclass (see `optimizer_class_for`); the engine builds it with Stage 3's arguments."""

    layout: ResolvedLayout = None

    def __init__(self, module, init_optimizer, *args, **kwargs):
        if self.layout is None:
            raise RuntimeError("HierarchicalZeroOptimizer needs a resolved layout; build it with optimizer_class_for()")
        super().__init__(module, init_optimizer, *args, **kwargs)
        layout = self.layout
        # Our bucket override sits on the reduce-scatter branch of the bucket flush; the all-reduce
        # branch (reduce_scatter=false) would bypass it.
        self.reduce_scatter = True
        self.hzp_groups = build_process_groups(layout.world_size, layout.node_size,
                                               layout.param_shard_size, layout.grad_shard_size)
        all_params = {id(p): p for p in module.parameters() if is_zero_param(p)}
        self.hzp_trainable: List[torch.nn.Parameter] = sorted(
            (p for group in self.fp16_groups for p in group), key=lambda p: p.ds_id)
        self.hzp_params = ParamShards(list(all_params.values()), self.hzp_groups)
        self.hzp_grads = GradShards(self.hzp_trainable, self.hzp_groups, layout.world_size)
        if layout.log_layout:
            log_dist(layout.describe(), ranks=[0])

    # ------------------------------------------------------------------------------- per micro-step
    @torch.no_grad()
    def _reduce_scatter_bucket(self, params_to_reduce, communication_data_type: torch.dtype) -> List[torch.Tensor]:
        """Replaces Stage 3's bucket reduce-scatter: reduce inside the grad shard group only."""
        grads = [p.grad for p in params_to_reduce]
        if communication_data_type != self.dtype:
            grads = [g.to(communication_data_type) for g in grads]
        predivide = self.postscale_gradients and self.gradient_predivide_factor != 1.0
        if predivide:
            grads = [g.div(self.gradient_predivide_factor) for g in grads]
        slices = self.hzp_grads.reduce_scatter_bucket(params_to_reduce, grads)
        if predivide and self.gradient_predivide_factor != self.layout.world_size:
            slices = [s.mul(self.gradient_predivide_factor) for s in slices]
        return slices

    def partition_grads(self, params_to_release, grad_partitions) -> None:
        """Accumulate into the 1/d_g buffer; the 1/world partitions are written once, in `step`."""
        self.hzp_grads.accumulate(params_to_release, grad_partitions)
        for param in params_to_release:
            param.grad = None
        return []

    # ------------------------------------------------------------------------ once per optimizer step
    def _write_primary_grad(self, param, grad: torch.Tensor) -> None:
        if param.partition_numel() * partition_rank_of(self, param) >= param.ds_numel:
            return  # this rank's partition is all padding: stock ZeRO-3 leaves it untouched too
        grad_partition_of(self, param).narrow(0, 0, grad.numel()).copy_(grad)

    def step(self, closure=None):
        self.hzp_grads.reduce_at_boundary(self._write_primary_grad)
        return super().step(closure)

    def _post_step(self, timer_names):
        # Stock Stage 3 drops hpZ secondaries here, so the next forward gathers over the world; instead the
        # intra-node shards are rebuilt from the updated primaries, once.
        self.hzp_params.refresh(self.hzp_trainable)
        if self.persistent_parameters:
            with ledger.tagged("asynchzp.persistent_regather"):
                self.hzp_params.regather_in_place(self.persistent_parameters)
        self.timers.log(timer_names)

    def checkpoint_event_epilogue(self):
        # A checkpoint load rewrote the primary partitions: every shard is stale.
        self.hzp_params.refresh(self.hzp_params.params)
        if self.persistent_parameters:
            self.hzp_params.regather_in_place(self.persistent_parameters)

    def load_state_dict(self, *args, **kwargs):
        result = super().load_state_dict(*args, **kwargs)
        self.hzp_params.refresh(self.hzp_params.params)
        return result

    # ------------------------------------------------------------------------------------ accounting
    def hzp_state_bytes(self) -> dict:
        return {"param_shard": self.hzp_params.shard_bytes(), "grad_shard": self.hzp_grads.buffer_bytes()}


setattr(HierarchicalZeroOptimizer, STAGE3_AVG_SCATTER_GRADS, HierarchicalZeroOptimizer._reduce_scatter_bucket)


def optimizer_class_for(layout: ResolvedLayout) -> type:
    """A subclass bound to one layout: the engine constructs the optimizer with Stage 3's fixed arguments."""
    return type("HierarchicalZeroOptimizer", (HierarchicalZeroOptimizer,), {"layout": layout})
