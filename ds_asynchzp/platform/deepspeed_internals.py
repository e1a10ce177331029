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
import os
from pathlib import Path
from typing import Callable, Iterator

import deepspeed
import deepspeed.comm as ds_comm
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero import stage3 as _stage3_module
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from deepspeed.runtime.zero.partition_parameters import Init as _ZeroInit
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.utils import groups as _ds_groups
import torch

SUPPORTED_DEEPSPEED_VERSION = "0.19.8"

from ..errors import DeepSpeedInternalsError

# Name-mangled members of DeepSpeedZeroOptimizer_Stage3 that the hierarchical optimizer overrides or reads.
STAGE3_AVG_SCATTER_GRADS = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
STAGE3_AVG_SCATTER_CONTIGUOUS_GRADS = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads"
STAGE3_GRAD_PARTITION_BY_PARAM_ID = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"

# (owner, attribute, what we use it for). Checked at import.
_REQUIRED_CLASS_MEMBERS = [
    (DeepSpeedEngine, "_configure_zero_optimizer", "selects the ZeRO-3 optimizer class"),
    (DeepSpeedZeroOptimizer_Stage3, STAGE3_AVG_SCATTER_GRADS, "per-bucket gradient reduce-scatter"),
    (DeepSpeedZeroOptimizer_Stage3, STAGE3_AVG_SCATTER_CONTIGUOUS_GRADS, "per-bucket all-reduce (reduce_scatter=false)"),
    (DeepSpeedZeroOptimizer_Stage3, "initialize_ds_offload", "converts the module's parameters to ZeRO-3 parameters"),
    (DeepSpeedZeroOptimizer_Stage3, "_create_fp16_partitions_with_defragmentation", "builds the flat parameter buffer"),
    (DeepSpeedZeroOptimizer_Stage3, "_set_fp16_partitioned_groups_flat", "slices the flat parameter buffer per sub-group"),
    (DeepSpeedZeroOptimizer_Stage3, "_setup_for_real_optimizer", "builds the flat gradient partition buffer"),
    (DeepSpeedZeroOptimizer_Stage3, "zero_grad", "clears the accumulation window"),
    (DeepSpeedZeroOptimizer_Stage3, "finalize_gradient_accumulation_boundary", "unmanaged accumulation boundary"),
    (DeepSpeedZeroOptimizer_Stage3, "checkpoint_event_epilogue", "regathers persistent parameters after checkpoints"),
    (DeepSpeedZeroOptimizer_Stage3, "load_state_dict", "loads a checkpoint into the partitions"),
    (DeepSpeedZeroOptimizer_Stage3, "_load_universal_checkpoint", "loads a universal checkpoint"),
    (DeepSpeedZeroOptimizer_Stage3, "get_fp32_grad_for_param", "safe_get_full_grad"),
    (DeepSpeedZeroOptimizer_Stage3, "set_fp32_grad_for_param", "safe_set_full_grad"),
    (DeepSpeedZeroOptimizer_Stage3, "get_local_fp32_grad_for_param", "safe_get_local_grad"),
    (DeepSpeedZeroOptimizer_Stage3, "set_local_grad_for_param", "safe_set_local_grad"),
    (DeepSpeedZeroOptimizer_Stage3, "get_fp32_grad_partitions", "gradient partitions by group"),
    (DeepSpeedZeroOptimizer_Stage3, "update_fp32_grad_for_param_vectorized", "vectorized gradient update"),
    (DeepSpeedEngine, "_backward_epilogue", "the end of a backward pass (engine or torch-style) at the boundary"),
    (DeepSpeedEngine, "forward", "the start of a micro-step (prefetch replay)"),
    (DeepSpeedEngine, "_save_zero_checkpoint", "writes one rank's optimizer-state file"),
    (DeepSpeedEngine, "_get_zero_param_shapes", "parameter order of checkpoints"),
    (DeepSpeedZeroOptimizer_Stage3, "partition_grads", "stores reduced gradient partitions"),
    (DeepSpeedZeroOptimizer_Stage3, "_post_step", "runs after the optimizer step (secondary invalidation)"),
    (DeepSpeedZeroOptimizer_Stage3, "step", "the optimizer step"),
    (DeepSpeedZeroOptimizer_Stage3, "_get_param_partition_group", "per-parameter partition group"),
    (DeepSpeedZeroOptimizer_Stage3, "destroy", "releases hooks and buffers"),
    (DeepSpeedZeroOptimizer_Stage3, "has_overflow", "fp16 overflow check over every family's gradients"),
    (DeepSpeedZeroOptimizer_Stage3, "independent_gradient_partition_epilogue", "writes averaged_gradients (no wait)"),
    (DeepSpeedZeroOptimizer_Stage3, "_get_norm_groups", "gradient norms read outside step() wait for the window"),
    (DeepSpeedZeroOptimizer_Stage3, "offload_states", "refused: it would move the shard buffers' rows"),
    (DeepSpeedZeroOptimizer_Stage3, "reload_states", "refused with offload_states"),
    (DeepSpeedZeroOptimizer_Stage3, "reset_cpu_buffers", "optimizer offload: forgets the per-parameter norms"),
    (DeepSpeedZeroOptimizer_Stage3, "_prepare_sub_group", "optimizer offload: before the host step of a sub-group"),
    (DeepSpeedZeroOptimizer_Stage3, "_finalize_offload_gradient_accumulation",
     "optimizer offload: the unmanaged boundary's copy, made once the window is summed"),
    (DeepSpeedZeroOptimizer_Stage3, "_reassign_or_swap_out_partitioned_parameters",
     "optimizer offload: a sub-group's host-to-device copy of the stepped parameters"),
    (DeepSpeedZeroOptimizer_Stage3, "_optimizer_step", "optimizer offload: the host step of a sub-group"),
    (DeepSpeedZeroOptimizer_Stage3, "unscale_and_clip_grads", "optimizer offload: the host gradients' scaling"),
    (DeepSpeedZeroOptimizer_Stage3, "_unflatten_partitioned_parameters",
     "optimizer offload: the partitions pointed at the flat buffer after a host step in pieces"),
]


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
    for name in ("_create_zero_param_parallel_group", "_ZERO_PARAM_INTRA_PARALLEL_GROUP"):
        if not hasattr(_ds_groups, name):
            problems.append(f"deepspeed.utils.groups.{name} is gone (hpZ groups of engines without an optimizer)")
    for member in ("_convert_to_deepspeed_param", "num_persisted_parameters", "num_persisted_elements",
                   "override_module_apply"):
        if not hasattr(_ZeroInit, member):
            problems.append(f"deepspeed.zero.Init.{member} is gone (zero.Init-built reference models given "
                            "hpZ's copy inside the node)")
    for member in ("NOT_AVAILABLE", "INFLIGHT", "AVAILABLE"):
        if not hasattr(ZeroParamStatus, member):
            problems.append(f"ZeroParamStatus.{member} is gone (parameter gather protocol)")
    problems += _cpu_comm_workspace_problems()
    try:
        optimizer_state_file_classes()
    except ImportError as error:
        problems.append(f"{error} (the classes ZeRO optimizer-state files pickle, allowed when checkpoints load)")
    if problems:
        raise DeepSpeedInternalsError("ds_asynchzp cannot use the installed DeepSpeed:\n  - " + "\n  - ".join(problems))


