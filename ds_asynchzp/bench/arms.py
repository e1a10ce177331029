"""The benchmark's arms, and the `--arms` syntax: `BASE[:key=value]...`, a known arm plus overrides of its
`async_hzp` section (`asynchzp:param_shard_size=2`), parsed and refused here before any rank starts."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

from ..formulas.traffic import offload_twin
from ..planner.arm_formulas import QUANTIZED_ARMS

# arm -> (what it is, substring of the optimizer class the worker must find in the engine).
ARMS = {
    "zero3": ("stock DeepSpeed ZeRO-3", "DeepSpeedZeroOptimizer_Stage3"),
    "hpz": ("stock ZeRO++ hpZ (secondary parameter partition inside a node)", "DeepSpeedZeroOptimizer_Stage3"),
    "zeropp": ("stock ZeRO++: hpZ + qwZ (INT8 weight gathers) + qgZ (INT4 gradient all-to-all)",
               "DeepSpeedZeroOptimizer_Stage3"),
    "asynchzp": ("AsyncHZP (params+grads inside a node, optimizer states over the world)",
                 "HierarchicalZeroOptimizer"),
    "asynchzp-sync": ("AsyncHZP placement, communication synchronous on the training thread (A/B of the scheduling)",
                      "HierarchicalZeroOptimizer"),
    "asynchzp-q": ("AsyncHZP, cross-node gradient exchange and parameter refresh quantized (quantize_cross_node)",
                   "HierarchicalZeroOptimizer"),
    "asynchzp-qw": ("AsyncHZP, INT8 parameter gathers inside the node (quantized_weights)",
                    "HierarchicalZeroOptimizer"),
    "asynchzp-qg": ("AsyncHZP, every gradient reduction a quantized all-to-all (quantized_gradients)",
                    "HierarchicalZeroOptimizer"),
    "zero3-offload": ("stock DeepSpeed ZeRO-3, optimizer states on the host (offload_optimizer cpu, "
                      "DeepSpeedCPUAdam)", "DeepSpeedZeroOptimizer_Stage3"),
    "asynchzp-offload": ("AsyncHZP, optimizer states on the host (offload_optimizer cpu, DeepSpeedCPUAdam)",
                         "HierarchicalZeroOptimizer"),
}
# The offload arms are opt-in: on CPU ranks their host Adam and copies lengthen the default run.
DEFAULT_ARMS = "zero3,hpz,asynchzp"
# Optimizer offload as both offload arms set it; pin_memory is left to DeepSpeed's default (true in 0.19.8), so
# neither arm gets a setting the other lacks.
OFFLOAD_OPTIMIZER = {"device": "cpu"}
# Offload arm -> the arm it is with its optimizer states on the host: everything else, ds_config and formulas,
# is that arm's. The name rule is the formulas' own (`traffic.offload_twin`), so the bench and the planner agree.
OFFLOAD_ARMS = {arm: offload_twin(arm) for arm in ARMS if offload_twin(arm) != arm}
# zero_optimization keys each arm adds to the shared ZeRO-3 knobs (beyond hpZ's and ZeRO++'s, which the CLI sets
# from the node size).
ARM_ZERO_KEYS = {arm: {"offload_optimizer": dict(OFFLOAD_OPTIMIZER)} for arm in OFFLOAD_ARMS}
# Arms built on the ds_config's "async_hzp" section: only these take `BASE:key=value` overrides of that section.
OVERRIDABLE_ARMS = ("asynchzp", "asynchzp-sync", *QUANTIZED_ARMS, "asynchzp-offload")
# Section keys each of those arms fixes: asynchzp and asynchzp-sync differ in async_comm alone, so an A/B of them
# isolates the scheduling; each quantized arm differs from asynchzp in its quantization key alone; asynchzp-offload
# differs from it in ARM_ZERO_KEYS alone.
ARM_SECTION_KEYS = {"asynchzp": {}, "asynchzp-sync": {"async_comm": False}, **QUANTIZED_ARMS, "asynchzp-offload": {}}
# Section keys an arm spec may not set, and why: "enabled": false would train stock ZeRO-3 under an AsyncHZP name;
# "async_comm" is what the arm's name says, so flipping it would mislabel every figure of the arm.
FORBIDDEN_OVERRIDE_KEYS = {
    "enabled": "an asynchzp arm always enables the section; run the zero3 arm for stock ZeRO-3",
    "async_comm": "the arm's name fixes it",
}
# async_comm value -> the arm that runs with it, named in the error that refuses the key.
ASYNC_COMM_ARMS = {True: "asynchzp", False: "asynchzp-sync"}


def arm_dir_name(arm: str) -> str:
    """An arm's name as its log and record folders spell it: "asynchzp:param_shard_size=1" ->
    "asynchzp_param_shard_size=1" (no ':' in paths: PATH-like lists, Windows)."""
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", arm)


def arm_zero_keys(base: str) -> dict:
    """The arm's own zero_optimization keys (`ARM_ZERO_KEYS`), a fresh copy for the caller's ds_config."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in ARM_ZERO_KEYS.get(base, {}).items()}


