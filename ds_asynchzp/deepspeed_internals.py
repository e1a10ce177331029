"""Every private DeepSpeed name this package relies on, in one place.

DeepSpeed's ZeRO-3 internals move between releases (MiCS rotted exactly this way), so the package pins one
release and checks, at import, that each private symbol it touches is still where it expects it. A failed
check names what moved instead of failing later in the middle of a training step.

Nothing outside this module may reach into a private DeepSpeed attribute; the rest of the package goes
through the small helpers below.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Callable, Iterator

import deepspeed
import deepspeed.comm as ds_comm
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero import stage3 as _stage3_module
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

SUPPORTED_DEEPSPEED_VERSION = "0.19.8"

# Name-mangled members of DeepSpeedZeroOptimizer_Stage3 that the hierarchical optimizer overrides or reads.
STAGE3_AVG_SCATTER_GRADS = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
STAGE3_GRAD_PARTITION_BY_PARAM_ID = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"

# (owner, attribute, what we use it for). Checked at import.
_REQUIRED_CLASS_MEMBERS = [
    (DeepSpeedEngine, "_configure_zero_optimizer", "selects the ZeRO-3 optimizer class"),
    (DeepSpeedZeroOptimizer_Stage3, STAGE3_AVG_SCATTER_GRADS, "per-bucket gradient reduce-scatter"),
    (DeepSpeedZeroOptimizer_Stage3, "partition_grads", "stores reduced gradient partitions"),
    (DeepSpeedZeroOptimizer_Stage3, "_post_step", "runs after the optimizer step (secondary invalidation)"),
    (DeepSpeedZeroOptimizer_Stage3, "step", "the optimizer step"),
    (DeepSpeedZeroOptimizer_Stage3, "_get_param_partition_group", "per-parameter partition group"),
    (DeepSpeedZeroOptimizer_Stage3, "destroy", "releases hooks and buffers"),
]


class DeepSpeedInternalsError(ImportError):
    """The installed DeepSpeed does not expose a private symbol this package needs."""


def _self_check() -> None:
    problems = []
    if deepspeed.__version__.split("+")[0] != SUPPORTED_DEEPSPEED_VERSION:
        problems.append(f"deepspeed version is {deepspeed.__version__}, expected {SUPPORTED_DEEPSPEED_VERSION} "
                        f"(install it with: pip install deepspeed=={SUPPORTED_DEEPSPEED_VERSION})")
    for owner, attribute, purpose in _REQUIRED_CLASS_MEMBERS:
        if not hasattr(owner, attribute):
            problems.append(f"{owner.__module__}.{owner.__qualname__}.{attribute} is gone ({purpose})")
    if getattr(deepspeed, "DeepSpeedEngine", None) is not DeepSpeedEngine:
        problems.append("deepspeed.DeepSpeedEngine is no longer the module-global engine class that "
                        "deepspeed.initialize looks up at call time")
    if not hasattr(_stage3_module, "DeepSpeedZeroOptimizer_Stage3"):
        problems.append("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3 is no longer a module "
                        "attribute (the engine imports it lazily by that name)")
    for member in ("NOT_AVAILABLE", "INFLIGHT", "AVAILABLE"):
        if not hasattr(ZeroParamStatus, member):
            problems.append(f"ZeroParamStatus.{member} is gone (parameter gather protocol)")
    if problems:
        raise DeepSpeedInternalsError("ds_asynchzp cannot use the installed DeepSpeed:\n  - " + "\n  - ".join(problems))


_self_check()


# ---------------------------------------------------------------------------------------------- engine seams
@contextlib.contextmanager
def engine_class_swapped(engine_class: type) -> Iterator[None]:
    """`deepspeed.initialize` constructs `deepspeed.DeepSpeedEngine`, looked up at call time."""
    original = deepspeed.DeepSpeedEngine
    deepspeed.DeepSpeedEngine = engine_class
    try:
        yield
    finally:
        deepspeed.DeepSpeedEngine = original


@contextlib.contextmanager
def stage3_optimizer_class_swapped(optimizer_class: type) -> Iterator[None]:
    """`DeepSpeedEngine._configure_zero_optimizer` imports the Stage 3 optimizer lazily by module attribute."""
    original = _stage3_module.DeepSpeedZeroOptimizer_Stage3
    _stage3_module.DeepSpeedZeroOptimizer_Stage3 = optimizer_class
    try:
        yield
    finally:
        _stage3_module.DeepSpeedZeroOptimizer_Stage3 = original


def grad_partition_of(optimizer: DeepSpeedZeroOptimizer_Stage3, param):
    """The fp32 buffer that holds this rank's 1/world gradient partition handed to the optimizer step."""
    return getattr(optimizer, STAGE3_GRAD_PARTITION_BY_PARAM_ID)[param.ds_id]