# DeepSpeed's CPU communication op creates a shared-memory workspace for each rank (66 MiB), named
# deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>, and never unlinks it: every process that
# initialises deepspeed.comm on CPU leaves one in /dev/shm, which is RAM. Launchers remove them (bench/launch.py).
_CPU_COMM_SOURCE = Path(deepspeed.__file__).parent / "ops" / "csrc" / "cpu" / "comm" / "shm.cpp"
_CPU_COMM_NAME_LINES = ('#define SHM_BUFFER_NAME "deepspeed_allreduce_buffer"', '"%s_%d_%s_%s"')


def _cpu_comm_workspace_problems() -> list:
    if not _CPU_COMM_SOURCE.is_file():   # an installation without the op's sources cannot build it either
        return []
    text = _CPU_COMM_SOURCE.read_text(errors="replace")
    return [f"{_CPU_COMM_SOURCE} no longer has {line} (the name of the CPU op's shared-memory workspaces, which "
            "launchers remove)" for line in _CPU_COMM_NAME_LINES if line not in text]


def optimizer_state_file_classes() -> list:
    """DeepSpeed's classes that a ZeRO optimizer-state file pickles: what `torch.load(weights_only=True)` must
    allow to read one."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [ZeroStageEnum, LossScaler, DynamicLossScaler]


def cpu_comm_workspaces(master_addr: str, master_port: int) -> list:
    """The shared-memory workspaces DeepSpeed's CPU communication op left for one rendezvous address."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{master_addr}_{master_port}_*"))


_self_check()


# ---------------------------------------------------------------------------------------------- engine seams
@contextlib.contextmanager
def _attribute_swapped(owner, name: str, value) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def engine_class_swapped(engine_class: type):
    """`deepspeed.initialize` constructs `deepspeed.DeepSpeedEngine`, looked up at call time."""
    return _attribute_swapped(deepspeed, "DeepSpeedEngine", engine_class)


