"""Every Stage 3 reader and writer of the gradient partitions (or their norms) outside `step()` and the backward
epilogue waits for the window's cross-node sum, starting it, collectively, where a backward left it open: the
accessors behind `safe_get_full_grad` and friends, `averaged_gradients`, `_get_norm_groups`. Stage 3 itself reads
them only inside `step()` and writes them in the backward epilogue, where no wait is needed (the flags
`_hzp_in_step` and `_hzp_in_epilogue`). docs/ARCHITECTURE.md lists them.

A mixin placed before Stage 3 in the hierarchical optimizer's bases: it relies on that class's `hzp_comm`,
`hzp_finish_window_to_read` (which has every rank agree on a read that starts the window's sum),
`hzp_offload` and `_hzp_trainable_placements`.
"""

from __future__ import annotations


class GradientReaders:
    _hzp_in_step = False
    _hzp_in_epilogue = False
    hzp_comm = None
    hzp_offload = None

    def _hzp_external_gradient_read(self) -> bool:
        return self.hzp_comm is not None and not self._hzp_in_step and not self._hzp_in_epilogue

    @property
    def averaged_gradients(self):
        if self._hzp_external_gradient_read():
            self.hzp_finish_window_to_read("optimizer.averaged_gradients")
        return self.__dict__["_hzp_averaged_gradients"]

    @averaged_gradients.setter
    def averaged_gradients(self, value):
        self.__dict__["_hzp_averaged_gradients"] = value

    def independent_gradient_partition_epilogue(self):
        self._hzp_in_epilogue = True
        try:
            return super().independent_gradient_partition_epilogue()
        finally:
            self._hzp_in_epilogue = False

    def _get_norm_groups(self):
        if self._hzp_external_gradient_read():
            return self._hzp_gradient_access(super()._get_norm_groups, what="optimizer._get_norm_groups()")
        return super()._get_norm_groups()

    def _hzp_gradient_access(self, call, *args, what: str = ""):
        """DeepSpeed reads or writes the own gradient atoms (on the current stream): the window must be summed
        first, and the next window's jobs must come after this access."""
        self.hzp_finish_window_to_read(what or f"optimizer.{call.__name__}() (behind deepspeed.utils.safe_*_grad)")
        if self.hzp_offload is not None:
            self.hzp_offload.host_wait()   # the accessors read the host gradients (views some of them return)
        result = call(*args)
        for placement in self._hzp_trainable_placements():
            placement.grads.buffer.note_host_access()
        return result

    def get_fp32_grad_for_param(self, param):
        return self._hzp_gradient_access(super().get_fp32_grad_for_param, param)

    def set_fp32_grad_for_param(self, value, param):
        return self._hzp_gradient_access(super().set_fp32_grad_for_param, value, param)

    def get_local_fp32_grad_for_param(self, param):
        return self._hzp_gradient_access(super().get_local_fp32_grad_for_param, param)

    def set_local_grad_for_param(self, value, param):
        return self._hzp_gradient_access(super().set_local_grad_for_param, value, param)

    def get_fp32_grad_partitions(self):
        return self._hzp_gradient_access(super().get_fp32_grad_partitions)

    def update_fp32_grad_for_param_vectorized(self, update_func, param_list):
        return self._hzp_gradient_access(super().update_fp32_grad_for_param_vectorized, update_func, param_list)
