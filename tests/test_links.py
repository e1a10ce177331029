"""Bytes per physical link (`formulas.links`): NCCL's rings, trees and PXN all-to-alls over nodes of G ranks with K
NICs, gloo's rank-order rings, and every arm's collectives (`formulas.step_collectives`) placed on them.

The figures by hand follow NCCL's ring structure (a flat ring per channel: node -> chain of the node's members ->
next node; channels spread over the NICs) and the worked example of 8B parameters on 2 nodes of 8."""

from __future__ import annotations

import json
import random

import pytest

from ds_asynchzp.formulas import links, sizing, step_collectives
from ds_asynchzp.planner import arm_formulas, cluster_plan
from ds_asynchzp.planner import cli as plan_cli

GB = 1e9


def _load(collectives, world, node, nics=None, library="nccl", allreduce="ring"):
    return links.link_load(collectives, links.Topology(world, node, nics, library, allreduce))


def _world_collective(op, world, size):
    return [links.Collective(op, (tuple(range(world)),), size)]


@pytest.mark.parametrize("nodes,expected", [(2, 15 / 128), (4, 31 / 256), (16, 127 / 1024)])
def test_ring_all_gather_per_nic_is_a_ranks_sends_over_the_nics(nodes, expected):
    """A world all-gather of S on nodes of 8 with 8 NICs: a node puts (N-1)/N * S on the wire, 1/8 per NIC; each rank
    sends 7/8 of an edge over NVLink. With one NIC the node's whole egress is on it."""
    world, s = 8 * nodes, 1e9
    load = _load(_world_collective("all_gather", world, s), world, 8)
    assert load.busiest_nic == pytest.approx(expected * s) and load.mean_nic == pytest.approx(expected * s)
    assert load.busiest_fabric == pytest.approx(7 / 8 * (world - 1) / world * s)
    one = _load(_world_collective("all_gather", world, s), world, 8, nics=1)
    assert one.busiest_nic == pytest.approx((world - 1) / world * s) == pytest.approx(8 * expected * s)
    # An all-reduce is two passes; a group inside one node loads no NIC.
    assert _load(_world_collective("all_reduce", world, s), world, 8).busiest_nic == pytest.approx(2 * expected * s)
    inside = _load([links.Collective("all_gather", (tuple(range(8)),), s)], world, 8)
    assert inside.busiest_nic == 0 and inside.busiest_fabric == pytest.approx(7 / 8 * s)


def test_tree_all_reduce_on_two_and_more_nodes():
    """NCCL's double binary tree: on 2 nodes each sends S (one root, one child per tree); on more, a node that is
    inner in one tree sends up to 2S (exactly 2S from 4 nodes on), and the mean is 2(n-1)/n * S, the ring's."""
    s = 1e9
    for nodes in (2, 3, 4, 5, 8):
        group = (tuple(range(0, nodes * 4, 4)),)   # one rank per node
        tree = _load([links.Collective("all_reduce", group, s)], nodes * 4, 4, allreduce="tree")
        ring = _load([links.Collective("all_reduce", group, s)], nodes * 4, 4)
        per_node = [sum(n) for n in tree.nic]
        assert sum(per_node) / nodes == pytest.approx(2 * (nodes - 1) / nodes * s)
        assert sum(map(sum, ring.nic)) == pytest.approx(sum(per_node))
        assert max(per_node) <= 2 * s * (1 + 1e-12)
        if nodes == 2 or nodes >= 4:
            assert max(per_node) == pytest.approx(s if nodes == 2 else 2 * s)


def _pairwise_reference(topology, group, per_peer):
    """Message by message: out of the NIC on the receiver's rail; under NCCL plus a fabric hop when that NIC is not
    the sender's."""
    nic = [[0.0] * topology.nics for _ in range(topology.nodes)]
    fabric = [0.0] * topology.world
    for r in group:
        for p in group:
            if p == r:
                continue
            if topology.node_of(p) == topology.node_of(r):
                fabric[r] += per_peer
            elif topology.library == "gloo":
                nic[topology.node_of(r)][topology.nic_of(p)] += per_peer
            else:
                nic[topology.node_of(r)][topology.nic_of(p)] += per_peer
                fabric[r] += per_peer if topology.nic_of(p) != topology.nic_of(r) else 0.0
    return nic, fabric