# zero_optimization keys of stock ZeRO++: the arms that are not ZeRO++ run without them, whatever the shared config
# says, and hpz and zeropp set their own.
ZEROPP_KEYS = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
               "zero_quantized_gradients")


def zeropp_keys(node_size: int) -> dict:
    """ZeRO++ as its tutorial configures it: hpZ over the node, qwZ and qgZ."""
    return {"zero_hpz_partition_size": node_size, "zero_quantized_weights": True, "zero_quantized_gradients": True}


def arm_ds_config(shared: dict, spec: "ArmSpec", node_size: int) -> dict:
    """One arm's ds_config from the configuration every arm shares (the bench's, or the user's own file).

    Everything but the arm's keys is the shared config's: zero3 drops the ``async_hzp`` section and ZeRO++'s keys;
    hpz sets ``zero_hpz_partition_size`` to the node; zeropp adds qwZ and qgZ; an AsyncHZP arm keeps the shared
    section (its ``enabled`` key dropped: the arm always enables it) with ``node_size`` unless the section gives it,
    adds its own keys and the spec's overrides;
    the offload arms add ``offload_optimizer``."""
    config = copy.deepcopy(shared)
    section = {k: v for k, v in (config.pop("async_hzp", None) or {}).items() if k != "enabled"}
    zero = config.setdefault("zero_optimization", {})
    for key in ZEROPP_KEYS:
        zero.pop(key, None)
    if spec.base == "hpz":
        zero["zero_hpz_partition_size"] = node_size
    if spec.base == "zeropp":
        zero.update(zeropp_keys(node_size))
    zero.update(arm_zero_keys(spec.base))
    if spec.base in OVERRIDABLE_ARMS:
        # The arm's fixed keys cannot collide with the overrides: parse_arm_spec refuses those keys.
        # The ranks per node the tool was given or read from the launch command, unless the shared section names
        # them: Accelerate rewrites LOCAL_WORLD_SIZE on CPU ranks, so the environment may not tell.
        config["async_hzp"] = {"node_size": node_size, **section, **ARM_SECTION_KEYS[spec.base], **spec.overrides}
    return config


def placement_arm(base: str) -> str:
    """The arm whose placement (and formulas) an arm has: an offload arm's twin without offload, else itself
    (`traffic.offload_twin`)."""
    return offload_twin(base)


class ArmSpecError(ValueError):
    """A malformed ``--arms`` entry; the message names the spec (and the key, where one is at fault)."""


@dataclass(frozen=True)
class ArmSpec:
    """One ``--arms`` entry, ``BASE[:key=value]...``: a known arm plus overrides of its ``async_hzp`` section.

    `name` is the spec exactly as given; it names the arm everywhere (results.json, tables, plots, report)."""

    name: str
    base: str
    overrides: dict = field(default_factory=dict)

    @property
    def identity(self) -> tuple:
        # Same base and same overrides in any order: the same configuration, however it is spelled.
        return self.base, tuple(sorted(self.overrides.items()))


def override_keys() -> list[str]:
    """Keys of the ``async_hzp`` section an arm spec may override (the section's own fields)."""
    from ds_asynchzp.config import AsyncHZPConfig

    return [k for k in AsyncHZPConfig.model_fields if k not in FORBIDDEN_OVERRIDE_KEYS]


_INT = re.compile(r"[+-]?\d+")


def _override_value(text: str):
    """An override value as the JSON section would hold it: integers (shard and node sizes) or "auto"; also
    numbers for memory_budget_gb, true/false and null, so every key of the section can be spelled."""
    lowered = text.lower()
    if lowered == "auto":
        return "auto"
    if _INT.fullmatch(text):
        return int(text)
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"value {text!r} is not an integer or \"auto\"") from None


