"""DeepSpeed's ZeRO-3 optimizer with the hierarchical placement.

Subclassing Stage 3 (rather than writing a new engine) keeps everything the engine dispatches on the
optimizer's type: loss scaling, clipping, checkpoint format, `zero.Init` parameters, HF integration. What
changes, and where:

* construction: the parameters are split into families (`placement.py`: the dense ones, and AutoEP's routed
  experts of each expert-data-parallel group), each with its own layout and groups. DeepSpeed partitions each
  family over its optimizer group, and its flat parameter and gradient buffers become the own rows of each
  family's shard buffers (`ParamShards`, `GradShards`): every state exists once;
* per micro-step: the coordinator's gathers read the parameter shards inside each family's d_p group
  (`ParamGather`, on the gather thread, prefetched); each gradient bucket (one family: Stage 3 flushes a bucket
  when the partition group changes) is packed on the training thread, then reduced inside the family's d_g
  group and added to its gradient shard on the reduce thread (`GradReduce`);
* once per step: per family, the gradient sum across nodes, chunk by chunk as the last backward of the window
  completes them (`StepBoundary.grads_complete`, on the boundary thread); the stock step once every chunk is
  summed (with gradient clipping the global norm needs all of them, so the step waits for the last); then the
  parameter refresh, submitted chunk by chunk and waited for by each gather that reads a chunk, so it overlaps
  the next forward; ZeRO-3 persistent parameters are regathered in place once.

Threads, streams and their groups come from `ds_asynchzp.scheduler.context`; with `async_comm: false` the same
jobs run inline, in the same order.

Who owns what: DeepSpeed owns the fp32 master atoms and Adam moments (12 bytes per parameter / d_o) and the
logic of the step; each `Placement`'s `ParamShards` owns its family's low-precision parameter bytes, its
`GradShards` the gradient bytes, its `ProcessGroups` the groups.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .. import ops
from ..platform import ledger
from ..comm.collectives import broadcast, warm_up_groups
from ..comm.grad_reduce import GradReduce
from ..comm.param_gather import GatherSource, ParamGather
from ..comm.step_boundary import StepBoundary
from ..config import ResolvedLayout
from ..layout import HierarchicalLayout
from ..quantization import QuantizationPlan
from ..platform import streams
from ..scheduler.context import CommContext, flows_waited_at_once
from ..state.buffer_pool import BufferPool
from ..state.error_feedback import ErrorFeedback
from ..state.grad_shards import GradShards, Window
from ..state.param_shards import ParamShards
from ..state.partition_watch import PartitionWatch
from ..state.sharded_buffer import ShardedBuffer
from ..platform.deepspeed_internals import (STAGE3_AVG_SCATTER_CONTIGUOUS_GRADS, STAGE3_AVG_SCATTER_GRADS,
                                  DeepSpeedZeroOptimizer_Stage3, at_accumulation_boundary, check_stage3_instance,
                                  ds_comm, install_param_hooks, is_available, is_first_micro_step, is_zero_param,
                                  offload_reduced_since_step, partition_group_of,
                                  rehome_stage3_grad_partitions, rehome_stage3_param_flats, repartition,
                                  restore_param_hooks, stage3_bucket_params, stage3_persistent_parameters,
                                  stage3_prefetches, stage3_side_stream, stage3_sub_groups)
from . import buffer_bytes, buffer_trim
from .gradient_readers import GradientReaders
from .host_offload import HostOffload
from .placement import Family, families_of
from ..platform.process_groups import ProcessGroups, build_process_groups


@dataclass
class Placement:
    """One family's layout, groups, shards and flows (`placement.py` says which families there are)."""

    family: Family
    groups: ProcessGroups
    shards: ParamShards
    quantization: QuantizationPlan
    other_groups: List[ProcessGroups] = field(default_factory=list)  # the family's groups this rank is not in
    trainable: Optional[ShardedBuffer] = None
    grads: Optional[GradShards] = None
    reduce: Optional[GradReduce] = None
    boundary: Optional[StepBoundary] = None
    error_feedback: Optional[ErrorFeedback] = None
    repartitioned_from: Dict[int, object] = field(default_factory=dict)

    def owns(self, param) -> bool:
        return id(param) in self.family.param_ids


