"""What `config.resolve_layout` resolves for one run, in small records by concern: the sizes of the layout
(`LayoutSizes`), how its collectives are scheduled (`Scheduling`), which of them travel quantized
(`QuantizationSettings`), plus whether the engine has an optimizer, Ulysses SP's degree, and whether and why the
layout is logged.

The names of the sizes (`LAYOUT_KEYS`) are defined here once: checkpoint manifests, the per-rank state files and
the bench's records all write them under these keys, and a checkpoint saved earlier is read by them. Nothing here
imports DeepSpeed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from .formulas.sizing import SIZE_KEYS
from .layout import HierarchicalLayout
from .quantization import QuantizationPlan, plan_quantization

# Gathers replayed ahead of compute while DeepSpeed's own prefetch is on (`config.resolve_prefetch_depth`).
DEFAULT_PREFETCH_DEPTH = 2
# The sizes as a checkpoint saves them (its manifest, each rank's state file): what decides which rank holds which
# atom. The number of nodes follows from them.
LAYOUT_KEYS = ("world_size", "node_size") + SIZE_KEYS
# The sizes as the bench's records and results.json show them: with the number of nodes.
RECORD_KEYS = ("world_size", "node_size", "num_nodes") + SIZE_KEYS


@dataclass(frozen=True)
class LayoutSizes:
    """The data-parallel world, ranks per node, and the shard sizes d_p | d_g | d_o (the async_hzp keys)."""

    world_size: int
    node_size: int
    param_shard_size: int       # d_p
    grad_shard_size: int        # d_g
    optimizer_shard_size: int   # d_o

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.node_size

    def grid(self) -> HierarchicalLayout:
        return HierarchicalLayout(self.world_size, self.node_size, self.param_shard_size, self.grad_shard_size,
                                  self.optimizer_shard_size)

    def as_saved(self) -> dict:
        """The sizes under `LAYOUT_KEYS`, as checkpoints save them."""
        return {key: getattr(self, key) for key in LAYOUT_KEYS}

    def as_dict(self) -> dict:
        """The sizes under `RECORD_KEYS`, as records show them."""
        return {key: getattr(self, key) for key in RECORD_KEYS}


# DeepSpeed 0.19.8's process-group timeout when neither the user nor DEEPSPEED_TIMEOUT sets one
# (`deepspeed/constants.py`: default_pg_timeout, 10 minutes).
DEEPSPEED_DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Scheduling:
    """How the layout's collectives are scheduled (the async_hzp keys of the same names)."""

    async_comm: bool = True
    prefetch_depth: int = DEFAULT_PREFETCH_DEPTH
    boundary_bucket_size: Optional[int] = None
    comm_timeout_s: float = DEEPSPEED_DEFAULT_TIMEOUT_S
    issue_order: str = "auto"
    # With optimizer offload: the host step chunk by chunk, its copies back and refresh under it.
    offload_pipeline: bool = True
    # Where comm_timeout_s comes from (the section's key, the default process group, DeepSpeed's default).
    comm_timeout_source: str = "DeepSpeed's default"


@dataclass(frozen=True)
class QuantizationSettings:
    """The async_hzp keys of the same names that ask for quantized communication; `plan()` says which flows of a
    layout they quantize, in which format."""

    quantized_weights: bool = False
    quantized_gradients: bool = False
    quantize_cross_node: bool = False
    gradient_quantization_bits: int = 8
    quantization_block_size: int = 512
    error_feedback: bool = False

    def plan(self, grid: HierarchicalLayout) -> QuantizationPlan:
        return plan_quantization(grid, self.quantized_weights, self.quantized_gradients, self.quantize_cross_node,
                                 self.gradient_quantization_bits, self.quantization_block_size, self.error_feedback)

    def residual_format(self) -> dict:
        """What the error-feedback residual saved per rank depends on besides the sizes: the wire format."""
        return {"gradient_quantization_bits": self.gradient_quantization_bits,
                "quantization_block_size": self.quantization_block_size}