def _pairwise_matches_reference(seed_count=30):
    rng = random.Random(7)
    for _ in range(seed_count):
        node = rng.choice([2, 4, 8])
        world = node * rng.choice([2, 3, 4])
        topology = links.Topology(world, node, rng.choice([n for n in (1, 2, 4, 8) if n <= node]),
                                  rng.choice(["nccl", "gloo"]))
        group = tuple(sorted(rng.sample(range(world), rng.randint(2, world))))
        load = links.link_load([links.Collective("all_to_all", (group,), 1000.0)], topology)
        nic, fabric = _pairwise_reference(topology, group, 1000.0 / len(group))
        flat = [x for node in load.nic for x in node]
        if flat != pytest.approx([x for node in nic for x in node]) or load.fabric != pytest.approx(fabric):
            return False
    return True


def test_all_to_all_follows_pxn_and_the_reference_catches_a_planted_fault(monkeypatch):
    assert _pairwise_matches_reference()
    # Same-rail peers: no fabric hop; a cross-rail message lands on the receiver's rail.
    t = links.Topology(8, 4)
    load = links.link_load([links.Collective("all_to_all", ((0, 5),), 2.0)], t)
    assert load.nic[0] == [0, 1.0, 0, 0] and load.nic[1] == [1.0, 0, 0, 0] and load.fabric[0] == load.fabric[5] == 1.0
    # Planted: messages out of the sender's own NIC (no PXN, no routing by the receiver's rail).
    def own_nic(load, group, per_peer):
        t = load.topology
        for r in group:
            for p in group:
                if p != r:
                    if t.node_of(p) == t.node_of(r):
                        load.fabric[r] += per_peer
                    else:
                        load.nic[t.node_of(r)][t.nic_of(r)] += per_peer

    monkeypatch.setattr(links, "_pairwise", own_nic)
    assert not _pairwise_matches_reference()


def test_the_worked_example_8b_on_two_nodes_of_eight():
    """8B bf16, 2 nodes of 8, 8 micro-steps: stock ZeRO-3 puts 45 GB on each NIC and 315 GB on each rank's NVLink;
    AsyncHZP (d_p = d_g = 8, d_o = 16) 2 GB per NIC (1 GB gradient exchange + 1 GB refresh) and 336 GB on NVLink.
    With one shared NIC per node, the NIC carries the node's 360 GB and 16 GB."""
    t = arm_formulas.traffic_inputs(8 * 10**9, 16, 8, 8, "bf16")
    zero3 = _load(step_collectives.zero3(t), 16, 8)
    ours = _load(step_collectives.asynchzp(t, 8, 8, 16), 16, 8)
    assert zero3.busiest_nic == pytest.approx(45 * GB) and zero3.busiest_fabric == pytest.approx(315 * GB)
    assert ours.busiest_nic == pytest.approx(2 * GB) and ours.busiest_fabric == pytest.approx(336 * GB)
    assert _load(step_collectives.zero3(t), 16, 8, nics=1).busiest_nic == pytest.approx(360 * GB)
    assert _load(step_collectives.asynchzp(t, 8, 8, 16), 16, 8, nics=1).busiest_nic == pytest.approx(16 * GB)


@pytest.mark.parametrize("references", [0, 2])
@pytest.mark.parametrize("arm,layout", [("zero3", None), ("hpz", None), ("asynchzp", (4, 4, 16)),
                                        ("asynchzp", (2, 4, 8)), ("asynchzp", (4, 8, 8)), ("asynchzp", (1, 4, 16))])
def test_collectives_carry_the_ring_formulas_bytes(arm, layout, references):
    """On NCCL's rings every byte a rank sends lands on exactly one link (a NIC or its fabric): the links of a step
    sum to the world times the per-rank formulas of `formulas.traffic`, reference models' forwards included.
    (The boundary exchange's groups hold one rank per node, on one rail, so no PXN hop adds fabric bytes.)"""
    world, node = 16, 4
    t = arm_formulas.traffic_inputs(10**6, world, node, 3, "bf16", multiple=layout[2] if layout else None,
                                    reference_models=references)
    sent = (arm_formulas.arm_bytes(arm, t, *layout) if layout else arm_formulas.arm_bytes(arm, t, node, node))
    load = _load(step_collectives.arm_collectives(arm, t, *(layout or ())), world, node)
    assert sum(map(sum, load.nic)) + sum(load.fabric) == pytest.approx(world * (sent["intra_node"] + sent["inter_node"]))


def test_gloo_on_one_link_per_node_is_the_emulators_figure():
    """`step_collectives.link_bytes` (what the emulated cluster's node links carry) is this model with gloo's rings
    on one link per node; on one link per rank (rails) the same bytes leave each rank's own link."""
    t = arm_formulas.traffic_inputs(10**6, 8, 4, 2, "bf16")
    for arm, lay in (("zero3", ()), ("asynchzp", (2, 4, 8)), ("asynchzp", (4, 8, 8))):
        collectives = step_collectives.arm_collectives(arm, t, *lay)
        shared = _load(collectives, 8, 4, nics=1, library="gloo")
        rails = _load(collectives, 8, 4, library="gloo")
        per_rank = step_collectives.link_bytes(arm, t, *lay)
        assert sum(map(sum, shared.nic)) / 8 == pytest.approx(per_rank)
        assert sum(map(sum, rails.nic)) == pytest.approx(sum(map(sum, shared.nic)))


