"""`initialize` (the drop-in for `deepspeed.initialize`) and `register` (routes plain `deepspeed.initialize` here)."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import warnings

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule

from ..formulas.sizing import padded_num_params
from ..config import ResolvedLayout, load_ds_config, resolve_layout, section_from_ds_config
from ..errors import AsyncHZPConfigError, AsyncHZPNotActiveError
from ..config_compat import reference_copy_refusal
from ..platform.deepspeed_internals import (default_group_timeout_s, ds_comm, engine_class_swapped,
                                           give_hierarchical_copies, hierarchical_copy_refusal,
                                           hpz_groups_while_built, is_zero_param)
from . import observers
from .engine import engine_class_for
from .optimizer import HierarchicalZeroOptimizer
from .sequence_parallel import refuse_device_mesh, sequence_parallel_size

_ORIGINAL_INITIALIZE = deepspeed.initialize
_INITIALIZE_SIGNATURE = inspect.signature(_ORIGINAL_INITIALIZE)


def _ds_config_of(arguments: dict):
    config = arguments.get("config") or arguments.get("config_params")
    if config is None and arguments.get("args") is not None:
        config = getattr(arguments["args"], "deepspeed_config", None)
    return config


def _world_size() -> int:
    if ds_comm.is_initialized():
        return ds_comm.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _model_numel(model) -> list:
    # Parameters built under deepspeed.zero.Init are already partitioned: their full size is ds_numel.
    return [getattr(p, "ds_numel", p.numel()) for p in model.parameters()]


def resolve_for_initialize(*args, **kwargs) -> ResolvedLayout | None:
    """Validate the ds_config of an `initialize` call; None when AsyncHZP is not requested.

    Runs before DeepSpeed starts any process group, so a bad config fails on every rank the same way.
    """
    arguments = _INITIALIZE_SIGNATURE.bind(*args, **kwargs).arguments
    config = _ds_config_of(arguments)
    if config is None or section_from_ds_config(config) is None:
        return None
    # Ulysses SP (ALST's mpu) is accepted, any other mpu and DeepSpeed's device-mesh SP are refused by name.
    refuse_device_mesh(load_ds_config(config), arguments.get("mesh_param"))
    sp = sequence_parallel_size(arguments.get("mpu"), _world_size())
    model = arguments.get("model")
    if isinstance(model, PipelineModule):
        raise AsyncHZPConfigError("model", "is a deepspeed.pipe.PipelineModule; pipeline parallelism is not supported "
                                  "with async_hzp.", "remove the async_hzp section, or train a non-pipeline module.")
    world = _world_size()
    # The ranks per node: the config's node_size, else the launcher's environment, read (and, where its two
    # variables disagree, settled) by resolve_layout.
    layout = resolve_layout(config, world, None,
                            has_client_optimizer=arguments.get("optimizer") is not None,
                            num_parameters=padded_num_params(_model_numel(model), world) if model is not None else None,
                            sequence_parallel_size=sp,
                            process_group_timeout_s=default_group_timeout_s())
    if layout is not None:
        _warn_if_auto_differs(layout)
    return layout


# (d_p, chosen by "auto") of the first trained engine (key True) and of the first engine without an optimizer
# (False) this process built.
_FIRST_D_P: dict = {}
_SAID = set()


def _warn_if_auto_differs(layout: ResolvedLayout) -> None:
    """A reference model's engine resolves "auto" from its own ds_config, which TRL copies without the optimizer
    and its offload: it can choose another d_p than the trained engine, whose memory "auto" counted for it. Said
    once, where either engine's sizes came from "auto"."""
    _FIRST_D_P.setdefault(layout.has_optimizer, (layout.sizes.param_shard_size, layout.auto_reason is not None))
    if len(_FIRST_D_P) < 2 or "auto differs" in _SAID:
        return
    (trained, trained_auto), (reference, reference_auto) = _FIRST_D_P[True], _FIRST_D_P[False]
    if trained != reference and (trained_auto or reference_auto):
        _SAID.add("auto differs")
        warnings.warn(f'"auto" chose d_p={trained} for the trained model and d_p={reference} for a model without an '
                      "optimizer (its ds_config differs: TRL drops the optimizer and its offload), so the memory "
                      "async_hzp.reference_models counted is not what the reference model holds; set "
                      "async_hzp.param_shard_size to an integer for both", RuntimeWarning, stacklevel=3)