class HierarchicalZeroOptimizer(GradientReaders, DeepSpeedZeroOptimizer_Stage3):
    """Set `hzp_layout` on a subclass (see `optimizer_class_for`); the engine builds it with Stage 3's arguments."""

    hzp_layout: ResolvedLayout = None

    def __init__(self, module, init_optimizer, *args, **kwargs):
        layout = self.hzp_layout
        if layout is None:
            raise RuntimeError("HierarchicalZeroOptimizer needs a resolved layout; build it with optimizer_class_for()")
        dp_handle = kwargs.get("dp_process_group") or ds_comm.get_world_group()
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
        super().__init__(module, init_optimizer, *args, **kwargs)
        check_stage3_instance(self)
        if self.offload_optimizer and layout.optimizer_shard_size < layout.world_size:
            self._hzp_warn_once("offload_replicas", (
                f"offload_optimizer with async_hzp.optimizer_shard_size {layout.optimizer_shard_size} < world "
                f"{layout.world_size}: each of the {layout.world_size // layout.optimizer_shard_size} optimizer "
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
        self.hzp_comm = CommContext(layout.async_comm, layout.comm_timeout_s, device, ds_comm.get_rank(),
                                    ds_comm.get_world_size(), layout.issue_order,
                                    flows_waited_at_once(layout.prefetch_depth, stage3_prefetches(self)),
                                    host_copies=bool(self.offload_optimizer))
        if self.offload_optimizer:
            self.hzp_offload = HostOffload(self, lambda ds_id: self._hzp_placement_of[ds_id],
                                           self.hzp_comm.copy_stream)
        self._hzp_param_names = {p.ds_id: name for name, p in module.named_parameters() if is_zero_param(p)}
        for placement in self.hzp_placements:
            self._hzp_build_flows(placement, layout, device)
        self.hzp_pool = BufferPool()
        self.hzp_gather = ParamGather(
            [GatherSource(p.shards, p.groups.param_shard, p.quantization.param_gather, p.boundary.refresh_waits,
                          p.family.tag) for p in self.hzp_placements],
            self.hzp_comm.gather, self.hzp_pool, layout.prefetch_depth)
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
                                          layout.comm_timeout_s, self._hzp_created_groups)
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
        placement.boundary = StepBoundary(placement.groups, layout.boundary_bucket_size, self.reduce_bucket_size,
                                          self.hzp_comm.boundary, plan, placement.error_feedback,
                                          placement.family.tag, after_sum=copier)
        if placement.grads is not None:
            # Gradients are averaged over the whole data-parallel world, experts too (as DeepSpeed does).
            placement.reduce = GradReduce(placement.grads, placement.groups.grad_shard, layout.world_size,
                                          self.reduce_scatter, self.hzp_comm.reduce, plan.grad_reduce_scatter,
                                          placement.family.tag, self._hzp_param_names,
                                          placement.groups.bucket_check)

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

    def initialize_ds_offload(self, *args, **kwargs):
        offload = super().initialize_ds_offload(*args, **kwargs)
        module = args[0] if args else kwargs["module"]
        for placement in self.hzp_placements:
            group = placement.groups.optimizer
            if group.size < placement.family.layout.world:
                # zero.Init (or the conversion above) partitioned over the whole data-parallel world, from rank 0's
                # weights; re-cut every parameter of the family over its optimizer group.
                params = [p for p in module.parameters() if is_zero_param(p) and placement.owns(p)]
                for param in params:
                    placement.repartitioned_from[param.ds_id] = partition_group_of(param)
                repartition(params, group.handle)
        return offload

    def _create_fp16_partitions_with_defragmentation(self, fp16_param_groups):
        super()._create_fp16_partitions_with_defragmentation(fp16_param_groups)
        # Each sub-group holds one partition group's parameters, hence one family's; a family's buffer takes its
        # sub-groups in Stage 3's order, so each sub-group's flat buffer is a column range of one own row.
        sub_groups = stage3_sub_groups(self)
        for placement in self.hzp_placements:
            params = [p for group in sub_groups for p in group if placement.owns(p)]
            if params:
                placement.trainable = placement.shards.adopt_trainable(params)
        flats = []
        for group in sub_groups:
            placement = next(p for p in self.hzp_placements if p.owns(group[0]))
            first = placement.trainable.columns[group[0].ds_id].offset
            flats.append(placement.trainable.own.narrow(0, first, sum(p.partition_numel() for p in group)))
        trainable = self._hzp_trainable_placements()
        rehome_stage3_param_flats(self, flats, trainable[0].trainable.own if len(trainable) == 1 else None)

    def _setup_for_real_optimizer(self):
        super()._setup_for_real_optimizer()
        trainable, views = self._hzp_trainable_placements(), {}
        for placement in trainable:
            params = placement.trainable.params
            # With optimizer replicas, the first one alone carries a gradient kept from the last step into the
            # window (the cross-node sum all-reduces the replicas' own atoms). The shard lives on the device also
            # with optimizer offload (where Stage 3 would put its gradient partitions on the host).
            placement.grads = GradShards(placement.family.layout, placement.groups.dp_rank, params,
                                         self.gradient_accumulation_dtype, placement.trainable.data.device,
                                         carries_previous=placement.groups.outer_replica.rank == 0)
            for param in params:
                views[param.ds_id] = placement.grads.buffer.own_atom(param)
        # Stage 3 reads its flat gradient buffer only in the fp16 overflow check, which `has_overflow` below
        # replaces when the gradients live in several shards.
        rehome_stage3_grad_partitions(self, views, trainable[0].grads.own if len(trainable) == 1 else None)

    def has_overflow(self, partition_gradients=True):
        if partition_gradients and self._hzp_external_gradient_read():
            self.hzp_finish_window()
        owners = self._hzp_trainable_placements()
        # Stage 3's own check accumulates into a flag on `self.device`, the host under offload, from the gradient
        # partitions, which are on the device here.
        if not partition_gradients or (len(owners) <= 1 and self.hzp_offload is None):
            self._hzp_order_overflow_check()
            return super().has_overflow(partition_gradients)
        local = any(not bool(torch.isfinite(p.grads.own).all()) for p in owners)
        flag = torch.tensor([1 if local else 0], dtype=torch.uint8, device=owners[0].grads.own.device)
        ds_comm.all_reduce(flag, op=ds_comm.ReduceOp.MAX)   # every rank: the experts' groups differ
        return bool(flag.item())

    def _hzp_order_overflow_check(self) -> None:
        """Stage 3 reads the gradient partitions on its side stream; our jobs wrote them on theirs. The current
        stream waited for those jobs (`hzp_finish_window`), so the side stream waits on the current one."""
        side = stage3_side_stream(self)
        if side is not None:
            streams.wait(streams.record(), side)

    # ----------------------------------------------------------------------------- per micro-step
    @torch.no_grad()
    def _hzp_reduce_bucket(self, params_to_reduce, communication_data_type, sp_divides: bool = False) -> list:
        """Replaces Stage 3's bucket reduce-scatter over the world: reduce inside the family's grad shard group,
        in the background; in the last backward of the window, start each completed chunk's cross-node sum.
        `sp_divides`: divide by world / sp, not the world (Stage 3's all-reduce path under Ulysses SP)."""
        placement = self._hzp_placement_of[params_to_reduce[0].ds_id]
        first = is_first_micro_step(self)
        if placement.grads.window is Window.REDUCED:
            self._hzp_reopen_window(placement)
        divisor = placement.reduce.divisor // self.sequence_parallel_size if sp_divides else None
        job = placement.reduce.reduce_bucket(params_to_reduce, communication_data_type, first=first, divisor=divisor)
        at_boundary = at_accumulation_boundary(self)
        if self.hzp_offload is not None:
            self.hzp_offload.reduced(params_to_reduce, at_boundary)
        if at_boundary:
            placement.boundary.grads_complete(placement.grads, params_to_reduce, job, self.communication_data_type)
        return [None] * len(params_to_reduce)

    @torch.no_grad()
    def _hzp_reduce_contiguous_bucket(self, buffer_to_reduce, communication_data_type: torch.dtype):
        """Replaces Stage 3's all-reduce path (`reduce_scatter: false`, a bucket within `reduce_bucket_size`; a larger
        one takes the reduce-scatter path); same result, same collective kind. Under Ulysses SP that path alone
        divides by world / sp (the reduce-scatter path by the world), and so does this one."""
        return self._hzp_reduce_bucket(list(stage3_bucket_params(self, communication_data_type)),
                                       communication_data_type, sp_divides=True)

    def partition_grads(self, params_to_release, grad_partitions) -> list:
        """The bucket was packed for reduction already (`_hzp_reduce_bucket`), on the current stream (Stage 3's
        side stream): each gradient's memory is kept from the allocator until that stream has read it, as stock
        does, then the gradients can go."""
        reduced = offload_reduced_since_step(self)
        for param in params_to_release:
            reduced.add(param.ds_id)   # as Stage 3 records them (its unmanaged offload boundary reads them)
            streams.keep_alive(param.grad)
            param.grad = None
        return []

    @torch.no_grad()
    def _hzp_parameter_updated(self, param, full: torch.Tensor) -> None:
        """A caller changed a gathered parameter (`GatheredParameters(modifier_rank=r)`). DeepSpeed broadcast it
        from rank r of the parameter's partition group; with d_o < N that group is one optimizer group of
        several, so the first group's value is broadcast to the others, as stock ZeRO-3 has one source for all."""
        self._hzp_quiesce_params()
        placement = self._hzp_placement_of[param.ds_id]
        outer = placement.groups.outer_replica
        if outer.size > 1:
            def job():
                with ledger.tagged(f"{placement.family.tag}.modified_parameter"):
                    broadcast(full.data, outer, 0).wait()
            # The caller wrote `full` on the current stream.
            self.hzp_comm.boundary.submit(job, "modified-parameter broadcast", outer.name,
                                          after=[streams.record()]).wait()
        placement.shards.set_full(param, full)
        self._hzp_updated.add(param.ds_id)

    def _hzp_parameter_released(self, param) -> None:
        """DeepSpeed re-partitioned a parameter: its gathered buffer goes back to the pool; after an edit, DeepSpeed
        has also just copied the new value into the own atom (on the current stream), which the next gather must
        come after."""
        self.hzp_gather.released(param)
        if param.ds_id in self._hzp_updated:
            self._hzp_updated.discard(param.ds_id)
            self._hzp_placement_of[param.ds_id].shards.buffer_of(param).note_host_access()
            self.hzp_partition_watch.record()

    def _hzp_quiesce_params(self) -> None:
        """Before the parameter shards are rewritten: no gather may read them, no refresh may write them."""
        self.hzp_gather.pause()
        for placement in self.hzp_placements:
            placement.boundary.wait_refresh()

    def hzp_buffer_allocations(self) -> dict:
        """Buffers the communication path has allocated so far, by pool (constant once warmed up)."""
        return buffer_bytes.buffer_allocations(self)

    def hzp_buffer_bytes(self) -> dict:
        """Bytes per rank of the package's own buffers beyond the model states, by kind (`buffer_bytes.KINDS`)."""
        return buffer_bytes.buffer_bytes(self)

    def hzp_new_micro_step(self) -> None:
        """The engine's forward starts a micro-step: the prefetch replays the recorded fetch order."""
        self.hzp_gather.new_sequence()

    # -------------------------------------------------------------------------- accumulation window
    def hzp_start_window_reduction(self) -> None:
        """The window's last backward is over: submit the cross-node sum of every chunk not yet submitted."""
        for placement in self._hzp_trainable_placements():
            if placement.grads.window is Window.ACCUMULATING:
                placement.boundary.submit_remaining(placement.grads, self.communication_data_type,
                                                    placement.reduce.inflight)

    def hzp_finish_window(self) -> None:
        """Sum the window's gradients across nodes into the owners' atoms and wait (collective; idempotent)."""
        self.hzp_start_window_reduction()
        self._hzp_offload_window()

    def _hzp_offload_window(self, reopening: bool = False) -> None:
        """Wait for every family's submitted sums, then (offload) copy and take the norms of what stock copies:
        those span every family, so none may be read before its own family's sum has ended."""
        for placement in self._hzp_trainable_placements():
            placement.reduce.drain()
        for placement in self._hzp_trainable_placements():
            placement.boundary.wait_grads()
        if self.hzp_offload is not None:
            self.hzp_offload.finish_window(on_side_stream=reopening)
            for placement in self._hzp_trainable_placements():
                placement.grads.buffer.note_host_access()   # the next window's jobs write after these reads

    def _hzp_end_window(self) -> None:
        """After the step, or a zero_grad(): the own rows stay (they are Stage 3's gradient partitions)."""
        for placement in self._hzp_trainable_placements():
            placement.reduce.drain()
            placement.boundary.end_window()
            placement.grads.end_step()

    def finalize_gradient_accumulation_boundary(self):
        super().finalize_gradient_accumulation_boundary()
        self.hzp_finish_window()

    def _finalize_offload_gradient_accumulation(self):
        # Stage 3 copies the partitions to the host here, before the window's cross-node sum; they are copied once
        # it is summed (`hzp_finish_window`).
        self.hzp_offload.unmanaged_boundary()

    def _prepare_sub_group(self, sub_group_id, timer_names):
        if self.hzp_offload is not None:
            self.hzp_offload.host_wait()   # DeepSpeedCPUAdam reads the host gradients: their copies have ended
        return super()._prepare_sub_group(sub_group_id, timer_names)

    def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id):
        super()._reassign_or_swap_out_partitioned_parameters(sub_group_id)
        if self.hzp_offload is not None:
            # The host-to-device copy of the stepped sub-group into its columns of the own row: their refresh
            # starts now, while the host steps the next sub-group (the padding zeroed first, as after a step).
            flat = self.fp16_partitioned_groups_flat[sub_group_id]
            self.hzp_offload.stepped_to_device(flat.numel() * flat.element_size())
            first = stage3_sub_groups(self)[sub_group_id][0]
            placement = self._hzp_placement_of[first.ds_id]
            start = placement.trainable.columns[first.ds_id].offset
            placement.shards.zero_padding_in(placement.trainable, start, start + flat.numel())
            placement.boundary.refresh_through(placement.trainable, start + flat.numel())

    def _hzp_reopen_window(self, placement: Placement) -> None:
        """A gradient arrives after its window was summed across nodes (another backward after the window's last
        one, or after a reader waited for the sum): stock ZeRO-3 adds it to its partitions, so the window is
        reopened and will be summed across nodes once more. Every rank runs the same backwards, so every rank
        reopens here, at the same bucket."""
        placement.reduce.drain()
        placement.boundary.end_window()
        if self.hzp_offload is not None:
            # Stock copied (and took the norms of) what its boundary backward reached, with the values then; a
            # later backward copies again only if it is a boundary one too. The copies read the own row that
            # reopening moves aside and zeroes, and the other families' rows once their sums have ended.
            self._hzp_offload_window(reopening=True)
        placement.grads.reopen()
        self._hzp_warn_once(
            "reopened",
            "a gradient arrived after its accumulation window had been summed across nodes (a backward() after "
            "the window's last one by gradient_accumulation_steps, or after the window's gradients were read): it "
            "is added as stock ZeRO-3 adds it, and the window's later gradients cross nodes in a second exchange, "
            "which costs that exchange's bytes again. To avoid it, set gradient_accumulation_steps to the number "
            "of backward() calls per step(), or call engine.set_gradient_accumulation_boundary(False) before every "
            "backward() of a window but the last (True before the last).")

    def _hzp_warn_once(self, key: str, message: str) -> None:
        if key not in self._hzp_warned:
            self._hzp_warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none=set_to_none)
        # Stock Stage 3's zero_grad leaves its gradient partitions as the last backward left them: the next
        # backward copies over them (micro_step_id is 0 again) and a step() reads them. Here the window is summed
        # across nodes now, so the own atoms hold what stock's partitions hold, and it ends as after a step.
        # Inside step(), Stage 3 calls zero_grad after the boundary while it still reads the own atoms.
        if self._hzp_in_step:
            return
        open_windows = [p for p in self._hzp_trainable_placements() if p.grads.window is not Window.EMPTY]
        if not open_windows:
            return
        if any(p.grads.window is Window.ACCUMULATING for p in open_windows):
            self._hzp_warn_once(
                "zero_grad",
                "optimizer.zero_grad() inside an accumulation window: as in stock ZeRO-3, the gradients reduced so "
                "far stay in the partitions (a step() reads them; the next backward() replaces those it reaches), "
                "so the window's gradients cross nodes now, an extra exchange per call. Call zero_grad() after "
                "step() (DeepSpeed's step() already does) to avoid it.")
        self.hzp_finish_window()
        self._hzp_end_window()

    def step(self, closure=None):
        self.hzp_partition_watch.check()
        self.hzp_gather.pause()
        self.hzp_finish_window()
        # The previous refresh reads the own atoms the step is about to overwrite.
        for placement in self.hzp_placements:
            placement.boundary.wait_refresh()
        # Every flow is quiet here, once per step (also when the step is skipped for an overflow).
        buffer_trim.trim_buffers(self)
        self._hzp_in_step = True
        try:
            return super().step(closure)
        except BaseException:
            for placement in self.hzp_placements:
                placement.boundary.drop_open_refresh()   # a refresh begun by the failed step is not resumed
            raise
        finally:
            self._hzp_in_step = False
            self._hzp_end_window()

    def _post_step(self, timer_names):
        # Stock Stage 3 re-gathers persistent parameters over the partition group and drops hpZ secondaries
        # here; instead the parameter shards are refreshed from the updated atoms, in the background. With
        # offload it also forgets the window's per-parameter gradient norms, as here.
        if self.hzp_offload is not None:
            self.reset_cpu_buffers()
        for placement in self._hzp_trainable_placements():
            if self.hzp_offload is None:   # with offload each sub-group's was zeroed, and its refresh began
                placement.shards.zero_padding()
            placement.boundary.start_refresh([placement.trainable])
        self.hzp_partition_watch.record()
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
            self.hzp_gather.all_gather_coalesced(missing, flow="persistent_regather").wait()

    def offload_states(self, *args, **kwargs):
        raise NotImplementedError(
            "offload_states() is not supported with async_hzp: it would move Stage 3's flat parameter and gradient "
            "buffers, which are rows of AsyncHZP's shard buffers here; remove the async_hzp section to use it")

    def reload_states(self, *args, **kwargs):
        raise NotImplementedError("reload_states() is not supported with async_hzp (see offload_states)")

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
        for placement in self.hzp_placements:
            placement.shards.zero_padding()
            frozen = [b for b in placement.shards.buffers if b is not placement.trainable]
            if placement.trainable is not None:
                placement.boundary.start_refresh([placement.trainable])
            placement.boundary.refresh_params(frozen, exact=True)
        self.hzp_partition_watch.record()

    def checkpoint_event_epilogue(self):
        # As stock: persistent parameters come back gathered after a checkpoint save or load.
        self._hzp_regather_persistent(gather_missing=True)

    # ------------------------------------------------------------------------------------ teardown
    def destroy(self):
        # Every job finishes (its failure, if any, surfaces here) before the threads stop.
        try:
            for placement in self._hzp_trainable_placements():
                placement.reduce.drain()
                placement.boundary.end_window()
            self._hzp_quiesce_params()
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


setattr(HierarchicalZeroOptimizer, STAGE3_AVG_SCATTER_GRADS, HierarchicalZeroOptimizer._hzp_reduce_bucket)
setattr(HierarchicalZeroOptimizer, STAGE3_AVG_SCATTER_CONTIGUOUS_GRADS,
        HierarchicalZeroOptimizer._hzp_reduce_contiguous_bucket)


def optimizer_class_for(layout: ResolvedLayout) -> type:
    """A subclass bound to one layout: the engine constructs the optimizer with Stage 3's fixed arguments."""
    return type("HierarchicalZeroOptimizer", (HierarchicalZeroOptimizer,), {"hzp_layout": layout})


__all__ = ["HierarchicalZeroOptimizer", "optimizer_class_for"]
