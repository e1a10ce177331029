"""The rest of the ds_config: the DeepSpeed settings AsyncHZP needs, cannot combine with, or constrains
(AutoEP's expert groups). Pure functions of the config and the world; nothing here imports DeepSpeed."""

from __future__ import annotations

from typing import Any

from .errors import ConfigIssue
from .layout import expert_members_per_node

SECTION = "async_hzp"


def value_in(section: Any, key: str) -> Any:
    return section.get(key) if isinstance(section, dict) else None


def offloads_optimizer(ds_config: dict) -> bool:
    """Whether the ds_config puts the optimizer states on the host (``offload_optimizer.device: "cpu"``), the one
    offload AsyncHZP takes (``compat_issues`` refuses the others by name)."""
    zero = ds_config.get("zero_optimization")
    device = value_in(value_in(zero, "offload_optimizer") if isinstance(zero, dict) else None, "device")
    return str(device).lower() == "cpu"


def compat_issues(ds_config: dict) -> list[ConfigIssue]:
    """Settings elsewhere in the ds_config that AsyncHZP needs or cannot combine with.

    Key spellings checked against DeepSpeed 0.19.8: ``zero_quantized_nontrainable_weights`` is a field of
    DeepSpeedZeroConfig (runtime/zero/config.py); ``super_offload`` a field of the optimizer offload config
    (runtime/zero/offload_config.py, read as ``zero_optimization.offload_optimizer.super_offload`` by
    engine.super_offload(), which then builds SuperOffloadOptimizer_Stage3 whatever the offload device);
    ``autotp_size`` of the ``tensor_parallel`` section (runtime/tensor_parallel/config.py, 0 = off);
    ``expert_parallel.expert_tensor_parallel_size`` (runtime/config.py EXPERT_PARALLEL,
    module_inject/auto_ep_config.py);
    ``compile.deepcompile`` (runtime/config.py builds CompileConfig from the ``compile`` section).
    """
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

    # ZeRO++ quantization lives in Stage 3 paths that async_hzp replaces; its own keys quantize those flows.
    ours = {"zero_quantized_gradients": f"{SECTION}.quantized_gradients", "zero_quantized_weights":
            f"{SECTION}.quantized_weights", "zero_quantized_nontrainable_weights": None}
    for key, instead in ours.items():
        if zero.get(key):
            fix = (f"set zero_optimization.{key} to false and use {instead}: true instead" if instead else
                   f"set zero_optimization.{key} to false, or remove the async_hzp section")
            issues.append(ConfigIssue(f"zero_optimization.{key}",
                                      "is true; ZeRO++ quantization cannot be combined with async_hzp.", f"{fix}."))

    issues += _offload_issues(zero)
    # Super-offload replaces the Stage 3 optimizer class that async_hzp subclasses, even with device "none".
    if value_in(zero.get("offload_optimizer"), "super_offload"):
        issues.append(ConfigIssue("zero_optimization.offload_optimizer.super_offload",
                                  "is true; super-offload replaces the ZeRO-3 optimizer that async_hzp builds on.",
                                  "set zero_optimization.offload_optimizer.super_offload to false, or remove "
                                  "the async_hzp section."))
    if zero.get("super_offload"):  # not a DeepSpeed 0.19.8 key at this level, but named before DeepSpeed fails
        issues.append(ConfigIssue("zero_optimization.super_offload",
                                  "is true; super-offload is not supported together with async_hzp (and DeepSpeed "
                                  "reads it as zero_optimization.offload_optimizer.super_offload).",
                                  "remove zero_optimization.super_offload."))

    for key in ("mics_shard_size", "mics_hierarchical_params_gather"):
        if key in zero:
            issues.append(ConfigIssue(f"zero_optimization.{key}", "is set, but MiCS was removed from DeepSpeed.",
                                      f"remove zero_optimization.{key}; async_hzp.param_shard_size gives "
                                      "the same intra-node parameter sharding."))

    autotp = value_in(ds_config.get("tensor_parallel"), "autotp_size")
    if isinstance(autotp, (int, float)) and not isinstance(autotp, bool) and autotp > 1:
        issues.append(ConfigIssue("tensor_parallel.autotp_size",
                                  f"is {autotp}; AutoTP tensor parallelism is not supported together with async_hzp "
                                  "yet (its shard groups are built over the whole world).",
                                  "set tensor_parallel.autotp_size to 0 or 1, or remove the async_hzp section."))
    expert_tp = value_in(ds_config.get("expert_parallel"), "expert_tensor_parallel_size")
    if value_in(ds_config.get("expert_parallel"), "enabled") and isinstance(expert_tp, int) and expert_tp > 1:
        issues.append(ConfigIssue("expert_parallel.expert_tensor_parallel_size",
                                  f"is {expert_tp}; async_hzp lays out AutoEP's experts over their expert-data-"
                                  "parallel group and does not support expert tensor parallelism.",
                                  "set expert_parallel.expert_tensor_parallel_size to 1, or remove the async_hzp "
                                  "section."))
    if value_in(ds_config.get("compile"), "deepcompile"):
        issues.append(ConfigIssue("compile.deepcompile",
                                  "is true; DeepCompile replaces the ZeRO-3 gathers and reductions that async_hzp "
                                  "hooks, so it is not supported together with async_hzp.",
                                  "set compile.deepcompile to false, or remove the async_hzp section."))

    return issues