def stage3_optimizer_class_swapped(optimizer_class: type):
    """`DeepSpeedEngine._configure_zero_optimizer` imports the Stage 3 optimizer lazily by module attribute."""
    return _attribute_swapped(_stage3_module, "DeepSpeedZeroOptimizer_Stage3", optimizer_class)


# Attributes Stage 3 sets in its constructor that the hierarchical optimizer reads (instance attributes cannot be
# checked at import: `check_stage3_instance` checks them once the optimizer exists).
_STAGE3_INSTANCE_ATTRIBUTES = [
    ("ipg_buckets", "the gradient bucket per communication dtype (reduce_scatter=false path)"),
    ("persistent_parameters", "ZeRO-3 persistent parameters, re-gathered after each step"),
    ("grad_partitions_flat_buffer", "the flat gradient partition buffer, made a view of the gradient shard"),
    ("lp_param_buffer", "the flat parameter buffer, made a view of the parameter shard"),
    ("dp_process_group", "the optimizer group of the dense parameters (fp16 overflow check)"),
    ("fp16_groups", "the trainable parameters in flat-buffer order"),
    ("fp16_partitioned_groups_flat", "the per-sub-group views of the flat parameter buffer"),
    ("reduce_scatter", "zero_optimization.reduce_scatter"),
    ("reduce_bucket_size", "zero_optimization.reduce_bucket_size (bucket of the once-per-step flows)"),
    ("gradient_accumulation_dtype", "data_types.grad_accum_dtype"),
    ("communication_data_type", "communication_data_type of the boundary exchange"),
    ("gradient_predivide_factor", "gradient averaging"),
    ("postscale_gradients", "gradient averaging"),
    ("timers", "step timers logged after the refresh"),
    ("reduce_and_partition_stream", "the side stream of the fp16 overflow check, ordered after our gradient writes"),
    ("_is_gradient_accumulation_boundary", "whether the running backward ends the accumulation window"),
    ("micro_step_id", "backwards since the last step: the first copies into the gradient partition, later ones add"),
    ("prefetch_elements", "zero_optimization.stage3_prefetch_bucket_size: whether the coordinator gathers ahead"),
    ("offload_optimizer", "zero_optimization.offload_optimizer: optimizer states on the host"),
    ("_offload_boundary_param_ids", "optimizer offload: the parameters reduced since the last step"),
    ("grad_position", "optimizer offload: where a parameter's gradient sits in its sub-group's host gradient"),
    ("fp32_partitioned_groups_flat", "optimizer offload: the host master weights, whose .grad receives gradients"),
    ("_constant_buffered_norm2", "optimizer offload: the per-parameter gradient norm"),
    ("use_muon", "optimizer offload: Muon reads the host gradients before the host step"),
    ("sequence_parallel_size", "Ulysses SP's degree: the reduce_scatter=false path divides by world / sp"),
]


def check_stage3_instance(optimizer) -> None:
    missing = [f"{name} ({purpose})" for name, purpose in _STAGE3_INSTANCE_ATTRIBUTES if not hasattr(optimizer, name)]
    if missing:
        raise DeepSpeedInternalsError("ds_asynchzp cannot use the installed DeepSpeed: Stage 3's optimizer no longer "
                                      "sets " + ", ".join(missing))


def stage3_bucket_params(optimizer, communication_data_type):
    """The parameters in Stage 3's gradient bucket of one communication dtype, in bucket order."""
    return optimizer.ipg_buckets[communication_data_type].params


def at_accumulation_boundary(optimizer) -> bool:
    """Whether the backward that is running is the last of the accumulation window (the engine sets it first)."""
    return bool(optimizer._is_gradient_accumulation_boundary)


def is_first_micro_step(optimizer) -> bool:
    """Whether the running backward is the window's first, where Stage 3's `partition_grads` copies each reduced
    gradient into its partition instead of adding to it. Its partition buffer is never zeroed: a parameter that
    gets no gradient in that backward keeps the value it had, and the window's later backwards add to it."""
    return optimizer.micro_step_id == 0


def stage3_side_stream(optimizer):
    """Stage 3's reduce-and-partition stream (None on a synchronized device): DeepSpeed runs the gradient bucket
    hooks and the fp16 overflow check's read of the gradient partitions on it."""
    return optimizer.reduce_and_partition_stream


def stage3_persistent_parameters(optimizer):
    return optimizer.persistent_parameters


def stage3_prefetches(optimizer) -> bool:
    """Whether the parameter coordinator asks for gathers ahead of their use (`stage3_prefetch_bucket_size` > 0)."""
    return optimizer.prefetch_elements > 0


