"""Which flow of a training step a collective belongs to, for ZeRO++'s volume table (per optimizer step, bytes by
forward gather, backward gather, gradient reduction), whichever engine issued it.

Stock DeepSpeed's collectives carry no tag; they are told apart by their op and by the training phase the
process was in when they were issued (`CommLedger.set_phase`: the benchmark marks forward, backward and step).
AsyncHZP's carry their flow in their ledger tag. A gather that AsyncHZP's thread runs ahead of compute counts in
the phase during which it was issued: a prefetch for the first backward module, issued during the forward,
counts as a forward gather.
"""

from __future__ import annotations

FORWARD_GATHER = "forward gather"
BACKWARD_GATHER = "backward gather"
GRADIENT_REDUCTION = "gradient reduction"
PARAMETER_REFRESH = "parameter refresh"
OTHER = "other"
FLOWS = (FORWARD_GATHER, BACKWARD_GATHER, GRADIENT_REDUCTION, PARAMETER_REFRESH, OTHER)

PHASES = ("forward", "backward", "step")
_GATHER_BY_PHASE = {"forward": FORWARD_GATHER, "backward": BACKWARD_GATHER}
# AsyncHZP's tags (the family prefix, `asynchzp.` or `asynchzp.expert.`, then the flow).
_TAG_FLOWS = (("param_refresh", PARAMETER_REFRESH), ("boundary_grad", GRADIENT_REDUCTION),
              ("boundary_allreduce", GRADIENT_REDUCTION), ("grad_reduce_scatter", GRADIENT_REDUCTION))
_GRADIENT_OPS = ("reduce_scatter", "all_to_all", "all_reduce")


def flow_of(op: str, tag: str, phase: str) -> str:
    """The flow of one ledger record (its op kind, tag and the phase it was issued in)."""
    for suffix, flow in _TAG_FLOWS:
        if tag.endswith(suffix):
            return flow
    gather = tag.endswith("param_gather") or (not tag and op == "all_gather")
    if gather and phase in _GATHER_BY_PHASE:
        return _GATHER_BY_PHASE[phase]
    # Stock ZeRO-3 reduces gradients in the backward (reduce-scatter; qgZ's all-to-alls); its step's
    # all-reduces (gradient norm, overflow) are "other".
    if not tag and op in _GRADIENT_OPS and phase == "backward":
        return GRADIENT_REDUCTION
    return OTHER
