"""The engine: stock `DeepSpeedEngine`, except that ZeRO-3 builds the hierarchical optimizer."""

from __future__ import annotations

from .config import ResolvedLayout
from .deepspeed_internals import DeepSpeedEngine, stage3_optimizer_class_swapped
from .hierarchical_optimizer import HierarchicalZeroOptimizer, optimizer_class_for


class AsyncHZPNotActiveError(RuntimeError):
    """AsyncHZP was requested but the run would silently train with another optimizer."""


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


def engine_class_for(layout: ResolvedLayout) -> type:
    return type("AsyncHZPEngine", (AsyncHZPEngine,), {"hzp_layout": layout})