def rehome_stage3_param_flats(optimizer: DeepSpeedZeroOptimizer_Stage3, sub_group_flats, whole) -> None:
    """Stage 3's per-sub-group flat parameter buffers become `sub_group_flats` (views into our shards), its whole
    flat buffer `whole` (the one own row that holds them all, or None when they live in several shards: only
    offload_states, which async_hzp refuses, reads it after construction)."""
    optimizer.lp_param_buffer = whole
    optimizer.fp16_partitioned_groups_flat.clear()
    optimizer.fp16_partitioned_groups_flat.extend(sub_group_flats)


def rehome_stage3_grad_partitions(optimizer: DeepSpeedZeroOptimizer_Stage3, partition_of_param: dict, whole) -> None:
    """Each parameter's gradient partition becomes `partition_of_param[ds_id]` (a view into our gradient shard),
    and Stage 3's flat gradient buffer `whole` (read by its fp16 overflow check)."""
    optimizer.grad_partitions_flat_buffer = whole
    by_id = getattr(optimizer, STAGE3_GRAD_PARTITION_BY_PARAM_ID)
    by_id.update(partition_of_param)


def offload_grad_norm(optimizer: DeepSpeedZeroOptimizer_Stage3, param, grad) -> None:
    """The first half of Stage 3's boundary copy: the norm of one parameter's reduced gradient partition, which
    the offload path's clipping sums (`complete_grad_norm_calculation_for_cpu_offload`)."""
    optimizer.norm_for_param_grads[optimizer.get_param_id(param)] = optimizer._constant_buffered_norm2(grad)


def offload_grad_norms(optimizer: DeepSpeedZeroOptimizer_Stage3) -> list:
    """The per-parameter gradient norms recorded this window (device tensors the step reads, then forgets)."""
    return list(optimizer.norm_for_param_grads.values())


def offload_host_grad(optimizer: DeepSpeedZeroOptimizer_Stage3, param):
    """The host optimizer's fp32 gradient elements of one parameter's partition (a view into its sub-group's)."""
    group, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
    return optimizer.fp32_partitioned_groups_flat[group].grad.narrow(0, offset, numel)


def offload_reduced_since_step(optimizer: DeepSpeedZeroOptimizer_Stage3) -> set:
    """The ids of the parameters reduced since the last step: what Stage 3's unmanaged offload boundary copies
    (its `partition_grads` records them; the hierarchical one replaces that and records them itself)."""
    return optimizer._offload_boundary_param_ids


def stage3_sub_groups(optimizer: DeepSpeedZeroOptimizer_Stage3):
    """Stage 3's trainable sub-groups (each one partition group), in the order of its flat buffers."""
    return optimizer.fp16_groups


# DeepSpeedCPUAdam's member a host step in pieces swaps (`cpu_adam_update_in_pieces`), and Stage 3's (set under offload
# only), checked where they are first used.
_CPU_ADAM_MEMBERS = ("ds_opt_adam",)
_STAGE3_OFFLOAD_MEMBERS = ("subgroup_to_device", "torch_autocast_gradscaler", "zenflow", "loss_scale", "clip_grad",
                           "fp32_partitioned_groups_flat")


def host_step_in_pieces_refusal(optimizer: DeepSpeedZeroOptimizer_Stage3, sub_group_id: int) -> str | None:
    """Why Stage 3's host step of a sub-group cannot be taken piece by piece (`cpu_adam_update_in_pieces`); None when
    it can: DeepSpeedCPUAdam on the host, none of the paths that wrap or replace its step."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    host = optimizer.optimizer
    if type(host) is not DeepSpeedCPUAdam:
        return f"the host optimizer is {type(host).__name__}, not DeepSpeedCPUAdam"
    missing = ([f"DeepSpeedCPUAdam.{m}" for m in _CPU_ADAM_MEMBERS if not hasattr(host, m)]
               + [f"DeepSpeedZeroOptimizer_Stage3.{m}" for m in _STAGE3_OFFLOAD_MEMBERS if not hasattr(optimizer, m)])
    if missing:
        raise DeepSpeedInternalsError("ds_asynchzp cannot use the installed DeepSpeed: " + ", ".join(missing)
                                      + " no longer set (the host step in pieces, async_hzp.offload_pipeline)")
    if optimizer.subgroup_to_device[sub_group_id] != "cpu":
        return "offload_optimizer.ratio keeps this sub-group's step on the device"
    if optimizer.torch_autocast_gradscaler or optimizer.zenflow:
        return "torch autocast's grad scaler or ZenFlow wraps the host step"
    return None


@contextlib.contextmanager
def cpu_adam_update_in_pieces(optimizer: DeepSpeedZeroOptimizer_Stage3, run_pieces: Callable) -> Iterator[None]:
    """Inside, Stage 3's host step of a sub-group runs as it is (`_optimizer_step` -> DeepSpeedCPUAdam.step: its
    state, step count, torch's step hooks), except that DeepSpeedCPUAdam's one call of its C++ update goes to
    `run_pieces(update)`, where `update(lo, hi)` runs that call on elements [lo, hi) of the sub-group. No call (a
    sub-group without gradient, which stock skips) leaves `run_pieces` uncalled.

    Every call passes the step's number: the C++ optimizer advances its bias corrections on the first and keeps
    them for the others (cpu_adam.h `IncrementStep`). An element stays on the path (vector body or scalar tail)
    the whole call gives it when every piece but the last starts and ends at a multiple of the vector width from
    the sub-group's start."""
    host = optimizer.optimizer
    op = host.ds_opt_adam

    class PiecewiseOp:
        def __getattr__(self, name):
            return getattr(op, name)

        @staticmethod
        def adam_update(*args):
            head, tensors = args[:-4], args[-4:]   # ..., params, grads, exp_avg, exp_avg_sq
            run_pieces(lambda lo, hi: op.adam_update(*head, *(t[lo:hi] for t in tensors)))

    host.ds_opt_adam = PiecewiseOp()
    try:
        yield
    finally:
        host.ds_opt_adam = op


