"""DeepSpeed's ZeRO-3 optimizer with the hierarchical placement.

Subclassing Stage 3 (rather than writing a new engine) keeps everything the engine dispatches on the
optimizer's type: loss scaling, clipping, checkpoint format, `zero.Init` parameters, HF integration. What
changes, and where:

* construction (this module, and Stage 3's hooks in `shard_adoption.py`): the parameters are split into families
  (`placement.py`: the dense ones, and AutoEP's routed experts of each expert-data-parallel group), each with its
  own layout and groups. DeepSpeed partitions each family over its optimizer group, and its flat parameter and
  gradient buffers become the own rows of each family's shard buffers (`ParamShards`, `GradShards`): every state
  exists once;
* per micro-step (`micro_step.py`): the coordinator's gathers read the parameter shards inside each family's d_p
  group (`ParamGather`, on the gather thread, prefetched); each gradient bucket (one family: Stage 3 flushes a
  bucket when the partition group changes) is packed on the training thread, then reduced inside the family's d_g
  group and added to its gradient shard on the reduce thread (`GradReduce`);
* once per step (`accumulation_window.py`, `optimizer_step.py`): per family, the gradient sum across nodes, chunk
  by chunk as the last backward of the window completes them (`StepBoundary.grads_complete`, on the boundary
  thread); the stock step once every chunk is summed (with gradient clipping the global norm needs all of them, so
  the step waits for the last); then the parameter refresh, submitted chunk by chunk and waited for by each gather
  that reads a chunk, so it overlaps the next forward; ZeRO-3 persistent parameters are regathered in place once.
  Readers of the gradients outside the step wait for the window's sum (`gradient_readers.py`); with optimizer
  offload, `host_offload.py` says what crosses to the host and back;
* checkpoint loads (`checkpoint_hooks.py`): the shards quiet before, refreshed after.

Each of those modules is a mixin of the one class below, on the state its constructor builds; none defines a
name another defines, so the order of the bases changes nothing.

Threads and streams come from `ds_asynchzp.scheduler.context`, process groups from `ds_asynchzp.platform.process_groups`; with `async_comm: false` the same
jobs run inline, in the same order.

Who owns what: DeepSpeed owns the fp32 master atoms and Adam moments (12 bytes per parameter / d_o) and the
logic of the step; each `Placement`'s `ParamShards` owns its family's low-precision parameter bytes, its
`GradShards` the gradient bytes, its `ProcessGroups` the groups.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional

from .. import ops
from ..comm.collectives import warm_up_groups
from ..comm.grad_reduce import GradReduce
from ..comm.param_gather import GatherSource, ParamGather
from ..comm.step_boundary import StepBoundary
from ..config import ResolvedLayout
from ..layout import HierarchicalLayout
from ..scheduler.context import CommContext, flows_waited_at_once
from ..scheduler.read_agreement import ReadAgreement
from ..state.buffer_pool import BufferPool
from ..state.error_feedback import ErrorFeedback
from ..state.param_shards import ParamShards
from ..state.partition_watch import PartitionWatch
from ..platform.deepspeed_internals import (DeepSpeedZeroOptimizer_Stage3, check_stage3_instance, ds_comm,
                                            install_param_hooks, is_zero_param, repartition, restore_param_hooks,
                                            stage3_prefetches)
from ..platform.process_groups import build_process_groups
from . import buffer_bytes
from .accumulation_window import AccumulationWindow
from .buffer_bytes import BufferOwners
from .checkpoint_hooks import CheckpointHooks
from .gradient_readers import GradientReaders
from .host_offload import HostOffload
from .host_step_pipeline import PipelinedHostStep
from .micro_step import MicroStepHooks
from .optimizer_step import StepHooks
from .placement import Family, Placement, families_of
from .shard_adoption import ShardAdoption


class HierarchicalZeroOptimizer(ShardAdoption, MicroStepHooks, AccumulationWindow, GradientReaders, StepHooks,
                                CheckpointHooks, DeepSpeedZeroOptimizer_Stage3):
    """Set `hzp_layout` on a subclass (see `optimizer_class_for`); the engine builds it with Stage 3's arguments."""

    hzp_layout: ResolvedLayout = None

    def __init__(self, module, init_optimizer, *args, **kwargs):
        layout = self.hzp_layout
        if layout is None:
            raise RuntimeError("HierarchicalZeroOptimizer needs a resolved layout; build it with optimizer_class_for()")
        dp_handle = kwargs.get("dp_process_group") or ds_comm.get_world_group()
        sizes, scheduling = layout.sizes, layout.scheduling
        self.hzp_grid = layout.grid()
        # Families are classified (and foreign partition groups refused) before Stage 3 partitions anything; every
        # group exists before Stage 3's constructor runs: it calls the hooks below, which need them.
        self.hzp_placements: List[Placement] = []
        self._hzp_created_groups: list = []   # (handle, ranks, name) in creation order, the same on every rank
        for family in families_of(module, dp_handle, self.hzp_grid):
            self.hzp_placements.append(self._hzp_build_placement(family, layout))
        self.hzp_dense = self.hzp_placements[0]
        self._hzp_placement_of: Dict[int, Placement] = {}
        self._hzp_warned: set = set()   # the one-time warnings given (a reopened window, zero_grad mid-window)
        self._hzp_updated: set = set()   # parameters edited while gathered, until DeepSpeed re-partitions them
        kwargs["dp_process_group"] = self.hzp_dense.groups.optimizer.handle
        self.hzp_offload: Optional[HostOffload] = None
        self.hzp_host_step: Optional[PipelinedHostStep] = None
        super().__init__(module, init_optimizer, *args, **kwargs)
        check_stage3_instance(self)
        if self.offload_optimizer and sizes.optimizer_shard_size < sizes.world_size:
            self._hzp_warn_once("offload_replicas", (
                f"offload_optimizer with async_hzp.optimizer_shard_size {sizes.optimizer_shard_size} < world "
                f"{sizes.world_size}: each of the {sizes.world_size // sizes.optimizer_shard_size} optimizer "
                "replicas holds and steps its states on its own host, so host memory and the host step's time "
                "per rank are that many times stock's; leave optimizer_shard_size unset (the world) to avoid it"))
        if self.gradient_predivide_factor != 1.0 or not self.postscale_gradients:
            raise RuntimeError("async_hzp averages gradients by dividing before the sum, as ZeRO-3's default does; "
                               "remove gradient_predivide_factor / prescale_gradients from the ds_config")

        for placement in self.hzp_placements:
            frozen = [p for p in module.parameters() if is_zero_param(p) and placement.owns(p)
                      and not placement.shards.holds(p)]
            placement.shards.adopt_frozen(frozen)
        device = self.hzp_dense.trainable.data.device if self.hzp_dense.trainable is not None else \
            next(p.ds_tensor.device for p in module.parameters() if is_zero_param(p))
        # Build (or load) the compiled ops now, on the training thread: a first build takes minutes on a small
        # machine, and inside the first communication job it would count against that job's timeout.
        ops.status(device)
        warm_up_groups(self._hzp_created_groups, device)
        # Nothing gathered ahead (no replay, no coordinator prefetch): each gather is waited for as soon as it is
        # asked for, so it runs on the training thread, as with async_comm false.
        self.hzp_comm = CommContext(scheduling.async_comm, scheduling.comm_timeout_s, device, ds_comm.get_rank(),
                                    ds_comm.get_world_size(), scheduling.issue_order,
                                    flows_waited_at_once(scheduling.prefetch_depth, stage3_prefetches(self)),
                                    host_copies=bool(self.offload_optimizer))
        self.hzp_read_agreement = ReadAgreement.for_engine(ds_comm.get_rank(), ds_comm.get_world_size(),
                                                           scheduling.comm_timeout_s)
        if self.offload_optimizer:
            self.hzp_offload = HostOffload(self, lambda ds_id: self._hzp_placement_of[ds_id],
                                           self.hzp_comm.copy_stream)
            if scheduling.offload_pipeline:
                self.hzp_host_step = PipelinedHostStep(self, self.hzp_comm.copy_back_stream, self._hzp_say_once)
        self._hzp_param_names = {p.ds_id: name for name, p in module.named_parameters() if is_zero_param(p)}
        for placement in self.hzp_placements:
            self._hzp_build_flows(placement, layout, device)
        self.hzp_pool = BufferPool()
        self.hzp_gather = ParamGather(
            [GatherSource(p.shards, p.groups.param_shard, p.quantization.param_gather, p.boundary.refresh_waits,
                          p.family.tag) for p in self.hzp_placements],
            self.hzp_comm.gather, self.hzp_pool, scheduling.prefetch_depth)
        for placement in self.hzp_placements:
            placement.boundary.refresh_params(placement.shards.buffers, exact=True)
            for param in placement.shards.params:
                self._hzp_placement_of[param.ds_id] = placement
                install_param_hooks(param, self.hzp_gather.all_gather_coalesced, self._hzp_parameter_updated,
                                    self._hzp_parameter_released)
        self.hzp_partition_watch = PartitionWatch([b for p in self.hzp_placements
                                                   if not p.shards.own_writes_reach_every_gather
                                                   for b in p.shards.buffers], self._hzp_param_names)
        self.hzp_partition_watch.record()
        if layout.log_layout and ds_comm.get_rank() == 0:
            print(f"[ds_asynchzp] {layout.describe()}", flush=True)
            for placement in self.hzp_placements[1:]:
                plan = placement.quantization
                print(f"[ds_asynchzp] {placement.family.describe()}" + (f"; {plan.describe()}" if plan.any else ""),
                      flush=True)

    # ------------------------------------------------------------------------- construction
    def _hzp_build_placement(self, family: Family, layout: ResolvedLayout) -> Placement:
        """Create the family's groups (every group of every rank's instance of it, in one order on every rank)."""
        mine, others = None, []
        for ranks in family.every_group:
            handle = family.partition_handle if ranks == family.dp_ranks else None
            groups = build_process_groups(family.layout, list(ranks), handle, family.group_prefix,
                                          layout.scheduling.comm_timeout_s, self._hzp_created_groups)
            if groups.member:
                mine = groups
            else:
                others.append(groups)
        return Placement(family, mine, ParamShards(family.layout, mine.dp_rank),
                         layout.quantization_plan(family.layout), others)

    def _hzp_build_flows(self, placement: Placement, layout: ResolvedLayout, device) -> None:
        plan = placement.quantization
        if plan.error_feedback and placement.grads is not None:
            placement.error_feedback = ErrorFeedback(placement.grads.buffer.rows, placement.grads.buffer.width,
                                                     device)
        copier = (self.hzp_offload.copier(placement)
                  if self.hzp_offload is not None and placement.grads is not None else None)
        placement.boundary = StepBoundary(placement.groups, layout.scheduling.boundary_bucket_size, self.reduce_bucket_size,
                                          self.hzp_comm.boundary, plan, placement.error_feedback,
                                          placement.family.tag, after_sum=copier)
        if placement.grads is not None:
            # Gradients are averaged over the whole data-parallel world, experts too (as DeepSpeed does).
            placement.reduce = GradReduce(placement.grads, placement.groups.grad_shard, layout.sizes.world_size,
                                          self.reduce_scatter, self.hzp_comm.reduce, plan.grad_reduce_scatter,
                                          placement.family.tag, self._hzp_param_names,
                                          placement.groups.bucket_check)

    # ------------------------------------------------------------------------ what the optimizer holds
    @property
    def hzp_error_feedback(self) -> Optional[ErrorFeedback]:
        """The dense family's error-feedback residual (checkpoints save every family's: `hzp_error_feedbacks`)."""
        return self.hzp_dense.error_feedback

    def hzp_family_layouts(self) -> Dict[str, HierarchicalLayout]:
        """Each family's layout (dense first, then AutoEP's expert groups), as reports and tests show them."""
        return {p.family.name: p.family.layout for p in self.hzp_placements}

    def hzp_error_feedbacks(self) -> Dict[str, ErrorFeedback]:
        return {p.family.name: p.error_feedback for p in self.hzp_placements if p.error_feedback is not None}

    def _hzp_trainable_placements(self) -> List[Placement]:
        """The families with trainable parameters on this rank (their shards, gradients and flows exist from
        Stage 3's construction on, until `destroy`)."""
        return [p for p in self.hzp_placements if p.trainable is not None]

    def hzp_buffer_owners(self) -> BufferOwners:
        """The owners of the package's buffers beyond the model states (`buffer_bytes`, `buffer_trim`)."""
        trainable = tuple(self._hzp_trainable_placements())
        return BufferOwners(pool=self.hzp_pool, gather=self.hzp_gather, gather_runner=self.hzp_comm.gather,
                            families=tuple(self.hzp_placements), trainable=trainable,
                            host_copies=self.hzp_offload is not None)

    def hzp_buffer_allocations(self) -> dict:
        """Buffers the communication path has allocated so far, by pool (constant once warmed up)."""
        return buffer_bytes.buffer_allocations(self)

    def hzp_buffer_bytes(self) -> dict:
        """Bytes per rank of the package's own buffers beyond the model states, by kind (`buffer_bytes.KINDS`)."""
        return buffer_bytes.buffer_bytes(self)

    def _hzp_say_once(self, key: str, message: str) -> None:
        """Rank 0 prints `message` once (what the run does instead of an option, where that is stock's behaviour)."""
        if key not in self._hzp_warned:
            self._hzp_warned.add(key)
            if ds_comm.get_rank() == 0:
                print(f"[ds_asynchzp] {message}", flush=True)

    def _hzp_warn_once(self, key: str, message: str) -> None:
        if key not in self._hzp_warned:
            self._hzp_warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    # ------------------------------------------------------------------------------------ teardown
    def destroy(self):
        # Every job finishes (its failure, if any, surfaces here) before the threads stop.
        try:
            for placement in self._hzp_trainable_placements():
                placement.reduce.drain()
                placement.boundary.end_window()
            self.hzp_quiesce_params()
        finally:
            self.hzp_comm.close()
            self.hzp_pool.clear()
            self.hzp_gather.close()
            self.hzp_partition_watch = PartitionWatch([], {})   # lets the shard buffers go
        super().destroy()
        for placement in self.hzp_placements:
            params = placement.shards.params
            for param in params:
                restore_param_hooks(param)
            # Give each DeepSpeed partition its own storage again, so the shard buffers can go and a later engine
            # on the same module starts from the current weights.
            for param in params:
                param.ds_tensor.data = param.ds_tensor.data.clone()
            originals = {}
            for param in params:
                original = placement.repartitioned_from.get(param.ds_id)
                if original is not None:
                    originals.setdefault(id(original), (original, []))[1].append(param)
            for original, members in originals.values():
                repartition(members, original)
            placement.shards.buffers.clear()
            placement.trainable = placement.grads = None
            placement.groups.destroy()
            for groups in placement.other_groups:
                groups.destroy()
        self._hzp_created_groups.clear()


def optimizer_class_for(layout: ResolvedLayout) -> type:
    """A subclass bound to one layout: the engine constructs the optimizer with Stage 3's fixed arguments."""
    return type("HierarchicalZeroOptimizer", (HierarchicalZeroOptimizer,), {"hzp_layout": layout})


__all__ = ["HierarchicalZeroOptimizer", "optimizer_class_for"]