def _async_comm_hint(base: str, raw: str, parts: list[str]) -> str:
    """Which arm to run instead of overriding async_comm, spelled with the spec's other overrides."""
    if base not in ASYNC_COMM_ARMS.values():
        # Naming asynchzp-sync here would drop what the arm adds (its quantization, its offload).
        return (f"{FORBIDDEN_OVERRIDE_KEYS['async_comm']}: the {base} arm runs with async_comm true; compare "
                "asynchzp with asynchzp-sync for the scheduling")
    wanted = ASYNC_COMM_ARMS.get(raw.lower() == "true") if raw.lower() in ("true", "false") else None
    if wanted is None:
        return (f"{FORBIDDEN_OVERRIDE_KEYS['async_comm']}; run the asynchzp arm for communication on background "
                "threads, the asynchzp-sync arm for synchronous communication")
    if wanted == base:
        return f"the {base} arm already runs with async_comm {raw.lower()}; leave the key out"
    rest = [p for p in parts if p.partition("=")[0].strip() != "async_comm"]
    return f"{FORBIDDEN_OVERRIDE_KEYS['async_comm']}; run the arm {':'.join([wanted, *rest])!r} instead"


def parse_arm_spec(spec: str) -> ArmSpec:
    """Parse ``BASE[:key=value]...``; raises `ArmSpecError` naming the spec, the offending key and the valid keys."""
    base, *parts = [p.strip() for p in spec.strip().split(":")]
    name = spec.strip()
    if base not in ARMS:
        raise ArmSpecError(f"unknown arm(s) {base!r} in arm spec {name!r}; choose from {', '.join(ARMS)}"
                           if parts else f"unknown arm(s) {base!r}; choose from {', '.join(ARMS)}")
    if not parts:
        return ArmSpec(name, base, {})
    valid = override_keys()
    overrides: dict = {}
    for part in parts:
        key, sep, raw = (s.strip() for s in part.partition("="))
        if not sep or not key or not raw:
            raise ArmSpecError(f"arm spec {name!r}: override {part!r} is not key=value (syntax: "
                               f"BASE[:key=value]...); valid keys: {', '.join(valid)}")
        if base not in OVERRIDABLE_ARMS:
            raise ArmSpecError(f"arm spec {name!r}: arm {base!r} takes no overrides (key {key!r}); only "
                               f"{', '.join(OVERRIDABLE_ARMS)} arms take async_hzp keys (valid keys: "
                               f"{', '.join(valid)})")
        if key in FORBIDDEN_OVERRIDE_KEYS:
            hint = _async_comm_hint(base, raw, parts) if key == "async_comm" else FORBIDDEN_OVERRIDE_KEYS[key]
            raise ArmSpecError(f"arm spec {name!r}: key {key!r} cannot be overridden: {hint}; "
                               f"valid keys: {', '.join(valid)}")
        if key in QUANTIZED_ARMS.get(base, {}):
            raise ArmSpecError(f"arm spec {name!r}: key {key!r} cannot be overridden: the {base} arm is defined by "
                               f"{key}={str(QUANTIZED_ARMS[base][key]).lower()}; run the asynchzp arm with other "
                               "quantization keys instead")
        if key not in valid:
            raise ArmSpecError(f"arm spec {name!r}: unknown key {key!r}; valid keys: {', '.join(valid)}")
        if key in overrides:
            raise ArmSpecError(f"arm spec {name!r}: key {key!r} given twice")
        try:
            overrides[key] = _override_value(raw)
        except ValueError as exc:
            raise ArmSpecError(f"arm spec {name!r}: key {key!r}: {exc}") from None
    return ArmSpec(name, base, overrides)


def parse_arm_specs(text: str) -> list[ArmSpec]:
    """The comma-separated ``--arms`` value, in order; rejects an empty list and arms given twice."""
    specs = [parse_arm_spec(a) for a in text.split(",") if a.strip()]
    if not specs:
        raise ArmSpecError("give at least one arm")
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ArmSpecError(f"arm(s) listed twice: {', '.join(duplicates)}")
    first: dict = {}
    for s in specs:
        if s.identity in first:
            raise ArmSpecError(f"arm(s) listed twice: {first[s.identity]!r} and {s.name!r} are the same "
                               "configuration")
        first[s.identity] = s.name
    return specs