def partition_rank_of(optimizer: DeepSpeedZeroOptimizer_Stage3, param) -> int:
    """This rank's index in the group the parameter's primary partition is spread over."""
    return ds_comm.get_rank(group=optimizer._get_param_partition_group(param))


# ------------------------------------------------------------------------------------------ parameter state
def is_zero_param(param) -> bool:
    return hasattr(param, "ds_id") and hasattr(param, "ds_tensor")


def primary_partition(param):
    """DeepSpeed's own 1/world partition of the parameter: the source of truth updated by the step."""
    return param.ds_tensor


def mark_inflight(params) -> None:
    for param in params:
        if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            raise RuntimeError(f"parameter {param.ds_id} is {param.ds_status}, expected NOT_AVAILABLE before a gather")
        param.ds_status = ZeroParamStatus.INFLIGHT


def mark_available(param, full_data) -> None:
    param.data = full_data
    param.ds_status = ZeroParamStatus.AVAILABLE


def install_gather(param, gather: Callable) -> None:
    """The parameter coordinator gathers through `param.all_gather_coalesced(params, quantize=...)`."""
    param.all_gather_coalesced = gather


def wrap_partition(param, after_partition: Callable) -> None:
    """Call `after_partition(param, full_data)` when a caller re-partitions a modified parameter
    (`GatheredParameters(modifier_rank=...)` passes has_been_updated=True)."""
    original = param.partition

    def partition(param_list=None, hierarchy=0, has_been_updated=False, free_data=True):
        if has_been_updated:
            for p in (param_list or [param]):
                after_partition(p, p.data)
        return original(param_list=param_list, hierarchy=hierarchy, has_been_updated=has_been_updated,
                        free_data=free_data)

    param.partition = partition


def stage3_model_state_tensors(optimizer, module) -> dict:
    """The tensors that hold model states under a (stock or hierarchical) Stage 3 optimizer, by role."""
    params = [p for p in module.parameters() if is_zero_param(p)]
    optimizer_state = []
    for state in getattr(optimizer, "optimizer").state.values():
        optimizer_state.extend(v for v in state.values() if hasattr(v, "untyped_storage") and v.dim() > 0)
    return {
        "param_primary": [p.ds_tensor for p in params],
        "param_secondary": [p.ds_secondary_tensor for p in params if p.ds_secondary_tensor is not None],
        "master": [t for t in optimizer.fp32_partitioned_groups_flat if t is not None],
        "optimizer_state": optimizer_state,
        "grad_primary": [optimizer.grad_partitions_flat_buffer],
    }


# ------------------------------------------------------------------------------------------------- comm
def comm_backend():
    """The object whose methods every `deepspeed.comm` collective ends in (`deepspeed.comm.comm.cdb`)."""
    module = importlib.import_module("deepspeed.comm.comm")
    return module.cdb


__all__ = [
    "DeepSpeedEngine", "DeepSpeedZeroOptimizer_Stage3", "ZeroParamStatus", "SUPPORTED_DEEPSPEED_VERSION",
    "DeepSpeedInternalsError", "engine_class_swapped", "stage3_optimizer_class_swapped", "grad_partition_of",
    "is_zero_param", "primary_partition", "mark_inflight", "mark_available", "install_gather", "wrap_partition",
    "comm_backend", "ds_comm", "stage3_model_state_tensors", "partition_rank_of",
]
