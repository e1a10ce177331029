"""DeepSpeed's private names that stock ZeRO++ reaches: its quantizer's seams (so unchanged stock qwZ and qgZ run
on CPU ranks), hpZ's groups and the hierarchical copies of zero.Init-built models without an optimizer. Part of
`deepspeed_internals`, the one place private DeepSpeed names are touched; the seams are checked at import."""

from __future__ import annotations

import contextlib
from typing import Iterator

import deepspeed.comm as ds_comm
from deepspeed.runtime.zero.partition_parameters import Init as _ZeroInit
from deepspeed.utils import groups as _ds_groups

from ...errors import DeepSpeedInternalsError


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
        from ...ops import zeropp

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


__all__ = [
    "CPUZeroppQuantizerBuilder", "install_cpu_zeropp_quantizer", "hpz_groups_while_built",
    "hierarchical_copy_refusal", "give_hierarchical_copies",
]