def _initialize_without_optimizer(layout: ResolvedLayout, arguments: dict):
    """An engine without an optimizer (TRL's reference models, distillation teachers, evaluation): DeepSpeed builds
    its parameter-only ZeRO-3 engine, which has no gradients or optimizer states for AsyncHZP to place. Its
    parameters get AsyncHZP's parameter placement, sharded over d_p inside the node, through ZeRO++'s hierarchical
    partition (hpZ): stock code that keeps, after a parameter's first gather, a copy partitioned over d_p, from
    which every later gather reads inside the node (a frozen model's copy never goes stale). Forward values are
    stock ZeRO-3's exactly: a gather only copies.

    A model that zero.Init partitioned over the world when it was built (``from_pretrained`` under ZeRO-3: TRL's
    reference models) gets the same copy before the engine is built (`give_hierarchical_copies`): each parameter is
    gathered once over the world and partitioned again, keeping its partition over the world and adding the copy
    over d_p, so no forward's module fetches cross nodes. Memory per rank b·Ψ(1/N + 1/d_p), as hpZ's: a partition
    over d_p alone would need a gather path of the package's own for these engines, where hpZ's is stock's code and
    gives stock's forwards. Where hpZ cannot apply, or would not give stock's forwards bit for bit (AutoEP, sequence
    parallelism, ZeRO++'s quantized weights, all-reduce fetches; for a model zero.Init built: partitioned over
    another group or only in part, partitions on NVMe or where the engine's offload_param would move them), the
    engine is stock's, and the log line says why."""
    config = copy.deepcopy(load_ds_config(_ds_config_of(arguments)))
    model = arguments.get("model")
    why_stock = None
    if not 1 < layout.sizes.param_shard_size < layout.sizes.world_size:
        why_stock = "d_p is 1 or the world, so there is no partition inside the node to add"
    else:
        why_stock = reference_copy_refusal(config, layout.sequence_parallel_size)
    zero = config.get("zero_optimization") or {}
    params = list(model.parameters()) if model is not None else []
    built_partitioned = any(is_zero_param(p) for p in params)
    if why_stock is None and built_partitioned:
        why_stock = hierarchical_copy_refusal(params, (zero.get("offload_param") or {}).get("device"))
    hierarchical = why_stock is None
    d_p = layout.sizes.param_shard_size
    placement = (f"parameters sharded over d_p={d_p} inside the node (ZeRO++'s hierarchical partition, "
                 "zero_hpz_partition_size): " + (
                     "zero.Init had partitioned them over the world when the model was built, so each was "
                     "gathered once now and given its copy over d_p; no forward's module fetches cross nodes"
                     if built_partitioned else
                     "after its first gather a parameter is gathered inside the node")
                 if hierarchical else f"parameters partitioned over the world, as stock: {why_stock}")
    if hierarchical:
        config.setdefault("zero_optimization", {})["zero_hpz_partition_size"] = layout.sizes.param_shard_size
        if not ds_comm.is_initialized():   # as deepspeed.initialize would, first
            deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                       distributed_port=arguments.get("distributed_port", 29500),
                                       dist_init_required=arguments.get("dist_init_required"))
    for key in ("config", "config_params"):
        arguments.pop(key, None)
    if getattr(arguments.get("args"), "deepspeed_config", None) is not None:
        arguments["args"] = copy.copy(arguments["args"])
        arguments["args"].deepspeed_config = None
    if layout.auto_reason is not None and not layout.reference_models:
        placement += ('; "auto" chose the sizes without this engine\'s memory and forwards: set '
                      "async_hzp.reference_models to the number of models built without an optimizer")
    if layout.log_layout and _rank() == 0:
        print(f"[ds_asynchzp] {layout.describe()}; {placement}", flush=True)
    with hpz_groups_while_built(d_p) if hierarchical else contextlib.nullcontext():
        if hierarchical and built_partitioned:
            give_hierarchical_copies(params, config)
        return _ORIGINAL_INITIALIZE(**arguments, config=config)


def _rank() -> int:
    return ds_comm.get_rank() if ds_comm.is_initialized() else int(os.environ.get("RANK", "0"))


@functools.wraps(_ORIGINAL_INITIALIZE)
def initialize(*args, **kwargs):
    """`deepspeed.initialize` that honours the ``"async_hzp"`` section (stock ZeRO-3 without it)."""
    config = _ds_config_of(_INITIALIZE_SIGNATURE.bind(*args, **kwargs).arguments)
    config = load_ds_config(config) if config is not None else {}
    # Tools (asynchzp-ab's recorder) see every engine, stock ones too (`observers`).
    observers.before_engine(config)
    result = _initialize(*args, **kwargs)
    observers.after_engine(result[0], config)
    return result


def _initialize(*args, **kwargs):
    layout = resolve_for_initialize(*args, **kwargs)
    if layout is None:
        return _ORIGINAL_INITIALIZE(*args, **kwargs)
    if not layout.has_optimizer:
        return _initialize_without_optimizer(layout, dict(_INITIALIZE_SIGNATURE.bind(*args, **kwargs).arguments))
    with engine_class_swapped(engine_class_for(layout)):
        result = _ORIGINAL_INITIALIZE(*args, **kwargs)
    engine = result[0]
    if not isinstance(getattr(engine, "optimizer", None), HierarchicalZeroOptimizer):
        raise AsyncHZPNotActiveError(
            f"async_hzp is enabled but the engine is {type(engine).__name__} with optimizer "
            f"{type(getattr(engine, 'optimizer', None)).__name__}; pipeline and hybrid engines are not supported")
    return result


def register() -> None:
    """Route plain `deepspeed.initialize` through `ds_asynchzp.initialize` (idempotent).

    Frameworks such as HF Trainer and Accelerate call `deepspeed.initialize` themselves; after this, their
    ds_config's ``"async_hzp"`` section takes effect. Code that did `from deepspeed import initialize`
    before `register()` keeps the original function.
    """
    deepspeed.initialize = initialize


def unregister() -> None:
    deepspeed.initialize = _ORIGINAL_INITIALIZE


def is_registered() -> bool:
    return deepspeed.initialize is initialize


__all__ = ["initialize", "register", "unregister", "is_registered", "resolve_for_initialize"]
