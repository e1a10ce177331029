"""The ``async_hzp`` section of a DeepSpeed ds_config, and its validation.

AsyncHZP is enabled by a top-level ``"async_hzp"`` section next to the usual
DeepSpeed keys; an empty object enables it with defaults::

    {
      "train_micro_batch_size_per_gpu": 4,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
      "bf16": {"enabled": true},
      "zero_optimization": {"stage": 3},
      "async_hzp": {
        "node_size": 8,
        "param_shard_size": 8,
        "grad_shard_size": 8,
        "optimizer_shard_size": null,
        "memory_budget_gb": null,
        "log_layout": true
      }
    }

Sizes (``d_p`` params, ``d_g`` grads, ``d_o`` optimizer states) must satisfy
``d_p | d_g | d_o | world``; parameters stay inside a node (``d_p`` divides
``node_size``); gradients may span nodes only in whole nodes. ``"auto"`` picks
``d_p = d_g`` from the analytic memory model in :mod:`ds_asynchzp.sizing`.

:func:`resolve_layout` checks all of this, plus the ZeRO settings AsyncHZP
relies on, from the config alone: it runs before any process group exists and
never calls a collective, so a bad config fails fast and identically on every
rank. Each :class:`AsyncHZPConfigError` names the offending JSON key and the fix.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import sizing


SECTION = "async_hzp"
_PositiveInt = Annotated[int, Field(ge=1)]
_ShardSize = Optional[Union[_PositiveInt, Literal["auto"]]]


@dataclass(frozen=True)
class ConfigIssue:
    """One problem: the JSON path of the key, what is wrong, and how to fix it."""

    key: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}: {self.problem} Fix: {self.fix}"


class AsyncHZPConfigError(ValueError):
    """Invalid ds_config for AsyncHZP; the message names every offending key and its fix.

    Build with ``AsyncHZPConfigError(key, problem, fix)`` or with a list of
    :class:`ConfigIssue` so that independent problems are reported together.
    """

    def __init__(self, key_or_issues: str | list[ConfigIssue], problem: str = "", fix: str = ""):
        if isinstance(key_or_issues, str):
            issues = [ConfigIssue(key_or_issues, problem, fix)]
        else:
            issues = list(key_or_issues)
        self.issues: tuple[ConfigIssue, ...] = tuple(issues)
        if len(issues) == 1:
            message = str(issues[0])
        else:
            lines = "\n".join(f"  - {issue}" for issue in issues)
            message = f"ds_config is not valid for async_hzp ({len(issues)} problems):\n{lines}"
        super().__init__(message)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(issue.key for issue in self.issues)


class AsyncHZPConfig(BaseModel):
    """The "async_hzp" section of a DeepSpeed ds_config: hierarchical ZeRO placement."""

    # strict: "4" or true must not silently become a shard size of 4 or 1.
    model_config = ConfigDict(extra="forbid", strict=True, title="DeepSpeed ds_config: async_hzp section")

    enabled: bool = Field(True, description="Turn AsyncHZP on. The section being present enables it unless this is false.")
    node_size: Optional[_PositiveInt] = Field(
        None,
        description="Data-parallel ranks per node. Default: the launcher's local world size "
        "(environment LOCAL_WORLD_SIZE, else LOCAL_SIZE).",
    )
    param_shard_size: _ShardSize = Field(
        None,
        description='Ranks sharing one working shard of the parameters (d_p); must divide node_size. '
        '"auto" picks the smallest size whose model states fit memory_budget_gb. Default: node_size.',
    )
    grad_shard_size: _ShardSize = Field(
        None,
        description="Ranks sharing one gradient-accumulation shard (d_g): a multiple of param_shard_size "
        'that divides node_size, or a multiple of node_size spanning nodes. "auto" is chosen together '
        "with param_shard_size. Default: param_shard_size.",
    )
    optimizer_shard_size: _ShardSize = Field(
        None,
        description="Ranks over which fp32 master weights and optimizer states are sharded (d_o). Only the "
        'data-parallel world size is supported in this release. Default and "auto": the world size.',
    )
    memory_budget_gb: Optional[float] = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description='Per-rank budget in GiB for model states, used by "auto". Default: 50% of the '
        "accelerator memory, or of this rank's share of host memory when training on CPU.",
    )
    log_layout: bool = Field(True, description="Rank 0 logs the resolved layout at startup.")


# Per field: what a valid value looks like and how to fix a bad one.
_SHARD_RULE = ('a positive integer, "auto" or null', "use an integer >= 1, \"auto\", or remove the key for the default.")
_FIELD_RULES = {
    "enabled": ("true or false", "use a JSON boolean (true/false), not a string or number."),
    "node_size": ("a positive integer or null", "set it to the number of data-parallel ranks per node, or remove it."),
    "param_shard_size": _SHARD_RULE,
    "grad_shard_size": _SHARD_RULE,
    "optimizer_shard_size": _SHARD_RULE,
    "memory_budget_gb": ("a positive finite number or null", "set the per-rank GiB budget, e.g. 40, or remove it."),
    "log_layout": ("true or false", "use a JSON boolean (true/false)."),
}


def _issues_from_validation(err: ValidationError) -> list[ConfigIssue]:
    first_error_per_field: dict[str, dict[str, Any]] = {}
    for e in err.errors():
        first_error_per_field.setdefault(str(e["loc"][0]) if e["loc"] else "", e)
    fields = list(AsyncHZPConfig.model_fields)
    issues = []
    for field, e in first_error_per_field.items():
        key = f"{SECTION}.{field}"
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(field, fields, n=1)
            hint = f"did you mean {SECTION}.{close[0]}? " if close else ""
            issues.append(ConfigIssue(key, "is not a known key.", f"{hint}Remove or rename it; valid keys: {', '.join(fields)}."))
        else:
            expected, fix = _FIELD_RULES.get(field, ("valid", "see config_schema/async_hzp.schema.json."))
            issues.append(ConfigIssue(key, f"must be {expected}, got {e['input']!r} ({e['msg']}).", fix))
    return issues


def _load_ds_config(ds_config: dict | str | os.PathLike) -> dict:
    if isinstance(ds_config, (str, os.PathLike)):
        path = Path(ds_config)
        try:
            ds_config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise AsyncHZPConfigError("ds_config", f"file {path} is not valid JSON ({e}).", "fix the JSON syntax.") from e
    if not isinstance(ds_config, dict):
        raise AsyncHZPConfigError(
            "ds_config", f"must be a JSON object, got {type(ds_config).__name__}.", "pass a dict or a path to a JSON file."
        )
    return ds_config


def section_from_ds_config(ds_config: dict | str | os.PathLike) -> AsyncHZPConfig | None:
    """Parse the ``async_hzp`` section of a ds_config dict or JSON file.

    Returns None when the section is absent or ``enabled`` is false. The
    section is validated even when disabled so that typos are not hidden.
    """
    raw = _load_ds_config(ds_config).get(SECTION)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise AsyncHZPConfigError(
            SECTION, f"must be a JSON object, got {raw!r}.", f'use "{SECTION}": {{}} to enable it with defaults.'
        )
    try:
        section = AsyncHZPConfig.model_validate(raw)
    except ValidationError as e:
        raise AsyncHZPConfigError(_issues_from_validation(e)) from None
    return section if section.enabled else None


@dataclass(frozen=True)
class ResolvedLayout:
    """Concrete group sizes for one run; every field is a positive integer."""

    world_size: int
    node_size: int
    num_nodes: int
    param_shard_size: int
    grad_shard_size: int
    optimizer_shard_size: int
    log_layout: bool = True

    def describe(self) -> str:
        w = self.world_size
        return (
            f"async_hzp layout: world={w} ({self.num_nodes} node(s) x {self.node_size} ranks); "
            f"params sharded over {self.param_shard_size} ({w // self.param_shard_size} replicas), "
            f"grads over {self.grad_shard_size} ({w // self.grad_shard_size} replicas), "
            f"optimizer states over {self.optimizer_shard_size}"
        )


def _param_bytes(ds_config: dict) -> int:
    """Bytes of a working parameter element: 2 under bf16/fp16, else 4 (fp32)."""
    for key in ("bf16", "bfloat16", "fp16"):
        if isinstance(ds_config.get(key), dict) and ds_config[key].get("enabled", False):
            return 2
    return 4


def _fmt(values: list[int]) -> str:
    return ", ".join(map(str, values))


def _zero_compat_issues(ds_config: dict, has_client_optimizer: bool) -> list[ConfigIssue]:
    """Settings elsewhere in the ds_config that AsyncHZP needs or cannot combine with."""
    issues = []
    zero = ds_config.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        return [ConfigIssue("zero_optimization", f"must be a JSON object, got {zero!r}.", 'use {"stage": 3}.')]

    stage = zero.get("stage")
    if type(stage) is not int or stage != 3:
        found = "is not set (DeepSpeed then uses stage 0)" if stage is None else f"is {stage!r}"
        issues.append(ConfigIssue("zero_optimization.stage", f"{found}, but async_hzp builds on ZeRO stage 3.",
                                  "set zero_optimization.stage to 3."))

    hpz = zero.get("zero_hpz_partition_size", 1)
    if isinstance(hpz, int) and hpz > 1:
        issues.append(ConfigIssue(
            "zero_optimization.zero_hpz_partition_size",
            f"is {hpz}; ZeRO++ hpZ builds its own secondary parameter partition, which conflicts with async_hzp.",
            f"remove zero_optimization.zero_hpz_partition_size (or set it to 1) and use "
            f"async_hzp.param_shard_size: {hpz} instead."))

    for key in ("zero_quantized_gradients", "zero_quantized_weights"):
        if zero.get(key):
            issues.append(ConfigIssue(f"zero_optimization.{key}", "is true, which is not supported together with async_hzp yet.",
                                      f"set zero_optimization.{key} to false, or remove the async_hzp section."))

    for key in ("offload_param", "offload_optimizer"):
        offload = zero.get(key)
        device = offload.get("device", "none") if isinstance(offload, dict) else None
        if device is not None and str(device).lower() != "none":
            issues.append(ConfigIssue(f"zero_optimization.{key}.device",
                                      f"is {device!r}; offloading is not supported together with async_hzp.",
                                      f'set zero_optimization.{key}.device to "none" or remove zero_optimization.{key}.'))
    # Deprecated spellings of the same offload features.
    for key, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if zero.get(key):
            issues.append(ConfigIssue(f"zero_optimization.{key}", f"is true (deprecated spelling of {new}); offloading "
                                      "is not supported together with async_hzp.", f"remove zero_optimization.{key}."))

    for key in ("mics_shard_size", "mics_hierarchical_params_gather"):
        if key in zero:
            issues.append(ConfigIssue(f"zero_optimization.{key}", "is set, but MiCS was removed from DeepSpeed.",
                                      f"remove zero_optimization.{key}; async_hzp.param_shard_size gives "
                                      "the same intra-node parameter sharding."))

    if not ds_config.get("optimizer") and not has_client_optimizer:
        issues.append(ConfigIssue(
            "optimizer", "is not configured and no client optimizer was passed; async_hzp shards optimizer states "
            "and needs the optimizer at initialization.",
            'add an "optimizer" section, e.g. {"type": "AdamW", "params": {"lr": 1e-4}}, '
            "or pass optimizer= to deepspeed.initialize."))
    return issues


def _resolve_node_size(section: AsyncHZPConfig, local_world_size: int | None, world: int) -> int:
    key = f"{SECTION}.node_size"
    if section.node_size is not None:
        node, source = section.node_size, "set in the config"
    elif local_world_size is not None:
        node, source = local_world_size, "the launcher's local world size"
    else:
        node = source = None
        for env in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            raw = os.environ.get(env, "").strip()
            if raw:
                if not raw.isdigit() or int(raw) < 1:
                    raise AsyncHZPConfigError(key, f"is unset and the environment has {env}={raw!r}, not a positive integer.",
                                              f"set {key} to the number of ranks per node.")
                node, source = int(raw), f"environment {env}"
                break
        if node is None:
            raise AsyncHZPConfigError(
                key, "is unset and the ranks per node are unknown (no LOCAL_WORLD_SIZE or LOCAL_SIZE in the environment).",
                f"set {key} to the number of data-parallel ranks per node, e.g. 8, or start with a launcher "
                "that sets LOCAL_WORLD_SIZE (torchrun, deepspeed).")
    if world % node != 0:
        valid = sizing.divisors(world)
        below = max(v for v in valid if v <= node)
        above = [v for v in valid if v > node]
        nearest = f"values {below} or {above[0]}" if above else f"value {below}"
        raise AsyncHZPConfigError(
            key, f"is {node} (from {source}), which does not divide the data-parallel world size {world}.",
            f"set {key} to the data-parallel ranks per node, a divisor of {world}: nearest valid "
            f"{nearest} (all: {_fmt(valid)}). With tensor/pipeline parallelism count data-parallel ranks only.")
    return node


def _valid_grad_sizes(d_p: int, node: int, world: int) -> list[int]:
    return [v for v in sizing.divisors(world) if v % d_p == 0 and (node % v == 0 or v % node == 0)]


def _layout_issues(d_p: int, d_g: int, d_o: int, node: int, world: int) -> list[ConfigIssue]:
    issues = []
    p_key, g_key, o_key = (f"{SECTION}.{k}_shard_size" for k in ("param", "grad", "optimizer"))
    param_ok = node % d_p == 0
    if not param_ok:
        issues.append(ConfigIssue(
            p_key, f"is {d_p}, which does not divide node_size {node}; parameters are gathered inside a node only.",
            f"set {p_key} to one of {_fmt(sizing.divisors(node))}, or leave it unset for {node}."))
    if param_ok:
        reason = None
        if d_g % d_p != 0:
            reason = f"is not a multiple of {p_key}={d_p} (grad shards are built from whole param shards)"
        elif world % d_g != 0:
            reason = f"does not divide the data-parallel world size {world}"
        elif d_g > node and d_g % node != 0:
            reason = f"spans nodes, so it must be a multiple of node_size {node}"
        elif d_g <= node and node % d_g != 0:
            reason = f"does not divide node_size {node}"
        if reason:
            issues.append(ConfigIssue(g_key, f"is {d_g}, which {reason}.",
                                      f"set {g_key} to one of {_fmt(_valid_grad_sizes(d_p, node, world))}, "
                                      f"or leave it unset (defaults to {p_key}={d_p})."))
    if d_o != world:
        issues.append(ConfigIssue(
            o_key, f"is {d_o}; optimizer shards smaller than the data-parallel world ({world}) are not supported "
            "in this release.", f"leave {o_key} unset or set it to the world size {world}."))
    return issues


def resolve_layout(
    ds_config: dict | str | os.PathLike,
    world_size: int,
    local_world_size: int | None,
    *,
    has_client_optimizer: bool = False,
    num_parameters: int | None = None,
) -> ResolvedLayout | None:
    """Validate the whole ds_config for AsyncHZP and resolve the group sizes.

    ``world_size`` is the data-parallel world size; ``local_world_size`` the
    ranks per node when the caller knows it (else the launcher's environment
    is read). ``num_parameters`` (padded, see :mod:`ds_asynchzp.sizing`) is
    needed only for ``"auto"``. Returns None when the section is absent or
    disabled. Pure function of its inputs and the environment: no process
    group is created or used.
    """
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if local_world_size is not None and (type(local_world_size) is not int or local_world_size < 1):
        raise ValueError(f"local_world_size must be a positive int or None, got {local_world_size!r}")

    ds_config = _load_ds_config(ds_config)
    section = section_from_ds_config(ds_config)
    if section is None:
        return None
    issues = _zero_compat_issues(ds_config, has_client_optimizer)
    if issues:
        raise AsyncHZPConfigError(issues)

    world = world_size
    node = _resolve_node_size(section, local_world_size, world)
    d_p, d_g, d_o = section.param_shard_size, section.grad_shard_size, section.optimizer_shard_size

    auto_keys = [f"{SECTION}.{k}" for k in ("param_shard_size", "grad_shard_size") if getattr(section, k) == "auto"]
    if auto_keys:
        # "auto" chooses d_p and d_g together; a fixed partner would invalidate the memory model.
        for k, v in (("param_shard_size", d_p), ("grad_shard_size", d_g)):
            if isinstance(v, int):
                raise AsyncHZPConfigError(
                    f"{SECTION}.{k}", f"is {v}, but {auto_keys[0]} is \"auto\", which chooses both sizes together.",
                    f'remove {SECTION}.{k} or set it to "auto" as well, or give both sizes as integers.')
        if num_parameters is None:
            raise AsyncHZPConfigError(
                auto_keys[0], '"auto" needs the model\'s parameter count, which was not provided.',
                "pass num_parameters (the model's padded parameter count) to resolve_layout, or set integer "
                f"sizes, e.g. {SECTION}.param_shard_size to one of {_fmt(sizing.divisors(node))}.")
        budget = None if section.memory_budget_gb is None else section.memory_budget_gb * sizing.BYTES_PER_GB
        d_p, d_g, _ = sizing.choose_shard_sizes(num_parameters, world, node, budget,
                                                param_bytes=_param_bytes(ds_config))
    else:
        d_p = node if d_p is None else d_p
        d_g = d_p if d_g is None else d_g
    d_o = world if d_o in (None, "auto") else d_o

    issues = _layout_issues(d_p, d_g, d_o, node, world)
    if issues:
        raise AsyncHZPConfigError(issues)

    # Logged by the engine once its process groups exist (rank 0 only).
    return ResolvedLayout(world, node, world // node, d_p, d_g, d_o, log_layout=section.log_layout)