def uses_muon(optimizer: DeepSpeedZeroOptimizer_Stage3) -> bool:
    """Whether Stage 3 orthogonalises gradients with Muon before its step (it reads the host gradients first)."""
    return bool(optimizer.use_muon)


def offload_master(optimizer: DeepSpeedZeroOptimizer_Stage3, sub_group_id: int):
    """A sub-group's fp32 master weights on the host (their `.grad`: the host gradients)."""
    return optimizer.fp32_partitioned_groups_flat[sub_group_id]


def stage3_unflatten_sub_group(optimizer: DeepSpeedZeroOptimizer_Stage3, sub_group_id: int) -> None:
    """The end of Stage 3's `_reassign_or_swap_out_partitioned_parameters` after its copy: each parameter's
    partition points at its piece of the sub-group's flat buffer."""
    optimizer._unflatten_partitioned_parameters(sub_group_id)


# ------------------------------------------------------------------------------------------ parameter state
def is_parameter_only_engine(engine) -> bool:
    """An engine built without an optimizer: DeepSpeed's ZeRO-3 then sets `engine.optimizer` to its parameter
    coordinator (`DeepSpeedZeRoOffload`), which gathers and partitions but never steps."""
    optimizer = getattr(engine, "optimizer", None)
    return optimizer is None or isinstance(optimizer, DeepSpeedZeRoOffload)


def is_zero_param(param) -> bool:
    return hasattr(param, "ds_id") and hasattr(param, "ds_tensor")


def mark_inflight(params) -> None:
    for param in params:
        if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            raise RuntimeError(f"parameter {param.ds_id} is {param.ds_status}, expected NOT_AVAILABLE before a gather")
        param.ds_status = ZeroParamStatus.INFLIGHT


def mark_available(param, full_data) -> None:
    param.data = full_data
    param.ds_status = ZeroParamStatus.AVAILABLE


def is_available(param) -> bool:
    return param.ds_status == ZeroParamStatus.AVAILABLE


def partition_group_of(param):
    return param.ds_process_group


def repartition(params, group) -> None:
    """Re-partition ZeRO-3 parameters over `group` (a collective over each parameter's current group).

    `zero.Init` partitions over the whole data-parallel world; with optimizer shards over a smaller group
    the partitions must follow. Each parameter is gathered once with DeepSpeed's own blocking gather, then cut
    again by DeepSpeed's own partitioner, which reads the group from the parameter.
    """
    for param in sorted(params, key=lambda p: p.ds_id):
        if param.ds_process_group is group:
            continue
        param.all_gather()
        param.ds_process_group = group
        param.ds_zero_partition_rank = ds_comm.get_rank(group=group)
        param.ds_zero_partition_world_size = ds_comm.get_world_size(group=group)
        param.ds_tensor = None
        param.partition()


_ORIGINALS_ATTR = "_hzp_deepspeed_closures"


def install_param_hooks(param, all_gather_coalesced: Callable, after_update: Callable,
                        after_release: Callable) -> None:
    """Route the coordinator's gathers (`param.all_gather_coalesced`) to ours; call `after_update(param,
    full_data)` when a caller re-partitions a modified parameter (`GatheredParameters(modifier_rank=...)` passes
    has_been_updated=True), and `after_release(param)` after every re-partition (the coordinator releasing a
    gathered parameter). `restore_param_hooks` undoes it."""
    if not hasattr(param, _ORIGINALS_ATTR):
        setattr(param, _ORIGINALS_ATTR, (param.all_gather_coalesced, param.partition))
    _, original_partition = getattr(param, _ORIGINALS_ATTR)

    def partition(param_list=None, hierarchy=0, has_been_updated=False, free_data=True):
        params = param_list or [param]
        if has_been_updated:
            for p in params:
                after_update(p, p.data)
        result = original_partition(param_list=param_list, hierarchy=hierarchy, has_been_updated=has_been_updated,
                                    free_data=free_data)
        for p in params:
            after_release(p)
        return result

    param.all_gather_coalesced = all_gather_coalesced
    param.partition = partition


