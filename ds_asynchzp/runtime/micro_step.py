"""Per micro-step: Stage 3's bucket reduction replaced by ours, its gradients released once packed, and the hooks
on each parameter (released after use, or edited while gathered under `GatheredParameters(modifier_rank=r)`).

A mixin of `HierarchicalZeroOptimizer` (placed before Stage 3 in its bases), on the state its construction
builds: `_hzp_placement_of`, `hzp_gather`, `hzp_comm`, `hzp_offload`, `hzp_partition_watch`, `_hzp_updated`.
"""

from __future__ import annotations

import torch

from ..comm.collectives import broadcast
from ..platform import ledger, streams
from ..platform.deepspeed_internals import (STAGE3_AVG_SCATTER_CONTIGUOUS_GRADS, STAGE3_AVG_SCATTER_GRADS,
                                            at_accumulation_boundary, is_first_micro_step,
                                            offload_reduced_since_step, stage3_bucket_params)
from ..state.grad_shards import Window


class MicroStepHooks:
    # ------------------------------------------------------------------------------------------- gradients
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

    # ------------------------------------------------------------------------------------------- parameters
    @torch.no_grad()
    def _hzp_parameter_updated(self, param, full: torch.Tensor) -> None:
        """A caller changed a gathered parameter (`GatheredParameters(modifier_rank=r)`). DeepSpeed broadcast it
        from rank r of the parameter's partition group; with d_o < N that group is one optimizer group of
        several, so the first group's value is broadcast to the others, as stock ZeRO-3 has one source for all."""
        self.hzp_quiesce_params()
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

    def hzp_quiesce_params(self) -> None:
        """Before the parameter shards are rewritten: no gather may read them, no refresh may write them."""
        self.hzp_gather.pause()
        for placement in self.hzp_placements:
            placement.boundary.wait_refresh()

    def hzp_new_micro_step(self) -> None:
        """The engine's forward starts a micro-step: the prefetch replays the recorded fetch order."""
        self.hzp_read_agreement.forward_started()
        self.hzp_gather.new_sequence()


# Stage 3 reduces each gradient bucket through these two names (its reduce-scatter and its all-reduce path).
setattr(MicroStepHooks, STAGE3_AVG_SCATTER_GRADS, MicroStepHooks._hzp_reduce_bucket)
setattr(MicroStepHooks, STAGE3_AVG_SCATTER_CONTIGUOUS_GRADS, MicroStepHooks._hzp_reduce_contiguous_bucket)

__all__ = ["MicroStepHooks"]
