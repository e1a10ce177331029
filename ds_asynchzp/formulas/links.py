"""What each physical link carries: bytes leaving every NIC of every node, and bytes every rank sends over its
node's fabric (NVLink, or loopback on the emulated cluster), for a list of collectives.

The per-rank ring model (`formulas.traffic`) counts what a rank sends; a network link carries only the part of it
that crosses a node boundary, and how that part spreads over the NICs depends on the collective library and the
node's NICs. This module places every byte on a link. Derivation and sources: docs/ARCHITECTURE.md, "Traffic".

A :class:`Topology` declares the cluster: N ranks, nodes of G ranks laid out node by node (rank r on node
r // G, local index r % G), K NICs per node (1 ... G; default G, one per rank: the rail-optimised nodes GPU
clusters are built with). Rank of local index i sits next to NIC i*K // G. The library decides the algorithms:

``nccl`` (the planner and ``"auto"``; large messages, every channel in use)
    Ring all-gather, reduce-scatter and all-reduce. NCCL groups a communicator's ranks by node itself and builds
    flat rings of the form node -> chain of the node's members -> next node, one per channel, channels spread
    evenly over the NICs next to the members. Every ring edge carries (k-1)/k of the collective's S for an
    all-gather or reduce-scatter (k members), twice that for an all-reduce. So each node of a group spanning
    s >= 2 nodes puts one edge's bytes on the network, split evenly over its members' NICs, and each member sends
    (m-1)/m of an edge over the fabric (m members on its node; the chain's exit rotates with the channel). A group
    inside one node: every member sends one edge over the fabric.
    With ``allreduce="tree"`` an all-reduce over s >= 2 nodes runs on NCCL's double binary tree of the nodes
    (two trees, S/2 each; a node sends S/2 to its parent and S/2 to each child per tree; inside the node a
    chain, 2S(m-1)/m per member): per node 2S at most, S on two nodes, 2(s-1)/s * S on average, the same mean as
    the ring. The default is the ring: NCCL chooses by its cost model, and for the multi-megabyte buffers of a
    step on nodes of several NICs the ring is what it picks.
    All-to-all (pairwise exchange: each member sends S/k to each other member): to a member of the same node
    over the fabric; to a member of local index j on another node out of the sender node's NIC next to local
    index j (PXN, NCCL's default since 2.12: the data first hops over the fabric to the GPU on that rail when
    the sender is not next to that NIC).

``gloo`` (the emulated cluster)
    Every collective is a ring in the group's rank order; gloo's reduce-scatter is an all-reduce underneath
    (two ring passes). A ring edge or an all-to-all message to another node leaves the sender's node through the
    NIC next to the receiver's local index: the emulated rails are one network per rail and the kernel routes
    by the receiver's address (`netem.topology`); with one link per node it is that link. Ring edges and
    messages inside a node go over the fabric.

Only bytes leaving a link are counted (each NIC receives as much for the symmetric collectives here, except
cross-rail messages, which arrive on the receiver's rail). Pure arithmetic: no torch, no DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
LIBRARIES = ("nccl", "gloo")
ALLREDUCE_ALGORITHMS = ("ring", "tree")
_RING_PASSES = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}


@dataclass(frozen=True)
class Topology:
    """A cluster of ``world`` ranks in nodes of ``node_size``, ``nics_per_node`` NICs each (None: one per rank)."""
    world: int
    node_size: int
    nics_per_node: int | None = None
    library: str = "nccl"
    allreduce: str = "ring"

    def __post_init__(self) -> None:
        if self.world < 1 or self.node_size < 1 or self.world % self.node_size:
            raise ValueError(f"node size {self.node_size} must be >= 1 and divide the world {self.world}")
        if not 1 <= self.nics <= self.node_size:
            raise ValueError(f"nics_per_node {self.nics_per_node} must be between 1 and the node size "
                             f"{self.node_size}")
        if self.library not in LIBRARIES:
            raise ValueError(f"library {self.library!r} must be one of {LIBRARIES}")
        if self.allreduce not in ALLREDUCE_ALGORITHMS:
            raise ValueError(f"allreduce {self.allreduce!r} must be one of {ALLREDUCE_ALGORITHMS}")

    @property
    def nics(self) -> int:
        return self.node_size if self.nics_per_node is None else self.nics_per_node

    @property
    def nodes(self) -> int:
        return self.world // self.node_size

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def nic_of_local(self, local: int) -> int:
        return local * self.nics // self.node_size

    def nic_of(self, rank: int) -> int:
        return self.nic_of_local(rank % self.node_size)

    def describe(self) -> str:
        nics = ("one NIC per rank" if self.nics == self.node_size else
                f"{self.nics} NIC{'s' if self.nics > 1 else ''} per node shared by its {self.node_size} ranks")
        return (f"{self.nodes} node{'s' if self.nodes > 1 else ''} of {self.node_size} ranks, {nics}, "
                f"{self.library} {'rings' if self.library == 'gloo' else 'rings, all-reduce ' + self.allreduce}")


@dataclass(frozen=True)
class Collective:
    """``count`` runs of one collective over each of ``groups`` (tuples of global ranks, in the group's order).

    ``size`` is S in bytes: an all-gather's output, a reduce-scatter's input, an all-reduce's buffer, or the
    buffer each member of an all-to-all splits among the members. ``flow`` names it in a breakdown."""
    op: str
    groups: tuple
    size: float
    count: float = 1.0
    flow: str = ""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown collective {self.op!r}; one of {OPS}")


@dataclass
class LinkLoad:
    """Bytes leaving each NIC (``nic[node][k]``) and sent by each rank over its node's fabric (``fabric[rank]``)."""
    topology: Topology
    nic: list = field(default_factory=list)
    fabric: list = field(default_factory=list)

    @classmethod
    def empty(cls, topology: Topology) -> "LinkLoad":
        return cls(topology, [[0.0] * topology.nics for _ in range(topology.nodes)], [0.0] * topology.world)

    @property
    def busiest_nic(self) -> float:
        return max(max(node) for node in self.nic)

    @property
    def mean_nic(self) -> float:
        return sum(map(sum, self.nic)) / (self.topology.nodes * self.topology.nics)

    @property
    def busiest_node(self) -> float:
        """Bytes leaving the busiest node through all its NICs."""
        return max(map(sum, self.nic))

    @property
    def busiest_fabric(self) -> float:
        return max(self.fabric)

    @property
    def mean_fabric(self) -> float:
        return sum(self.fabric) / self.topology.world

    def summary(self) -> dict:
        return {"nic_busiest": self.busiest_nic, "nic_mean": self.mean_nic, "node_busiest": self.busiest_node,
                "fabric_busiest": self.busiest_fabric, "fabric_mean": self.mean_fabric}



def _by_node(topology: Topology, group) -> dict:
    nodes: dict = {}
    for rank in group:
        nodes.setdefault(topology.node_of(rank), []).append(rank)
    return nodes


def _ring(load: LinkLoad, group, edge: float) -> None:
    t = load.topology
    if t.library == "gloo":   # a ring in the group's rank order
        for i, rank in enumerate(group):
            successor = group[(i + 1) % len(group)]
            if t.node_of(successor) == t.node_of(rank):
                load.fabric[rank] += edge
            else:
                load.nic[t.node_of(rank)][t.nic_of(successor)] += edge
        return
    nodes = _by_node(t, group)
    if len(nodes) == 1:
        for rank in group:
            load.fabric[rank] += edge
        return
    for node, members in nodes.items():
        for rank in members:
            load.fabric[rank] += edge * (len(members) - 1) / len(members)
        nics = sorted({t.nic_of(rank) for rank in members})
        for nic in nics:
            load.nic[node][nic] += edge / len(nics)


def _tree_parents(s: int) -> list:
    """NCCL's binary tree over s nodes: node 0 is the root; otherwise clear the lowest set bit and set the next
    one up, falling back to only clearing it where that leaves the range."""
    parents = [-1] * s
    for r in range(1, s):
        bit = r & -r
        up = (r ^ bit) | (bit << 1)
        parents[r] = up if up < s else r ^ bit
    return parents


def _tree_sends(s: int) -> list:
    """Per node, in units of S: what it sends in an all-reduce on the two trees (S/2 each; the second tree is
    the first mirrored for even s, shifted by one for odd s): S/2 to its parent and to each child, per tree."""
    parents = _tree_parents(s)
    children = [0] * s
    for r, p in enumerate(parents):
        if p >= 0:
            children[p] += 1
    first = [0.5 * ((parents[r] >= 0) + children[r]) for r in range(s)]
    second = [first[s - 1 - r] if s % 2 == 0 else first[(r - 1) % s] for r in range(s)]
    return [a + b for a, b in zip(first, second)]


def _tree(load: LinkLoad, group, size: float) -> None:
    t = load.topology
    nodes = _by_node(t, group)
    order = sorted(nodes)
    sends = _tree_sends(len(order))
    for node, factor in zip(order, sends):
        members = nodes[node]
        for rank in members:
            load.fabric[rank] += 2 * size * (len(members) - 1) / len(members)
        nics = sorted({t.nic_of(rank) for rank in members})
        for nic in nics:
            load.nic[node][nic] += factor * size / len(nics)


def _pairwise(load: LinkLoad, group, per_peer: float) -> None:
    t = load.topology
    # Members counted by node and by the NIC next to them, so each sender costs O(NICs), not O(members).
    on_node: dict = {}
    by_nic = [0] * t.nics
    for rank in group:
        on_node.setdefault(t.node_of(rank), [0] * t.nics)[t.nic_of(rank)] += 1
        by_nic[t.nic_of(rank)] += 1
    for rank in group:
        node, own_nic = t.node_of(rank), t.nic_of(rank)
        local = on_node[node]
        load.fabric[rank] += (sum(local) - 1) * per_peer
        remote = [total - here for total, here in zip(by_nic, local)]
        for nic, count in enumerate(remote):   # out of the NIC on the peer's rail; under NCCL (PXN) after a
            if count:                          # fabric hop to the GPU next to it, under gloo inside the kernel
                load.nic[node][nic] += count * per_peer
                if nic != own_nic and t.library == "nccl":
                    load.fabric[rank] += count * per_peer


def add_collective(load: LinkLoad, collective: Collective) -> None:
    t = load.topology
    op = collective.op
    if t.library == "gloo" and op == "reduce_scatter":
        op = "all_reduce"    # gloo's reduce-scatter runs a whole all-reduce
    for group in collective.groups:
        k = len(group)
        if k < 2 or not collective.size or not collective.count:
            continue
        if op == "all_to_all":
            _pairwise(load, group, collective.count * collective.size / k)
        elif (op == "all_reduce" and t.library == "nccl" and t.allreduce == "tree"
              and len(_by_node(t, group)) > 1):
            _tree(load, group, collective.count * collective.size)
        else:
            _ring(load, group, collective.count * _RING_PASSES[op] * (k - 1) / k * collective.size)


def link_load(collectives, topology: Topology) -> LinkLoad:
    load = LinkLoad.empty(topology)
    for collective in collectives:
        add_collective(load, collective)
    return load


def load_and_seconds(collectives, topology: Topology, nic_bw_bytes_s: float,
                     fabric_bw_bytes_s: float) -> tuple[LinkLoad, dict]:
    """The step's `LinkLoad` and its seconds (`step_seconds`), in one pass over the collectives: each is placed
    on its own load (for its busiest link's time) and then added to the step's."""
    whole, total = LinkLoad.empty(topology), 0.0
    for collective in collectives:
        one = LinkLoad.empty(topology)
        add_collective(one, collective)
        total += max(one.busiest_nic / nic_bw_bytes_s, one.busiest_fabric / fabric_bw_bytes_s)
        for node, nics in zip(whole.nic, one.nic):
            for k, value in enumerate(nics):
                node[k] += value
        whole.fabric = [a + b for a, b in zip(whole.fabric, one.fabric)]
    return whole, {"nic": whole.busiest_nic / nic_bw_bytes_s, "fabric": whole.busiest_fabric / fabric_bw_bytes_s,
                   "total": total}


def step_seconds(collectives, topology: Topology, nic_bw_bytes_s: float, fabric_bw_bytes_s: float) -> dict:
    """Seconds of a step's collectives: each takes the time of its own busiest link (a ring runs at the pace of
    its slowest edge), and they run one after another, without overlap between them or with compute, so
    ``total`` bounds the step's communication from above. ``nic`` and ``fabric`` are the whole step's bytes on
    the busiest NIC and the busiest rank's fabric at their bandwidths: no schedule is faster than the larger of
    the two."""
    return load_and_seconds(collectives, topology, nic_bw_bytes_s, fabric_bw_bytes_s)[1]