def restore_param_hooks(param) -> None:
    originals = getattr(param, _ORIGINALS_ATTR, None)
    if originals is not None:
        param.all_gather_coalesced, param.partition = originals
        delattr(param, _ORIGINALS_ATTR)


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
        "grad_primary": [t for t in [optimizer.grad_partitions_flat_buffer] if t is not None],
    }


# ------------------------------------------------------------------------------------------------- comm
def backend_name(group) -> str:
    """The backend of a process group ("gloo", "nccl", ...)."""
    import torch.distributed

    return str(torch.distributed.get_backend(group))


def default_group_timeout_s() -> float | None:
    """The timeout of the default process group (what `deepspeed.init_distributed` or
    `torch.distributed.init_process_group` was given), read from torch's private backend options; None when no group
    exists or torch no longer keeps it there."""
    import torch
    from deepspeed.accelerator import get_accelerator

    if not torch.distributed.is_initialized():
        return None
    try:
        group = torch.distributed.distributed_c10d._get_default_group()
        device = torch.device(get_accelerator().device_name())
        return float(group._get_backend(device).options._timeout.total_seconds())
    except (AttributeError, RuntimeError, ValueError):
        return None


def comm_backend():
    """The object whose methods every `deepspeed.comm` collective ends in (`deepspeed.comm.comm.cdb`)."""
    module = importlib.import_module("deepspeed.comm.comm")
    return module.cdb


__all__ = [
    "DeepSpeedEngine", "DeepSpeedZeroOptimizer_Stage3", "ZeroParamStatus", "SUPPORTED_DEEPSPEED_VERSION",
    "DeepSpeedInternalsError", "engine_class_swapped", "stage3_optimizer_class_swapped",
    "check_stage3_instance", "stage3_bucket_params", "stage3_persistent_parameters",
    "rehome_stage3_param_flats", "rehome_stage3_grad_partitions", "stage3_sub_groups",
    "is_zero_param", "mark_inflight", "mark_available", "is_available", "partition_group_of", "repartition",
    "install_param_hooks", "restore_param_hooks", "stage3_model_state_tensors", "backend_name", "comm_backend",
    "ds_comm",
]


# ------------------------------------------------------------------------------------------------ checkpoints
def engine_zero_param_shapes(engine) -> list:
    """What DeepSpeed writes as a checkpoint's `param_shapes` (and checks a load against): per optimizer sub-group,
    parameter name -> full shape, in the order of the flat fp32 groups (`DeepSpeedEngine._get_zero_param_shapes`)."""
    method = getattr(engine, "_get_zero_param_shapes", None)
    if method is None:
        raise DeepSpeedInternalsError("ds_asynchzp cannot use the installed DeepSpeed: DeepSpeedEngine."
                                      "_get_zero_param_shapes is gone (parameter order of checkpoints)")
    return method()


__all__ += ["engine_zero_param_shapes"]


# --------------------------------------------------------------------------------------- AutoEP's experts
# AutoEP (`expert_parallel`) marks each routed-expert parameter with a placement family and the name of its
# expert-parallel group; the engine resolves every parameter's ZeRO-3 partition group from them before the
# optimizer exists (DeepSpeedEngine._resolve_zero3_param_placement): the expert-data-parallel group for experts,
# the data-parallel group for everything else.
AUTOEP_EXPERT_FAMILY = "autoep_expert"
REPLICATED_FAMILY = "replicated"


def placement_family(param) -> str:
    return getattr(param, "ds_zero_placement_family", REPLICATED_FAMILY)


def expert_group_name(param):
    return getattr(param, "ds_zero_partition_group_name", getattr(param, "group_name", None))


def resolved_partition_group(param):
    """The group DeepSpeed partitions `param` over: resolved by the engine, or fixed at zero.Init conversion."""
    group = getattr(param, "ds_zero_partition_process_group", None)
    return group if group is not None else getattr(param, "ds_process_group", None)


def expert_data_parallel_group(name: str):
    from deepspeed.utils import groups
    return groups._get_expert_data_parallel_group(name)


