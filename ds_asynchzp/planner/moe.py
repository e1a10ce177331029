"""Planning a mixture-of-experts model under AutoEP: dense parameters, routed experts and tokens, apart.

AutoEP spreads the E_total routed-expert parameters over `ep` ranks (each holds E_total / ep of them) and
partitions each rank's experts over its expert-data-parallel (EDP) group: the N / ep ranks that hold the same
experts, one every `ep` ranks, so `G_e = G / ep` of them share a node (1 when `ep` is at least the node
size). Per optimizer step, per rank:

* dense: the arm's formula (`planner.arm_formulas.arm_bytes`) over the dense parameters, Psi - E_total;
* expert: the same formula over the rank's experts, E_total / ep, with the EDP group as the world: stock ZeRO-3
  gathers and reduces them over the whole EDP group every micro-step; AsyncHZP lays them out with
  `layout.expert_layout` (what the engine builds), so their per-micro-step flows stay inside the node;
* tokens: the token all-to-all, the same for every arm: per micro-step a dispatch and a combine in forward, and
  their gradients in backward, each of `tokens * top_k * hidden` values in the parameter dtype, of which a rank
  sends (ep - 1) / ep to the other members of its expert-parallel group (balanced routing assumed: the real
  split follows the router). Inter-node when the expert-parallel group spans nodes (`ep` > G).

DeepSpeed 0.19.8 refuses ZeRO++ hpZ together with AutoEP, so the hpz and zeropp arms are not planned for MoE.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..formulas import sizing, step_collectives, traffic
from ..formulas.links import Collective
from ..layout import HierarchicalLayout, expert_layout, expert_members_per_node

TOKEN_PASSES = 4          # dispatch and combine, forward and backward
_HPZ_REFUSED = "DeepSpeed 0.19.8 refuses ZeRO++ hpZ (zero_hpz_partition_size > 1) together with AutoEP's experts"
UNSUPPORTED_ARMS = {"hpz": _HPZ_REFUSED, "zeropp": _HPZ_REFUSED}


@dataclass(frozen=True)
class MoeInputs:
    expert_params: int     # routed-expert parameters of the whole model, every expert counted
    ep_size: int           # AutoEP's expert-parallel size
    tokens: int = 0        # tokens per rank per micro-step
    hidden: int = 0        # hidden size (values per token)
    top_k: int = 1         # experts per token


def check(moe: MoeInputs, num_params: int, world: int, node_size: int) -> None:
    if not 0 < moe.expert_params < num_params:
        raise ValueError(f"expert parameters ({moe.expert_params}) must be between 0 and all parameters "
                         f"({num_params})")
    if moe.ep_size < 1 or world % moe.ep_size:
        raise ValueError(f"ep size {moe.ep_size} must divide the world size {world}")
    if expert_members_per_node(world, node_size, moe.ep_size) is None:
        raise ValueError(f"ep size {moe.ep_size} must divide the node size {node_size} or be at least the node "
                         "size (async_hzp needs the same number of an expert group's ranks on every node)")


def expert_world(moe: MoeInputs, world: int, node_size: int) -> tuple[int, int]:
    """(E: ranks of an EDP group, G_e: of them on one node)."""
    return world // moe.ep_size, expert_members_per_node(world, node_size, moe.ep_size)


def token_bytes(moe: MoeInputs, world: int, node_size: int, grad_accum: int, value_bytes: float) -> dict:
    ep = moe.ep_size
    sent = grad_accum * TOKEN_PASSES * moe.tokens * moe.top_k * moe.hidden * value_bytes * (ep - 1) / ep
    inter = world > node_size and ep > node_size
    return {"intra_node": 0.0 if inter else sent, "inter_node": sent if inter else 0.0}


def expert_bytes(arm: str, moe: MoeInputs, world: int, node_size: int, grad_accum: int, dtype_bytes: float,
                 dense_layout: HierarchicalLayout, quantization_of) -> dict | None:
    """Bytes of the rank's experts under `arm`, or None where DeepSpeed cannot run the arm with AutoEP.
    `quantization_of(layout)` gives an asynchzp arm's quantization plan for the experts' layout."""
    if arm in UNSUPPORTED_ARMS:
        return None
    layout, t = _expert_inputs(moe, world, node_size, grad_accum, dtype_bytes, dense_layout)
    if arm == "zero3":
        return traffic.zero3_bytes(t)
    return traffic.asynchzp_bytes(t, layout.param_shard_size, layout.grad_shard_size, t.world,
                                  quantization_of(layout))


def _expert_inputs(moe: MoeInputs, world: int, node_size: int, grad_accum: int, dtype_bytes: float,
                   dense_layout: HierarchicalLayout) -> tuple:
    """The experts' layout over their EDP group, and their traffic inputs with that group as the world."""
    members, per_node = expert_world(moe, world, node_size)
    padded = sizing.padded_num_params([moe.expert_params // moe.ep_size], members)
    t = traffic.TrafficInputs(world=members, node_size=per_node, grad_accum=grad_accum, gathered_elements=padded,
                              reduced_elements=padded, trainable_elements=padded, param_bytes=dtype_bytes,
                              grad_comm_bytes=dtype_bytes)
    return expert_layout(members, per_node, dense_layout), t


def ep_groups(world: int, ep: int) -> tuple:
    """AutoEP's expert-parallel groups: ``ep`` consecutive ranks each."""
    return tuple(tuple(range(start, start + ep)) for start in range(0, world, ep))


def token_collectives(moe: MoeInputs, world: int, grad_accum: int, value_bytes: float) -> list:
    """The token all-to-alls of a step over the expert-parallel groups (`token_bytes` per rank)."""
    size = grad_accum * TOKEN_PASSES * moe.tokens * moe.top_k * moe.hidden * value_bytes
    return [Collective("all_to_all", ep_groups(world, moe.ep_size), size, 1, "tokens")]


def expert_collectives(arm: str, moe: MoeInputs, world: int, node_size: int, grad_accum: int, dtype_bytes: float,
                       dense_layout: HierarchicalLayout, quantization_of) -> list | None:
    """The collectives of `expert_bytes` on global ranks: member i of the expert-data-parallel group of expert
    slot e is rank e + i*ep."""
    if arm in UNSUPPORTED_ARMS:
        return None
    layout, t = _expert_inputs(moe, world, node_size, grad_accum, dtype_bytes, dense_layout)
    if arm == "zero3":
        sub = step_collectives.zero3(t)
    else:
        sub = step_collectives.asynchzp(t, layout.param_shard_size, layout.grad_shard_size, t.world,
                                        quantization_of(layout))
    ep = moe.ep_size
    return step_collectives.remapped(sub, [lambda i, e=e: e + i * ep for e in range(ep)])


def expert_memory(arm: str, moe: MoeInputs, world: int, node_size: int, dense_layout: HierarchicalLayout,
                  param_bytes: int, grad_accum_bytes: int) -> dict | None:
    if arm in UNSUPPORTED_ARMS:
        return None
    members, per_node = expert_world(moe, world, node_size)
    local = sizing.padded_num_params([moe.expert_params // moe.ep_size], members)
    if arm == "zero3":
        return sizing.model_state_bytes_per_rank(local, members, members, members, members, param_bytes,
                                                 grad_accum_bytes)
    layout = expert_layout(members, per_node, dense_layout)
    return sizing.model_state_bytes_per_rank(local, members, layout.param_shard_size, layout.grad_shard_size,
                                             members, param_bytes, grad_accum_bytes)


def by_family(dense: dict, expert: dict, tokens: dict) -> dict:
    """An arm's bytes per step split into dense, expert and tokens (intra- and inter-node each)."""
    return {name: {w: part[w] for w in ("intra_node", "inter_node")}
            for name, part in (("dense", dense), ("expert", expert), ("tokens", tokens))}


__all__ = ["MoeInputs", "TOKEN_PASSES", "UNSUPPORTED_ARMS", "by_family", "check", "ep_groups", "expert_bytes",
           "expert_collectives", "expert_memory", "expert_world", "token_bytes", "token_collectives"]
