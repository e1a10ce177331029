"""DeepSpeed's ZeRO-3 optimizer with the hierarchical placement.

Subclassing Stage 3 (rather than writing a new engine) keeps everything the engine dispatches on the
optimizer's type: loss scaling, clipping, checkpoint format, `zero.Init` parameters, HF integration. What
changes, and where:

* construction: DeepSpeed partitions over the optimizer group (d_o ranks), and its flat parameter and gradient
  buffers become the own rows of our shard buffers (`ParamShards`, `GradShards`): every state exists once;
* per micro-step: the coordinator's gathers read the parameter shards inside the d_p group (`ParamGather`,
  on the gather thread, prefetched); each gradient bucket is packed on the training thread, then reduced
  inside the d_g group and added to the gradient shard on the reduce thread (`GradReduce`);
* once per step: the gradient sum across nodes, chunk by chunk as the last backward of the window completes
  them (`StepBoundary.grads_complete`, on the boundary thread); the stock step once every chunk is summed
  (with gradient clipping the global norm needs all of them, so the step waits for the last); then the
  parameter refresh, submitted chunk by chunk and waited for by each gather that reads a chunk, so it
  overlaps the next forward; ZeRO-3 persistent parameters are regathered in place once.

Threads, streams and their groups come from `ds_asynchzp.scheduler.context`; with `async_comm: false` the same
jobs run inline, in the same order.

Who owns what: DeepSpeed owns the fp32 master atoms and Adam moments (12 bytes per parameter / d_o) and
the logic of the step; `ParamShards` owns every low-precision parameter byte, `GradShards` every gradient
byte, `ProcessGroups` every group.
"""

from __future__ import annotations

from typing import List

import torch

from ..config import ResolvedLayout
from ..layout import HierarchicalLayout
from ..accounting import ledger
from ..comm.collectives import broadcast
from ..comm.grad_reduce import GradReduce
from ..comm.param_gather import ParamGather
from ..comm.step_boundary import StepBoundary
from ..scheduler.context import CommContext
from ..state.buffer_pool import BufferPool
from ..state.error_feedback import ErrorFeedback
from ..state.grad_shards import GradShards, Window
from ..state.param_shards import ParamShards
from .deepspeed_internals import (STAGE3_AVG_SCATTER_CONTIGUOUS_GRADS, STAGE3_AVG_SCATTER_GRADS,
                                  DeepSpeedZeroOptimizer_Stage3, at_accumulation_boundary, check_stage3_instance,
                                  ds_comm,
                                  install_param_hooks, is_available, is_zero_param, partition_group_of,
                                  rehome_stage3_grad_flat,
                                  rehome_stage3_param_flat, repartition, restore_param_hooks, stage3_bucket_params,
                                  stage3_param_flat, stage3_persistent_parameters,
                                  stage3_trainable_params_in_flat_order)
from .process_groups import build_process_groups