def autoep_groups() -> tuple:
    """(expert-parallel groups, expert-data-parallel groups) this rank belongs to, as tuples of global ranks
    (empty without AutoEP): the token all-to-all runs on the former, experts are partitioned over the latter."""
    from deepspeed.utils import groups
    expert = [tuple(group_ranks(g)) for g in groups._get_expert_parallel_group_dict().values()]
    data = [tuple(group_ranks(g)) for g in groups._get_expert_data_parallel_group_dict().values()]
    return expert, data


def group_ranks(group) -> list:
    """Global ranks of a process group, in group-rank order (None: the world)."""
    size = ds_comm.get_world_size(group=group)
    if group is None:
        return list(range(size))
    return [ds_comm.get_global_rank(group, r) for r in range(size)]


def _check_autoep_internals() -> None:
    from deepspeed.utils import groups
    missing = [name for name in ("_get_expert_data_parallel_group", "_get_expert_parallel_group",
                                 "_get_expert_parallel_group_dict", "_get_expert_data_parallel_group_dict")
               if not hasattr(groups, name)]
    if not hasattr(DeepSpeedEngine, "_resolve_zero3_param_placement"):
        missing.append("DeepSpeedEngine._resolve_zero3_param_placement")
    if missing:
        raise DeepSpeedInternalsError("ds_asynchzp cannot use the installed DeepSpeed: AutoEP's " + ", ".join(missing)
                                      + " moved (expert parameter placement)")


_check_autoep_internals()


# ------------------------------------------------------------------------------- stock ZeRO++ on CPU ranks
# Stock qwZ (zero.Init's CUDAQuantizer) and qgZ (coalesced_collectives.all_to_all_quant_reduce) load DeepSpeed's
# quantizer with `deepspeed.ops.op_builder.QuantizerBuilder().load()` when they first run, looking the builder up
# as a module attribute, and cache the loaded module (`CUDAQuantizer.quantizer_cuda_module`,
# `coalesced_collectives.quantizer_module`). On the CPU accelerator the builder is a NotImplementedBuilder whose
# load() raises. ds_asynchzp.ops.zeropp is a CPU module with the CUDA module's functions.
def _zeropp_quantizer_seams():
    """(deepspeed.ops.op_builder, NotImplementedBuilder, [(owner, cache attribute)]), or DeepSpeedInternalsError
    naming what moved."""
    problems = []
    try:
        from deepspeed.ops import op_builder
        from deepspeed.ops.op_builder.cpu import NotImplementedBuilder
        from deepspeed.runtime.comm import coalesced_collectives
        from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer
    except ImportError as error:
        raise DeepSpeedInternalsError(f"ds_asynchzp cannot use the installed DeepSpeed: {error} (stock ZeRO++'s "
                                      "quantizer seams)") from error
    if not hasattr(op_builder, "QuantizerBuilder"):
        problems.append("deepspeed.ops.op_builder.QuantizerBuilder is gone (the builder stock ZeRO++ loads)")
    if getattr(coalesced_collectives, "op_builder", None) is not op_builder:
        problems.append("deepspeed.runtime.comm.coalesced_collectives no longer reaches QuantizerBuilder through "
                        "deepspeed.ops.op_builder (qgZ's quantizer)")
    caches = [(CUDAQuantizer, "quantizer_cuda_module"), (coalesced_collectives, "quantizer_module")]
    problems += [f"{getattr(owner, '__qualname__', owner.__name__)}.{name} is gone (the loaded quantizer's cache)"
                 for owner, name in caches if not hasattr(owner, name)]
    if problems:
        raise DeepSpeedInternalsError("ds_asynchzp cannot use the installed DeepSpeed:\n  - " + "\n  - ".join(problems))
    return op_builder, NotImplementedBuilder, caches


_zeropp_quantizer_seams()


class CPUZeroppQuantizerBuilder:
    """Stands in for DeepSpeed's QuantizerBuilder where DeepSpeed has none: `load()` is ds_asynchzp.ops.zeropp."""

    NAME = "ds_asynchzp_cpu_zeropp_quantizer"

    def __init__(self, *args, **kwargs):
        pass

    def is_compatible(self, verbose=False) -> bool:
        return True

    def absolute_name(self) -> str:
        return "ds_asynchzp.ops.zeropp"

    def load(self, verbose=True):
        from ..ops import zeropp

        return zeropp