def _offload_issues(zero: dict) -> list[ConfigIssue]:
    """Optimizer states on the host (``offload_optimizer.device: "cpu"``, DeepSpeedCPUAdam) are taken; every other
    offload is refused by name, with why and what to use instead."""
    issues = []
    param_device = value_in(zero.get("offload_param"), "device")
    if param_device is not None and str(param_device).lower() != "none":
        issues.append(ConfigIssue(
            "zero_optimization.offload_param.device",
            f"is {param_device!r}; parameter offload would move the node's parameter shard over PCIe at every "
            "micro-step (each gather reads it), against the placement that keeps it on the device.",
            'set zero_optimization.offload_param.device to "none" (offload_optimizer with device "cpu" moves the '
            "larger optimizer states instead), or remove the async_hzp section."))
    optimizer = zero.get("offload_optimizer")
    device = str(value_in(optimizer, "device")).lower() if value_in(optimizer, "device") is not None else "none"
    if device == "nvme":
        issues.append(ConfigIssue(
            "zero_optimization.offload_optimizer.device",
            "is 'nvme'; async_hzp offloads optimizer states to host memory only.",
            'set zero_optimization.offload_optimizer.device to "cpu", or remove the async_hzp section.'))
    elif device not in ("none", "cpu"):
        issues.append(ConfigIssue("zero_optimization.offload_optimizer.device", f"is {device!r}.",
                                  'use "cpu" or "none".'))
    ratio = value_in(optimizer, "ratio")
    if device == "cpu" and isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio < 1:
        issues.append(ConfigIssue(
            "zero_optimization.offload_optimizer.ratio",
            f"is {ratio}; partial offload (part of the optimizer stepped on the device by a backup optimizer) is not "
            "supported together with async_hzp.", "remove zero_optimization.offload_optimizer.ratio (or set it "
            "to 1.0), or lower the device memory with a smaller async_hzp.grad_shard_size instead."))
    if zero.get("zenflow") is not None:
        issues.append(ConfigIssue(
            "zero_optimization.zenflow",
            "is set; ZenFlow replaces the ZeRO-3 step and gradient hooks that async_hzp builds on.",
            'remove zero_optimization.zenflow (offload_optimizer with device "cpu" alone is supported), or remove '
            "the async_hzp section."))
    # Deprecated spellings of the offload features (DeepSpeed maps them onto the sections above).
    for key, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if zero.get(key):
            fix = ('use zero_optimization.offload_optimizer: {"device": "cpu"} instead' if key == "cpu_offload"
                   else "remove it")
            issues.append(ConfigIssue(f"zero_optimization.{key}", f"is true, a deprecated spelling of {new}.",
                                      f"{fix}."))
    return issues


def reference_copy_refusal(ds_config: dict, sequence_parallel_size: int = 1) -> str | None:
    """Why an engine without an optimizer (a reference model) keeps stock's partitioning over the world instead of
    getting hpZ's copy over d_p, from the ds_config alone (the runtime adds what only the model tells: d_p, and how
    zero.Init partitioned it); None where the copy applies. The formulas count such engines as stock's."""
    zero = ds_config.get("zero_optimization") or {}
    if sequence_parallel_size > 1:
        return "hpZ's secondary partition is not part of DeepSpeed's Ulysses sequence-parallel path"
    if autoep_size(ds_config) is not None:
        return "DeepSpeed 0.19.8's AutoEP refuses hpZ's secondary partition"
    if zero.get("zero_quantized_weights") or zero.get("zero_quantized_nontrainable_weights"):
        return ("ZeRO++'s quantized weights would quantize the copy's blocks, not the world partitions' as stock "
                "does, and forwards would differ from stock's")
    if zero.get("use_all_reduce_for_fetch_params"):
        return ("use_all_reduce_for_fetch_params gathers by all-reduce, which turns -0.0 into +0.0, where the copy's "
                "gather keeps it: forwards would differ from stock's in the sign of zeros")
    return None


def autoep_size(ds_config: dict) -> int | None:
    """AutoEP's expert-parallel size when the ds_config enables AutoEP (DeepSpeed's default is 1), else None."""
    section = ds_config.get("expert_parallel")
    if not value_in(section, "enabled"):
        return None
    size = section.get("autoep_size", 1)
    return size if type(size) is int and size >= 1 else None  # DeepSpeed names anything else itself


def expert_issues(ds_config: dict, world: int, node: int, d_o: int) -> list[ConfigIssue]:
    """What AutoEP's expert groups require of the world and the layout (`runtime/placement.py`)."""
    ep = autoep_size(ds_config)
    if ep is None:
        return []
    issues = []
    if world % ep:
        issues.append(ConfigIssue("expert_parallel.autoep_size", f"is {ep}, which does not divide the data-parallel "
                                  f"world of {world} ranks.", "use a divisor of the world size."))
    elif expert_members_per_node(world, node, ep) is None:
        issues.append(ConfigIssue(
            "expert_parallel.autoep_size",
            f"is {ep}: its expert-data-parallel groups (one rank in every {ep}) put different numbers of ranks "
            f"on different nodes of {node} ranks; async_hzp lays experts out node by node and needs the same count "
            "on every node.", f"use an autoep_size that divides the node size {node}, or one of at least {node}."))
    if d_o < world:
        issues.append(ConfigIssue(
            f"{SECTION}.optimizer_shard_size",
            f"is {d_o}, fewer than the world's {world} ranks, with AutoEP: DeepSpeed names checkpoint files by the "
            "rank in the optimizer group and only its first replica writes them, but replicas hold different "
            "experts, so their states would be lost or loaded into the wrong rank.",
            f"set {SECTION}.optimizer_shard_size to {world} (or leave it unset)."))
    return issues
