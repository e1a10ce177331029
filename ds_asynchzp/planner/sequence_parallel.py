"""Planning Ulysses sequence parallelism (ALST): the all-to-all bytes of attention, and where they run.

Each sequence of `seq_len` tokens is split over the `sp` ranks of an SP group; SP groups are consecutive ranks
(DeepSpeed's `parallel_state_sp`), so a group stays inside a node when `sp` divides the node size. Per attention
layer and micro-step a rank holds `seq_len / sp` tokens of the query (`hidden` values each), key and value
(`kv_hidden` each, smaller with grouped-query attention) and the attention output (`hidden`); Ulysses exchanges each
with an all-to-all in the forward (sequence split -> head split, and back for the output) and once more for their
gradients in the backward, sending `(sp - 1) / sp` of each. A rank's peers on its own node take the intra-node
share, the others the inter-node share.

ZeRO's flows are the arm's, with two changes DeepSpeed's engine makes under SP: gradients travel in
`seq_parallel_communication_data_type` (fp32 unless set), and the batch is world / sp sequences per micro-step.
Those apply to every arm alike, as do the all-to-alls.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..formulas.links import Collective

PASSES = 2     # forward, and the gradients in the backward
ASSUMPTIONS = [
    "sequence parallelism: Ulysses all-to-alls of q, k, v and the attention output per layer, forward and backward, "
    "in the parameter dtype; without activation checkpointing (with it the forward's run twice); gradient flows of "
    "every arm in seq_parallel_communication_data_type",
]


@dataclass(frozen=True)
class SpInputs:
    sp: int                      # sequence-parallel degree
    seq_len: int                 # tokens per sequence
    hidden: int                  # query and output values per token
    layers: int                  # attention layers
    kv_hidden: int = 0           # key and value values per token (0: hidden)
    grad_comm_bytes: int = 4     # seq_parallel_communication_data_type (fp32 by default)
    sequences: int = 1           # sequences per SP group per micro-step (the micro-batch)


def check(sp: SpInputs, world: int) -> None:
    if sp.sp < 1 or world % sp.sp:
        raise ValueError(f"sp {sp.sp} must divide the world size {world}")
    if sp.seq_len % sp.sp:
        raise ValueError(f"the sequence length {sp.seq_len} must be a multiple of sp {sp.sp}")
    if min(sp.hidden, sp.layers) < 1:
        raise ValueError("sequence parallelism needs the hidden size and the number of layers")


def inter_node_share(sp: int, world: int, node_size: int) -> float:
    """Of a rank's SP peers, the share on other nodes, averaged over the ranks (groups are consecutive ranks)."""
    if sp == 1:
        return 0.0
    off_node = 0
    for rank in range(world):
        group = range(rank // sp * sp, (rank // sp + 1) * sp)
        off_node += sum(1 for peer in group if peer // node_size != rank // node_size)
    return off_node / (world * (sp - 1))


def _buffer_bytes(sp: SpInputs, grad_accum: int, value_bytes: float) -> float:
    """What a rank's all-to-alls split among its SP group per optimizer step: its tokens' q, k, v and output per
    layer, forward and backward, every micro-step."""
    kv = sp.kv_hidden or sp.hidden
    return ((sp.seq_len // sp.sp) * (2 * sp.hidden + 2 * kv) * value_bytes * sp.layers * PASSES * grad_accum
            * sp.sequences)


def all_to_all_bytes(sp: SpInputs, world: int, node_size: int, grad_accum: int, value_bytes: float) -> dict:
    """Bytes a rank sends in Ulysses' all-to-alls per optimizer step, intra- and inter-node."""
    sent = _buffer_bytes(sp, grad_accum, value_bytes) * (sp.sp - 1) / sp.sp
    inter = inter_node_share(sp.sp, world, node_size)
    return {"intra_node": sent * (1 - inter), "inter_node": sent * inter}


def all_to_all_collectives(sp: SpInputs, world: int, grad_accum: int, value_bytes: float) -> list:
    """The same all-to-alls as `formulas.links` collectives: over each group of ``sp`` consecutive ranks, each
    member's buffer holding what it splits among the group."""
    groups = tuple(tuple(range(start, start + sp.sp)) for start in range(0, world, sp.sp))
    return [Collective("all_to_all", groups, _buffer_bytes(sp, grad_accum, value_bytes), 1, "sp_all_to_all")]


def describe(sp: SpInputs, world: int, node_size: int) -> str:
    share = inter_node_share(sp.sp, world, node_size)
    where = ("every SP group inside a node" if share == 0 else
             f"SP groups span nodes: {share:.0%} of each rank's all-to-all bytes cross nodes")
    return (f"Ulysses sequence parallelism sp={sp.sp}, {sp.seq_len} tokens per sequence ({sp.seq_len // sp.sp} per "
            f"rank), {sp.layers} layers of hidden {sp.hidden}" + (f" (k, v {sp.kv_hidden})" if sp.kv_hidden else "")
            + f": {where}; gradients on the wire in {sp.grad_comm_bytes}-byte values")