def install_cpu_zeropp_quantizer() -> bool:
    """Let unchanged stock ZeRO++ (hpZ, qwZ, qgZ) run on CPU ranks; returns whether the CPU quantizer is in place.

    Only where DeepSpeed's own quantizer is missing (its CPU accelerator answers QuantizerBuilder with a
    NotImplementedBuilder): rebinds `deepspeed.ops.op_builder.QuantizerBuilder` to `CPUZeroppQuantizerBuilder`
    and seeds the two empty caches of the loaded module with `ds_asynchzp.ops.zeropp`. Elsewhere (a CUDA
    accelerator's own builder) it changes nothing and returns False. Idempotent; each rank calls it after
    `import deepspeed`, before `deepspeed.initialize`."""
    op_builder, not_implemented, caches = _zeropp_quantizer_seams()
    current = op_builder.QuantizerBuilder
    if current is not CPUZeroppQuantizerBuilder:
        if not (isinstance(current, type) and issubclass(current, not_implemented)):
            return False
        op_builder.QuantizerBuilder = CPUZeroppQuantizerBuilder
    module = CPUZeroppQuantizerBuilder().load()
    for owner, name in caches:
        if getattr(owner, name) is None:
            setattr(owner, name, module)
    return True


__all__ += ["CPUZeroppQuantizerBuilder", "install_cpu_zeropp_quantizer"]


@contextlib.contextmanager
def hpz_groups_while_built(size: int) -> Iterator[None]:
    """ZeRO++'s hierarchical-partition groups of `size` ranks, for the engines built inside the context only.

    DeepSpeed 0.19.8 builds a parameter-only engine (no optimizer) with hpZ by calling `_set_zero_group_parallelism`,
    a method only Stage 3's optimizer has (engine.py, the `DummyOptim` branch of `_configure_zero_optimizer`), and
    skips that call when the groups exist: they are made here first (collective over the world). DeepSpeed keeps
    them in a module global that every later ZeRO-3 engine reads at construction, and would then give hpZ to
    engines whose config does not ask for it; each parameter keeps its group, so the global is put back after."""
    previous = _ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP
    _ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    _ds_groups._create_zero_param_parallel_group(size)
    try:
        yield
    finally:
        _ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = previous


def hierarchical_copy_refusal(params: list, offload_device: str | None) -> str | None:
    """Why parameters that zero.Init partitioned when the model was built cannot be given hpZ's copy
    (`give_hierarchical_copies`) as they are (None: they can). `offload_device` is the engine's
    ``offload_param.device`` ("cpu", "nvme" or None), where the conversion puts their partitions again."""
    world = ds_comm.get_world_size()
    if not all(hasattr(p, "ds_id") and ds_comm.get_world_size(group=p.ds_process_group) == world for p in params):
        return ("deepspeed.zero.Init partitioned them over a group other than the world, or only some of them, "
                "when the model was built; DeepSpeed keeps that partitioning")
    if offload_device == "nvme" or any(getattr(p, "nvme_swapper", None) is not None for p in params):
        return "their partitions are swapped to NVMe (offload_param), which keeps stock's partitioning"
    from deepspeed.accelerator import get_accelerator

    where = "cpu" if offload_device == "cpu" else get_accelerator().device_name()   # "cpu" on CPU ranks
    moved = sorted({p.ds_tensor.device.type for p in params if p.ds_tensor is not None} - {where})
    if moved:
        return (f"zero.Init put their partitions on {', '.join(moved)} and the engine's offload_param puts them on "
                f"{where}; converting them would move them, so they keep stock's partitioning")
    return None


def give_hierarchical_copies(params: list, ds_config: dict) -> None:
    """Give parameters that zero.Init partitioned over the world hpZ's copy partitioned inside the node, as stock
    gives the parameters of a model built without zero.Init under ``zero_hpz_partition_size`` (call inside
    `hpz_groups_while_built`).

    A converted parameter's gather and partition closures belong to the zero.Init context that built it, which
    holds the hpZ group, and other models built in that context share it; so each parameter is converted again by
    a zero.Init of its own (never entered: it only converts): gathered once over the world through its old
    closures, converted, and partitioned, which writes both the primary partition (over the world, as before) and
    the copy over the node's group from the full values. The engine's module fetches read the copy inside the node
    (a direct ``param.all_gather()``, `GatheredParameters`, still reads the partitions over the world); the values
    are the gathered ones, bit for bit. What the first conversion decided stays: which parameters persist, and the
    zero.Init class state a conversion writes (the persistence budget, whether ``Module.apply`` is patched)."""
    kept = (_ZeroInit.num_persisted_parameters, _ZeroInit.num_persisted_elements, _ZeroInit.override_module_apply)
    converter = _ZeroInit(config_dict_or_path=ds_config,
                          zero_param_parallel_group=_ds_groups._get_zero_param_intra_parallel_group())
    try:
        for param in params:
            persist = param.ds_persist
            param.all_gather()
            converter._convert_to_deepspeed_param(param)
            param.ds_persist = persist
            param.partition()
    finally:
        _ZeroInit.num_persisted_parameters, _ZeroInit.num_persisted_elements, _ZeroInit.override_module_apply = kept