def test_step_seconds_take_each_collective_at_its_busiest_link():
    t = arm_formulas.traffic_inputs(10**9, 16, 8, 8, "bf16")
    topology = links.Topology(16, 8)
    collectives = step_collectives.zero3(t)
    seconds = links.step_seconds(collectives, topology, 25e9, 100e9)
    # Gathers and reduce-scatters over the world: each edge 15/16 S; 1/8 of it per NIC, 7/8 per rank on NVLink.
    per_pass = 15 / 16 * 2e9
    expected = 24 * max(per_pass / 8 / 25e9, 7 / 8 * per_pass / 100e9)
    assert seconds["total"] == pytest.approx(expected)
    assert seconds["total"] >= max(seconds["nic"], seconds["fabric"])


def test_bad_topologies_are_refused():
    with pytest.raises(ValueError, match="nics_per_node 9"):
        links.Topology(16, 8, 9)
    with pytest.raises(ValueError, match="divide the world"):
        links.Topology(12, 8)
    with pytest.raises(ValueError, match="library"):
        links.Topology(16, 8, library="mpi")
    with pytest.raises(ValueError, match="unknown collective"):
        links.Collective("broadcast", ((0, 1),), 1.0)


@pytest.mark.parametrize("params", ["8B", "70B"])
@pytest.mark.parametrize("nodes", [2, 4])
def test_planner_figures_are_per_nic_on_nodes_of_eight(params, nodes, capsys):
    """The planner's table for 8B and 70B on 2 and 4 nodes of 8: bytes per NIC and per rank's NVLink, one NIC per
    rank by default, and the whole node's egress on one NIC with --nics-per-node 1."""
    world = 8 * nodes
    argv = ["--params", params, "--world", str(world), "--node-size", "8", "--grad-accum", "8",
            "--param-shard-size", "8", "--optimizer-shard-size", str(world), "--json"]
    assert plan_cli.main(argv) == 0
    rails = json.loads(capsys.readouterr().out)
    assert plan_cli.main([*argv, "--nics-per-node", "1"]) == 0
    shared = json.loads(capsys.readouterr().out)
    psi = rails["inputs"]["padded_params"]
    s = 2 * psi
    zero3 = rails["arms"]["zero3"]["links"]
    assert zero3["nic_busiest"] == pytest.approx(24 * (world - 1) / world * s / 8)
    assert shared["arms"]["zero3"]["links"]["nic_busiest"] == pytest.approx(24 * (world - 1) / world * s)
    # AsyncHZP (8, 8, world): the gradient exchange and the refresh of a 1/8 slice between one rank per node.
    ours = rails["arms"]["asynchzp"]["links"]
    assert ours["nic_busiest"] == pytest.approx(2 * s / 8 * (nodes - 1) / nodes)
    assert shared["arms"]["asynchzp"]["links"]["nic_busiest"] == pytest.approx(8 * ours["nic_busiest"])
    # The per-rank ring model overstated the world rings' NIC bytes; AsyncHZP's own cross-node groups hold one rank
    # per node, each on its rail, so for them the two agree.
    for arm in ("zero3", "hpz", "zeropp"):
        assert rails["arms"][arm]["links"]["nic_busiest"] < rails["arms"][arm]["bytes_per_step"]["inter_node"]
    assert ours["nic_busiest"] == pytest.approx(rails["arms"]["asynchzp"]["bytes_per_step"]["inter_node"])
    assert rails["inputs"]["nics_per_node"] == 8 and shared["inputs"]["nics_per_node"] == 1
    # "auto" places its bytes on the same topology as the table (one NIC per node changes its inputs).
    assert cluster_plan.plan(sizing.padded_num_params([psi], world), world, 8, 8, nics_per_node=1,
                             device_memory=80 * 2**30)["inputs"]["nics_per_node"] == 1


def test_the_plan_table_names_the_links(capsys):
    assert plan_cli.main(["--params", "8B", "--world", "16", "--node-size", "8", "--grad-accum", "8"]) == 0
    out = capsys.readouterr().out
    assert "GB/NIC" in out and "NVLink GB/rank" in out and "one NIC per rank (the default" in out
    assert "each collective at its busiest link's pace" in out
