"""The engine: stock `DeepSpeedEngine`, except that ZeRO-3 builds the hierarchical optimizer, a forward starts
the prefetch's replay of the recorded fetch order, and the end of the last backward of an accumulation window
(`_backward_epilogue`, which both `engine.backward` and a torch-style backward run) starts the cross-node sum of the
chunks still missing."""

from __future__ import annotations

from ..config import ResolvedLayout
from ..errors import AsyncHZPNotActiveError
from . import checkpoint
from ..platform.deepspeed_internals import DeepSpeedEngine, stage3_optimizer_class_swapped
from .optimizer import HierarchicalZeroOptimizer, optimizer_class_for


class AsyncHZPEngine(DeepSpeedEngine):
    """Set `hzp_layout` on a subclass (see `engine_class_for`): `deepspeed.initialize` builds the engine."""

    hzp_layout: ResolvedLayout = None

    def _configure_zero_optimizer(self, optimizer):
        if optimizer is None:
            raise AsyncHZPNotActiveError(
                "async_hzp needs an optimizer: add an \"optimizer\" section to the ds_config or pass "
                "optimizer= to initialize()")
        with stage3_optimizer_class_swapped(optimizer_class_for(self.hzp_layout)):
            zero_optimizer = super()._configure_zero_optimizer(optimizer)
        if not isinstance(zero_optimizer, HierarchicalZeroOptimizer):
            raise AsyncHZPNotActiveError(
                f"async_hzp is enabled but DeepSpeed built {type(zero_optimizer).__name__}; the config selects "
                "another ZeRO path (check zero_optimization.stage == 3 and that super_offload / offload are off)")
        return zero_optimizer

    def forward(self, *args, **kwargs):
        if isinstance(self.optimizer, HierarchicalZeroOptimizer):
            self.optimizer.hzp_new_micro_step()
        return super().forward(*args, **kwargs)

    def _backward_epilogue(self):
        # Once per backward, after every reentrant phase, for `engine.backward(loss)` and a torch-style
        # `loss.backward()` alike: at the accumulation boundary the window's gradients are final, so the cross-node
        # sum of every chunk not started yet starts. Readers (step(), safe_get_full_grad) wait for it; a later
        # backward of the same window reopens it.
        result = super()._backward_epilogue()
        if isinstance(self.optimizer, HierarchicalZeroOptimizer) and self.is_gradient_accumulation_boundary():
            self.optimizer.hzp_start_window_reduction()
        return result


    # Checkpoints: DeepSpeed's ZeRO-3 format, committed atomically and checked before loading (runtime/checkpoint.py).
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        return checkpoint.save_checkpoint(self, super().save_checkpoint, save_dir, tag, client_state, save_latest,
                                          exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        return checkpoint.load_checkpoint(self, super().load_checkpoint, load_dir, tag, load_module_strict,
                                          load_optimizer_states, load_lr_scheduler_states, load_module_only,
                                          custom_load_fn)

    def _save_zero_checkpoint(self, save_path, tag):
        # DeepSpeed names a rank's optimizer-state file by its rank in the partition group. With d_o < N the
        # N / d_o optimizer replicas hold identical states under identical names: the first replica writes them,
        # so no two ranks write one file at once.
        return checkpoint.save_zero_checkpoint(self, super()._save_zero_checkpoint, save_path, tag)

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False):
        return checkpoint.save_16bit_model(self, super().save_16bit_model, save_dir, save_filename,
                                           exclude_frozen_parameters)


def engine_class_for(layout: ResolvedLayout) -> type:
    return type("AsyncHZPEngine", (AsyncHZPEngine,), {"hzp_layout": layout})
