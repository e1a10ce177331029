"""Every private DeepSpeed name this package relies on, in one place.

DeepSpeed's ZeRO-3 internals move between releases (MiCS rotted exactly this way), so the package pins one
release and checks, at import, that each private symbol it touches is still where it expects it. A failed
check names what moved instead of failing later in the middle of a training step.

Nothing outside this package (this module, `offload.py` for the optimizer-offload path and `zeropp.py` for stock
ZeRO++'s seams) may reach into a private DeepSpeed attribute; the rest of the package goes through the small
helpers here, all importable from this module.
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

SUPPORTED_DEEPSPEED_VERSION = "0.19.8"

from ...errors import DeepSpeedInternalsError

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


def stage3_sub_groups(optimizer: DeepSpeedZeroOptimizer_Stage3):
    """Stage 3's trainable sub-groups (each one partition group), in the order of its flat buffers."""
    return optimizer.fp16_groups


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


# The offload path's and stock ZeRO++'s private names, in modules of their own (each checks what it can at import).
from .offload import (  # noqa: E402
    offload_grad_norm,
    offload_grad_norms,
    offload_host_grad,
    offload_reduced_since_step,
    host_step_in_pieces_refusal,
    cpu_adam_update_in_pieces,
    uses_muon,
    offload_master,
    stage3_unflatten_sub_group,
)
from .zeropp import (  # noqa: E402
    CPUZeroppQuantizerBuilder,
    install_cpu_zeropp_quantizer,
    hpz_groups_while_built,
    hierarchical_copy_refusal,
    give_hierarchical_copies,
)

__all__ += [
    "offload_grad_norm", "offload_grad_norms", "offload_host_grad", "offload_reduced_since_step",
    "host_step_in_pieces_refusal", "cpu_adam_update_in_pieces", "uses_muon", "offload_master",
    "stage3_unflatten_sub_group", "CPUZeroppQuantizerBuilder", "install_cpu_zeropp_quantizer",
    "hpz_groups_while_built", "hierarchical_copy_refusal", "give_hierarchical_copies",
]
