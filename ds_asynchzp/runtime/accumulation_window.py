"""The accumulation window (empty / accumulating / reduced, `GradShards.window`) across a step: its cross-node sum
started by the last backward and waited for before anything reads the summed gradients, its end after the step or
a `zero_grad()`, and its reopening by a gradient that arrives after the sum. The readers outside `step()` that wait
for the sum are in `gradient_readers.py`.

A mixin of `HierarchicalZeroOptimizer` (placed before Stage 3 in its bases), on the state its construction
builds: `_hzp_trainable_placements()`, `hzp_offload`, `hzp_read_agreement`, `_hzp_in_step`, `_hzp_warn_once`.
"""

from __future__ import annotations

from ..state.grad_shards import Window


class AccumulationWindow:
    def hzp_start_window_reduction(self) -> None:
        """The window's last backward is over: submit the cross-node sum of every chunk not yet submitted."""
        if any(p.grads.window is Window.ACCUMULATING for p in self._hzp_trainable_placements()):
            self.hzp_read_agreement.window_sum_started()
        for placement in self._hzp_trainable_placements():
            if placement.grads.window is Window.ACCUMULATING:
                placement.boundary.submit_remaining(placement.grads, self.communication_data_type,
                                                    placement.reduce.inflight)

    def hzp_finish_window_to_read(self, what: str) -> None:
        """`hzp_finish_window` for a reader outside step() (`what`, as the user calls it): where the window is
        still open the read starts its cross-node sum, which every rank must do (`ReadAgreement`)."""
        if any(p.grads.window is Window.ACCUMULATING for p in self._hzp_trainable_placements()):
            self.hzp_read_agreement.read_starts_window_sum(what)
        self.hzp_finish_window()

    def hzp_finish_window(self, in_step: bool = False) -> None:
        """Sum the window's gradients across nodes into the owners' atoms and wait (collective; idempotent).
        `in_step`: the step's own call; with offload, the copies to the host may still run after it."""
        self.hzp_start_window_reduction()
        self._hzp_offload_window(copies_may_run=in_step)

    def _hzp_offload_window(self, reopening: bool = False, copies_may_run: bool = False) -> None:
        """Wait for every family's submitted sums, then (offload) copy and take the norms of what stock copies:
        those span every family, so none may be read before its own family's sum has ended."""
        for placement in self._hzp_trainable_placements():
            placement.reduce.drain()
        for placement in self._hzp_trainable_placements():
            placement.boundary.wait_grads()
        if self.hzp_offload is not None:
            self.hzp_offload.finish_window(on_side_stream=reopening, copies_may_run=copies_may_run)
            for placement in self._hzp_trainable_placements():
                placement.grads.buffer.note_host_access()   # the next window's jobs write after these reads

    def _hzp_end_window(self) -> None:
        """After the step, or a zero_grad(): the own rows stay (they are Stage 3's gradient partitions)."""
        if self.hzp_offload is not None:
            self.hzp_offload.end_window()
            for placement in self._hzp_trainable_placements():
                placement.grads.buffer.note_host_access()   # the next window's jobs write after the copies' reads
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

    def _hzp_reopen_window(self, placement) -> None:
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


__all__ = ["AccumulationWindow"]