class HierarchicalZeroOptimizer(DeepSpeedZeroOptimizer_Stage3):
    """Set `hzp_layout` on a subclass (see `optimizer_class_for`); the engine builds it with Stage 3's arguments."""

    hzp_layout: ResolvedLayout = None

    def __init__(self, module, init_optimizer, *args, **kwargs):
        layout = self.hzp_layout
        if layout is None:
            raise RuntimeError("HierarchicalZeroOptimizer needs a resolved layout; build it with optimizer_class_for()")
        dp_handle = kwargs.get("dp_process_group") or ds_comm.get_world_group()
        dp_ranks = [ds_comm.get_global_rank(dp_handle, r) for r in range(ds_comm.get_world_size(group=dp_handle))]
        self.hzp_grid = HierarchicalLayout(layout.world_size, layout.node_size, layout.param_shard_size,
                                           layout.grad_shard_size, layout.optimizer_shard_size)
        # Every group exists before Stage 3's constructor runs: it calls the hooks below, which need them.
        self.hzp_groups = build_process_groups(self.hzp_grid, dp_ranks, dp_handle)
        self.hzp_params = ParamShards(self.hzp_grid, self.hzp_groups.dp_rank)
        self.hzp_grads: GradShards = None
        self.hzp_trainable_buffer = None
        self._hzp_repartitioned_from = {}
        self._hzp_in_step = False
        kwargs["dp_process_group"] = self.hzp_groups.optimizer.handle
        super().__init__(module, init_optimizer, *args, **kwargs)
        check_stage3_instance(self)
        if self.gradient_predivide_factor != 1.0 or not self.postscale_gradients:
            raise RuntimeError("async_hzp averages gradients by dividing before the sum, as ZeRO-3's default does; "
                               "remove gradient_predivide_factor / prescale_gradients from the ds_config")

        frozen = [p for p in module.parameters() if is_zero_param(p) and not self.hzp_params.holds(p)]
        self.hzp_params.adopt_frozen(frozen)
        device = self.hzp_trainable_buffer.data.device
        self.hzp_comm = CommContext(layout.async_comm, layout.comm_timeout_s, device, ds_comm.get_rank(),
                                    ds_comm.get_world_size())
        bucket = layout.boundary_bucket_size or max(int(self.reduce_bucket_size), 1)
        self.hzp_quantization = layout.quantization_plan()
        self.hzp_error_feedback = (ErrorFeedback(self.hzp_grads.buffer.rows, self.hzp_grads.buffer.width, device)
                                   if self.hzp_quantization.error_feedback else None)
        self.hzp_boundary = StepBoundary(self.hzp_groups, bucket, self.hzp_comm.boundary, self.hzp_quantization,
                                         self.hzp_error_feedback)
        self.hzp_pool = BufferPool()
        self.hzp_gather = ParamGather(self.hzp_params, self.hzp_groups.param_shard, self.hzp_comm.gather,
                                      self.hzp_pool, self.hzp_boundary.refresh_waits, layout.prefetch_depth,
                                      self.hzp_quantization.param_gather)
        self.hzp_reduce = GradReduce(self.hzp_grads, self.hzp_groups.grad_shard, layout.world_size,
                                     self.reduce_scatter, self.hzp_comm.reduce,
                                     self.hzp_quantization.grad_reduce_scatter)
        self.hzp_boundary.refresh_params(self.hzp_params.buffers, exact=True)
        for param in self.hzp_params.params:
            install_param_hooks(param, self.hzp_gather.all_gather_coalesced, self._hzp_parameter_updated,
                                self.hzp_gather.released)
        if layout.log_layout and ds_comm.get_rank() == 0:
            print(f"[ds_asynchzp] {layout.describe()}", flush=True)

    # ------------------------------------------------------------------------- construction hooks
    def initialize_ds_offload(self, *args, **kwargs):
        offload = super().initialize_ds_offload(*args, **kwargs)
        group = self.hzp_groups.optimizer
        if group.size < self.hzp_grid.world:
            # zero.Init (or the conversion above) partitioned over the whole data-parallel world, from rank 0's
            # weights; re-cut every parameter over its optimizer group.
            params = [p for p in args[0].parameters() if is_zero_param(p)] if args else \
                [p for p in kwargs["module"].parameters() if is_zero_param(p)]
            for param in params:
                self._hzp_repartitioned_from[param.ds_id] = partition_group_of(param)
            repartition(params, group.handle)
        return offload

    def _create_fp16_partitions_with_defragmentation(self, fp16_param_groups):
        super()._create_fp16_partitions_with_defragmentation(fp16_param_groups)
        params = stage3_trainable_params_in_flat_order(self)
        self.hzp_trainable_buffer = self.hzp_params.adopt_trainable(params, stage3_param_flat(self))
        rehome_stage3_param_flat(self, self.hzp_trainable_buffer.own)

    def _setup_for_real_optimizer(self):
        super()._setup_for_real_optimizer()
        params = stage3_trainable_params_in_flat_order(self)
        self.hzp_grads = GradShards(self.hzp_grid, self.hzp_groups.dp_rank, params,
                                    self.gradient_accumulation_dtype, self.grad_partitions_flat_buffer.device)
        rehome_stage3_grad_flat(self, self.hzp_grads.own, params)

    # ----------------------------------------------------------------------------- per micro-step
    @torch.no_grad()
    def _hzp_reduce_bucket(self, params_to_reduce, communication_data_type: torch.dtype) -> List[torch.Tensor]:
        """Replaces Stage 3's bucket reduce-scatter over the world: reduce inside the grad shard group, in the
        background; in the last backward of the window, start each completed chunk's cross-node sum."""
        job = self.hzp_reduce.reduce_bucket(params_to_reduce, communication_data_type)
        if at_accumulation_boundary(self):
            self.hzp_boundary.grads_complete(self.hzp_grads, params_to_reduce, job, self.communication_data_type)
        return [None] * len(params_to_reduce)

    @torch.no_grad()
    def _hzp_reduce_contiguous_bucket(self, buffer_to_reduce, communication_data_type: torch.dtype):
        """Replaces Stage 3's all-reduce path (`reduce_scatter: false`); same result, same collective kind."""
        return self._hzp_reduce_bucket(list(stage3_bucket_params(self, communication_data_type)),
                                       communication_data_type)

    def partition_grads(self, params_to_release, grad_partitions) -> list:
        """The bucket was packed for reduction already (`_hzp_reduce_bucket`): the gradients can go."""
        for param in params_to_release:
            param.grad = None
        return []

    @torch.no_grad()
    def _hzp_parameter_updated(self, param, full: torch.Tensor) -> None:
        """A caller changed a gathered parameter (`GatheredParameters(modifier_rank=r)`). DeepSpeed broadcast it
        from rank r of the parameter's partition group; with d_o < N that group is one optimizer group of
        several, so the first group's value is broadcast to the others, as stock ZeRO-3 has one source for all."""
        self._hzp_quiesce_params()
        outer = self.hzp_groups.outer_replica
        if outer.size > 1:
            def job():
                with ledger.tagged("asynchzp.modified_parameter"):
                    broadcast(full.data, outer, 0).wait()
            self.hzp_comm.boundary.submit(job, "modified-parameter broadcast", outer.name).wait()
        self.hzp_params.set_full(param, full)

    def _hzp_quiesce_params(self) -> None:
        """Before the parameter shards are rewritten: no gather may read them, no refresh may write them."""
        self.hzp_gather.pause()
        self.hzp_boundary.wait_refresh()

    def hzp_buffer_allocations(self) -> dict:
        """Buffers the communication path has allocated so far, by pool (constant once warmed up)."""
        return {"gathered_params": self.hzp_pool.allocations, "grad_staging": self.hzp_reduce.staging.allocations,
                "gather_scratch": self.hzp_gather.scratch.get("allocations", 0),
                "reduce_scratch": self.hzp_reduce.scratch.get("allocations", 0),
                "boundary_scratch": self.hzp_boundary.scratch.get("allocations", 0)}

    def hzp_new_micro_step(self) -> None:
        """The engine's forward starts a micro-step: the prefetch replays the recorded fetch order."""
        self.hzp_gather.new_sequence()

    # -------------------------------------------------------------------------- accumulation window
    def hzp_start_window_reduction(self) -> None:
        """The window's last backward is over: submit the cross-node sum of every chunk not yet submitted."""
        if self.hzp_grads.window is Window.ACCUMULATING:
            self.hzp_boundary.submit_remaining(self.hzp_grads, self.communication_data_type, self.hzp_reduce.inflight)

    def hzp_finish_window(self) -> None:
        """Sum the window's gradients across nodes into the owners' atoms and wait (collective; idempotent)."""
        self.hzp_start_window_reduction()
        self.hzp_reduce.drain()
        self.hzp_boundary.wait_grads()

    def _hzp_discard_window(self) -> None:
        self.hzp_reduce.drain()
        self.hzp_boundary.end_window()
        self.hzp_grads.clear()

    def finalize_gradient_accumulation_boundary(self):
        super().finalize_gradient_accumulation_boundary()
        self.hzp_finish_window()

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none=set_to_none)
        # Inside step(), Stage 3 calls zero_grad after the boundary while it still reads the own atoms.
        if not self._hzp_in_step and self.hzp_grads is not None and self.hzp_grads.window is not Window.EMPTY:
            self._hzp_discard_window()

    def step(self, closure=None):
        self.hzp_gather.pause()
        self.hzp_finish_window()
        # The previous refresh reads the own atoms the step is about to overwrite.
        self.hzp_boundary.wait_refresh()
        self._hzp_in_step = True
        try:
            return super().step(closure)
        finally:
            self._hzp_in_step = False
            self._hzp_discard_window()

    def _post_step(self, timer_names):
        # Stock Stage 3 re-gathers persistent parameters over the partition group and drops hpZ secondaries
        # here; instead the parameter shards are refreshed from the updated atoms, in the background.
        self.hzp_params.zero_padding()
        self.hzp_boundary.start_refresh([self.hzp_trainable_buffer])
        self._hzp_regather_persistent(gather_missing=True)
        self.timers.log(timer_names)

    def _hzp_regather_persistent(self, gather_missing: bool) -> None:
        """ZeRO-3 keeps persistent (small) parameters gathered between steps; the step releases them all.
        Rebuild them from the (refreshed) shards with one gather, as stock does, so no pass fetches them.

        At construction they are left to the first forward (`gather_missing=False`): the coordinator records
        its fetch order on the first step and expects to fetch them there."""
        persistent = sorted(stage3_persistent_parameters(self), key=lambda p: p.ds_id)
        self.hzp_gather.regather_in_place([p for p in persistent if is_available(p)])
        missing = [p for p in persistent if not is_available(p)]
        if missing and gather_missing:
            self.hzp_gather.all_gather_coalesced(missing, tag="asynchzp.persistent_regather").wait()

    # ----------------------------------------------- readers and writers of gradients after backward
    def get_fp32_grad_for_param(self, param):
        self.hzp_finish_window()
        return super().get_fp32_grad_for_param(param)

    def set_fp32_grad_for_param(self, value, param):
        self.hzp_finish_window()
        return super().set_fp32_grad_for_param(value, param)

    def get_local_fp32_grad_for_param(self, param):
        self.hzp_finish_window()
        return super().get_local_fp32_grad_for_param(param)

    def set_local_grad_for_param(self, value, param):
        self.hzp_finish_window()
        return super().set_local_grad_for_param(value, param)

    def get_fp32_grad_partitions(self):
        self.hzp_finish_window()
        return super().get_fp32_grad_partitions()

    def update_fp32_grad_for_param_vectorized(self, update_func, param_list):
        self.hzp_finish_window()
        return super().update_fp32_grad_for_param_vectorized(update_func, param_list)

    # -------------------------------------------------------------------------------- checkpoints
    def load_state_dict(self, *args, **kwargs):
        self._hzp_quiesce_params()
        result = super().load_state_dict(*args, **kwargs)
        self._hzp_refresh_loaded()
        return result

    def _load_universal_checkpoint(self, *args, **kwargs):
        self._hzp_quiesce_params()
        result = super()._load_universal_checkpoint(*args, **kwargs)
        self._hzp_refresh_loaded()
        return result

    def _hzp_refresh_loaded(self) -> None:
        """After a checkpoint load: the trainable shards refreshed as after a step (quantized where the step's
        refresh is), so a resumed run holds exactly what the saved run held; frozen ones exactly, as built."""
        self.hzp_params.zero_padding()
        frozen = [buffer for buffer in self.hzp_params.buffers if buffer is not self.hzp_trainable_buffer]
        self.hzp_boundary.start_refresh([self.hzp_trainable_buffer])
        self.hzp_boundary.refresh_params(frozen, exact=True)

    def checkpoint_event_epilogue(self):
        # As stock: persistent parameters come back gathered after a checkpoint save or load.
        self._hzp_regather_persistent(gather_missing=True)

    # ------------------------------------------------------------------------------------ teardown
    def destroy(self):
        # Every job finishes (its failure, if any, surfaces here) before the threads stop.
        try:
            self.hzp_reduce.drain()
            self.hzp_boundary.end_window()
            self._hzp_quiesce_params()
        finally:
            self.hzp_comm.close()
            self.hzp_pool.clear()
        super().destroy()
        params = self.hzp_params.params
        for param in params:
            restore_param_hooks(param)
        # Give each DeepSpeed partition its own storage again, so the shard buffers can go and a later engine
        # on the same module starts from the current weights.
        for param in params:
            param.ds_tensor.data = param.ds_tensor.data.clone()
        groups = {}
        for param in params:
            original = self._hzp_repartitioned_from.get(param.ds_id)
            if original is not None:
                groups.setdefault(id(original), (original, []))[1].append(param)
        for original, members in groups.values():
            repartition(members, original)
        self.hzp_params.buffers.clear()
        self.hzp_grads = None
        self.hzp_groups.destroy()


setattr(HierarchicalZeroOptimizer, STAGE3_AVG_SCATTER_GRADS, HierarchicalZeroOptimizer._hzp_reduce_bucket)
setattr(HierarchicalZeroOptimizer, STAGE3_AVG_SCATTER_CONTIGUOUS_GRADS,
        HierarchicalZeroOptimizer._hzp_reduce_contiguous_bucket)


def optimizer_class_for(layout: ResolvedLayout) -> type:
    """A subclass bound to one layout: the engine constructs the optimizer with Stage 3's fixed arguments."""
    return type("HierarchicalZeroOptimizer", (HierarchicalZeroOptimizer,), {"hzp_layout": layout})


__all__ = ["HierarchicalZeroOptimizer", "optimizer_class_for"]
