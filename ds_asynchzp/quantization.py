"""Which flows of a step travel quantized, and in which wire format: pure arithmetic, no torch, no DeepSpeed.

Three keys of the ``async_hzp`` section choose them (``config.py``):

* ``quantized_weights``: the per-micro-step parameter all-gather (inside the d_p group, so inside a node) sends
  INT8 blocks instead of the parameter dtype;
* ``quantized_gradients``: every gradient reduction runs as a quantized all-to-all (INT8 or INT4,
  ``gradient_quantization_bits``): the per-micro-step hop inside the d_g group, then the once-per-step hop
  across nodes (boundary exchange and, with d_o < N, the optimizer-replica all-reduce);
* ``quantize_cross_node``: only the flows whose groups span nodes are quantized, the once-per-step gradient
  exchange (and replica all-reduce) with the gradient bits, the parameter refresh in INT8; every intra-node
  hop keeps full precision.

A flow whose groups all sit inside one node, or that has a single member (nothing to send), is never
quantized by ``quantize_cross_node``; ``quantized_gradients`` and ``quantized_weights`` quantize their flows
wherever they communicate.

Wire format (`QuantFormat`): a row of ``n`` values becomes ``n`` int8 bytes (INT4: ``ceil(n/2)``, two values a
byte), padded to a multiple of 4, followed by one fp32 scale per block of ``block_size`` values, so one
collective carries values and scales together. Every member's row has the same ``n``, hence the same size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .layout import HierarchicalLayout

SCALE_BYTES = 4            # one fp32 scale per block
WEIGHT_BITS = 8            # weights are always sent as INT8 (as ZeRO++ qwZ)
DEFAULT_BLOCK_SIZE = 512


@dataclass(frozen=True)
class QuantFormat:
    bits: int                       # 8 or 4
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self):
        if self.bits not in (8, 4):
            raise ValueError(f"quantization bits must be 8 or 4, got {self.bits}")
        if self.block_size < 2 or self.block_size % 2:
            raise ValueError(f"quantization block size must be an even integer >= 2, got {self.block_size}")

    def value_bytes(self, n: int) -> int:
        """Bytes of the quantized values of a row of n (before the alignment padding)."""
        return n if self.bits == 8 else (n + 1) // 2

    def blocks(self, n: int) -> int:
        return -(-n // self.block_size)

    def scales_offset(self, n: int) -> int:
        """Where the fp32 scales start in a row: the values, padded to a multiple of 4 bytes."""
        return -(-self.value_bytes(n) // SCALE_BYTES) * SCALE_BYTES

    def row_bytes(self, n: int) -> int:
        """Bytes one row of n values takes on the wire (values, padding, scales); 0 for an empty row."""
        return self.scales_offset(n) + SCALE_BYTES * self.blocks(n) if n else 0

    def bytes_per_value(self) -> float:
        """Wire bytes per value, for long rows (the analytic formulas): bits/8 plus a scale per block."""
        return self.bits / 8 + SCALE_BYTES / self.block_size


# The flows of `formulas.traffic.FLOWS` that can be quantized.
QUANTIZABLE_FLOWS = ("param_gather", "grad_reduce_scatter", "boundary_grad", "boundary_allreduce", "param_refresh")


@dataclass(frozen=True)
class QuantizationPlan:
    """The wire format of each flow, or None where it sends full precision."""

    param_gather: Optional[QuantFormat] = None
    grad_reduce_scatter: Optional[QuantFormat] = None
    boundary_grad: Optional[QuantFormat] = None
    boundary_allreduce: Optional[QuantFormat] = None
    param_refresh: Optional[QuantFormat] = None
    error_feedback: bool = False    # the boundary exchange carries each rank's quantization error to the next step

    @property
    def any(self) -> bool:
        return any(self.format_of(flow) is not None for flow in QUANTIZABLE_FLOWS)

    def format_of(self, flow: str) -> Optional[QuantFormat]:
        return getattr(self, flow) if flow in QUANTIZABLE_FLOWS else None

    def describe(self) -> str:
        parts = [f"{flow} INT{fmt.bits}" for flow in QUANTIZABLE_FLOWS if (fmt := self.format_of(flow))]
        if not parts:
            return "no quantized communication"
        block = next(self.format_of(f) for f in QUANTIZABLE_FLOWS if self.format_of(f)).block_size
        text = f"quantized communication: {', '.join(parts)} (blocks of {block})"
        return text + (", with error feedback" if self.error_feedback else "")


NO_QUANTIZATION = QuantizationPlan()


def _spans_nodes(groups, node_size: int) -> bool:
    return any(g[0] // node_size != g[-1] // node_size for g in groups)


def plan_quantization(layout: HierarchicalLayout, quantized_weights: bool = False, quantized_gradients: bool = False,
                      quantize_cross_node: bool = False, gradient_bits: int = 8,
                      block_size: int = DEFAULT_BLOCK_SIZE, error_feedback: bool = False) -> QuantizationPlan:
    """The plan the engine runs and the traffic formulas count (module docstring)."""
    grads = QuantFormat(gradient_bits, block_size)
    weights = QuantFormat(WEIGHT_BITS, block_size)
    g = layout.node_size

    def grad_flow(groups, members: int) -> Optional[QuantFormat]:
        if members <= 1:
            return None
        if quantized_gradients or (quantize_cross_node and _spans_nodes(groups, g)):
            return grads
        return None

    plan = QuantizationPlan(
        param_gather=weights if quantized_weights and layout.param_shard_size > 1 else None,
        grad_reduce_scatter=grad_flow(layout.grad_shard_groups(), layout.grad_shard_size),
        boundary_grad=grad_flow(layout.grad_boundary_groups(), layout.grad_rows),
        boundary_allreduce=grad_flow(layout.outer_replica_groups(), layout.optimizer_replicas),
        param_refresh=(weights if quantize_cross_node and layout.param_rows > 1
                       and _spans_nodes(layout.param_refresh_groups(), g) else None),
    )
    feedback = error_feedback and plan.boundary_grad is not None
    return QuantizationPlan(**{**{f: plan.format_of(f) for f in QUANTIZABLE_FLOWS}, "error_feedback": feedback})