@dataclass(frozen=True)
class ResolvedLayout:
    """Concrete group sizes for one run, and the settings that go with them; every size is a positive integer.

    ``auto_reason`` is set when ``"auto"`` chose any size: which layouts were considered, the winner's memory
    against the budget and its estimated communication time against the runner-up's.
    """

    sizes: LayoutSizes
    scheduling: Scheduling = field(default_factory=Scheduling)
    quantization: QuantizationSettings = field(default_factory=QuantizationSettings)
    # False for an engine built without an optimizer (a frozen reference model, a teacher, evaluation): it gets
    # stock ZeRO-3's parameter-only engine with its parameters sharded over d_p inside the node (runtime/api.py).
    has_optimizer: bool = True
    # Ulysses sequence parallelism's degree (ALST's mpu): SP groups of consecutive ranks inside the ZeRO world.
    sequence_parallel_size: int = 1
    log_layout: bool = True
    auto_reason: Optional[str] = None
    # async_hzp.reference_models: models without an optimizer that "auto" counted (memory and forwards), and why
    # the config keeps their engines stock's (`config_compat.reference_copy_refusal`; None: they get hpZ's copy).
    reference_models: int = 0
    reference_copy_refusal: Optional[str] = None

    def grid(self) -> HierarchicalLayout:
        return self.sizes.grid()

    def quantization_plan(self, grid: Optional[HierarchicalLayout] = None) -> QuantizationPlan:
        """Which flows of this layout (or of `grid`, another family's layout under the same keys) travel
        quantized, in which format (`ds_asynchzp.quantization`)."""
        return self.quantization.plan(grid or self.grid())

    def as_dict(self) -> dict:
        """The layout as JSON-ready values (what the benchmark records per arm in results.json)."""
        s, w = self.sizes, self.sizes.world_size
        return {**s.as_dict(),
                "param_replicas": w // s.param_shard_size, "grad_replicas": w // s.grad_shard_size,
                "optimizer_replicas": w // s.optimizer_shard_size, "auto_reason": self.auto_reason,
                "async_comm": self.scheduling.async_comm, "prefetch_depth": self.scheduling.prefetch_depth,
                **asdict(self.quantization),
                "quantization": self.quantization_plan().describe(),
                "sequence_parallel_size": self.sequence_parallel_size}

    def describe(self) -> str:
        """One line for rank 0's log: every size with its replica count, and why "auto" chose it."""
        s, w = self.sizes, self.sizes.world_size
        if not self.has_optimizer:   # runtime/api.py adds where the parameters go
            return (f"async_hzp layout: world={w} ({s.num_nodes} node(s) x {s.node_size} ranks); no optimizer: "
                    "DeepSpeed's parameter-only ZeRO-3 engine" + self._references_text())
        text = (
            f"async_hzp layout: world={w} ({s.num_nodes} node(s) x {s.node_size} ranks); "
            f"params sharded over d_p={s.param_shard_size} ({_replicas(w // s.param_shard_size)}), "
            f"grads over d_g={s.grad_shard_size} ({_replicas(w // s.grad_shard_size)}), "
            f"optimizer states over d_o={s.optimizer_shard_size} ({_replicas(w // s.optimizer_shard_size)}); "
            + (f"communication on background threads (prefetch depth {self.scheduling.prefetch_depth})"
               if self.scheduling.async_comm else "communication synchronous (async_comm false)")
        )
        timeout = self.scheduling.comm_timeout_s
        text = f"{text}; collectives time out after {timeout:g} s ({self.scheduling.comm_timeout_source})"
        plan = self.quantization_plan()
        if plan.any:
            text = f"{text}; {plan.describe()}"
        if self.sequence_parallel_size > 1:
            sp = self.sequence_parallel_size
            where = ("inside a node" if s.node_size % sp == 0 else
                     f"across nodes ({sp} does not divide the node size {s.node_size})")
            text = f"{text}; Ulysses sequence parallelism sp={sp}: its all-to-alls run {where}"
        text += self._references_text()
        return f"{text}; {self.auto_reason}" if self.auto_reason else text


    def _references_text(self) -> str:
        if not self.reference_models:
            return ""
        s = self.sizes
        where = ("each partitioned over the world with hpZ's copy over d_p"
                 if self.reference_copy_refusal is None and 1 < s.param_shard_size < s.world_size else
                 "each partitioned over the world, as stock: " + (self.reference_copy_refusal or "d_p is 1 or the world"))
        return f"; {self.reference_models} reference model(s) counted (async_hzp.reference_models): {where}"


def _replicas(n: int) -> str:
    return f"{n} replica" + ("" if n == 1 else "s")


__all__ = ["DEFAULT_PREFETCH_DEPTH", "LAYOUT_KEYS", "RECORD_KEYS", "LayoutSizes", "QuantizationSettings",
           "ResolvedLayout", "Scheduling"]
