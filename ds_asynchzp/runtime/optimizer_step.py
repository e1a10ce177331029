"""The optimizer step: Stage 3's step, run once the window is summed and the previous refresh has ended; its
overflow check over every family; with optimizer offload, the host step sub-group by sub-group, each stepped
sub-group's refresh begun as soon as it is back on the device (`host_offload.py` says what crosses), or by default
piece by piece, each piece's copy back and refresh under the next one's host step (`host_step_pipeline.py`); after the
step, the refresh of the parameter shards in the background and the persistent parameters regathered.

A mixin of `HierarchicalZeroOptimizer` (placed before Stage 3 in its bases), on the state its construction
builds and the accumulation window's methods (`accumulation_window.py`).
"""

from __future__ import annotations

import contextlib

import torch

from ..platform import ledger, streams
from ..platform.deepspeed_internals import (ds_comm, is_available, stage3_persistent_parameters,
                                            stage3_side_stream, stage3_sub_groups, stage3_unflatten_sub_group,
                                            uses_muon)
from . import buffer_trim
from .host_step_pipeline import unscale_factor


class StepHooks:
    def step(self, closure=None):
        self.hzp_partition_watch.check()
        self.hzp_gather.pause()
        self.hzp_finish_window(in_step=True)
        # The previous refresh reads the own atoms the step is about to overwrite.
        for placement in self.hzp_placements:
            placement.boundary.wait_refresh()
        # Every flow is quiet here, once per step (also when the step is skipped for an overflow).
        buffer_trim.trim_buffers(self)
        self._hzp_in_step = True
        if self.hzp_host_step is not None:
            self.hzp_host_step.begin_step()
        if self.hzp_offload is not None and uses_muon(self):
            self.hzp_offload.host_wait()   # Muon rewrites the host gradients before the sub-groups' steps
        try:
            return super().step(closure)
        except BaseException:
            if self.hzp_host_step is not None:
                self.hzp_host_step.end_step()             # copies back it began finish before anything else
            for placement in self.hzp_placements:
                placement.boundary.drop_open_refresh()   # a refresh begun by the failed step is not resumed
            raise
        finally:
            self._hzp_in_step = False
            self._hzp_end_window()

    # ------------------------------------------------------------------------------------------- overflow
    def has_overflow(self, partition_gradients=True):
        if partition_gradients and self._hzp_external_gradient_read():
            self.hzp_finish_window_to_read("optimizer.has_overflow()")
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

    # ------------------------------------------------------------------------- the host step (offload)
    def _hzp_in_pieces(self, sub_group_id) -> bool:
        """Whether this sub-group's host step runs in pieces (`host_step_pipeline.py`)."""
        return self.hzp_host_step is not None and self.hzp_host_step.takes(sub_group_id)

    def _hzp_offload_phase(self, kind: str):
        """A boundary phase's timing (`ledger.boundary_phase`) of Stage 3's whole-sub-group host step, under offload."""
        return ledger.boundary_phase(kind) if self.hzp_offload is not None else contextlib.nullcontext()

    def _prepare_sub_group(self, sub_group_id, timer_names):
        if self.hzp_offload is not None and not self._hzp_in_pieces(sub_group_id):
            self.hzp_offload.host_wait()   # DeepSpeedCPUAdam reads the host gradients: their copies have ended
        return super()._prepare_sub_group(sub_group_id, timer_names)

    def unscale_and_clip_grads(self, sub_group_id, total_norm):
        if not self._hzp_in_pieces(sub_group_id):
            with self._hzp_offload_phase("host_step"):
                return super().unscale_and_clip_grads(sub_group_id, total_norm)
        # Each piece is scaled just before its host step, once its copy to the host has ended.
        self.hzp_host_step.set_factor(unscale_factor(self.loss_scale, self.clip_grad, total_norm))

    def _optimizer_step(self, sub_group_id):
        if not self._hzp_in_pieces(sub_group_id):
            with self._hzp_offload_phase("host_step"):
                return super()._optimizer_step(sub_group_id)
        self.hzp_host_step.step(sub_group_id, super()._optimizer_step)

    def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id):
        if self._hzp_in_pieces(sub_group_id):
            # Copied back and its refresh submitted piece by piece in `_optimizer_step`.
            stage3_unflatten_sub_group(self, sub_group_id)
            return
        with self._hzp_offload_phase("copy_back"):
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

    # ------------------------------------------------------------------------------------ after the step
    def _post_step(self, timer_names):
        # Stock Stage 3 re-gathers persistent parameters over the partition group and drops hpZ secondaries
        # here; instead the parameter shards are refreshed from the updated atoms, in the background. With
        # offload it also forgets the window's per-parameter gradient norms, as here.
        if self.hzp_offload is not None:
            self.reset_cpu_buffers()
        if self.hzp_host_step is not None:
            self.hzp_host_step.end_step()
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


__all__ = ["StepHooks"]
