"""Plan an emulated multi-node cluster: namespace names, addresses and the exact commands to build it.

Nothing here needs root or touches the system; :mod:`ds_asynchzp.netem.cluster` executes the plan.

Layout (every device name is the same in every node, so ``GLOO_SOCKET_IFNAME=eth0`` works for all ranks):

* node i is a network namespace ``<prefix>n<i>`` with one interface ``eth0`` holding 10.200.0.(i+1)/24;
* 2 nodes, veth mode: one veth pair whose two ends are both called ``eth0``;
* more nodes, veth mode: each node's ``eth0`` is a veth to port ``p<i>`` of bridge ``br0`` in the switch
  namespace ``<prefix>sw``; both directions are shaped, so several senders to one node share its downlink;
* tun mode (a one-way delay was requested; the kernel has no netem): ``eth0`` is a TUN device opened by the
  relay process (:mod:`ds_asynchzp.netem.relay`), which forwards packets after the delay.

Two topologies (``links_per_node``):

* ``shared`` (1): the above, one link per node that all its ranks share, as on cloud instances with one NIC;
* ``rails`` (the ranks per node): one link per rank, as on GPU nodes built with one NIC per GPU. Rail ``r`` is its
  own network: device ``eth<r>`` in every node, address 10.200.r.(i+1)/24, its own veth pair (two nodes) or bridge
  ``br<r>`` (more), every device shaped. Local rank ``r`` binds gloo to ``eth<r>``. The kernel sends to an address
  of rail ``j`` through the node's ``eth<j>``, so bytes for a rank of local index ``j`` on another node leave
  through the sender node's rail ``j`` and arrive on the receiver's rail ``j``: a rail-only fabric (no spine
  between the rails), where the hop between rails happens inside the node, as NCCL's PXN does over NVLink.
  Reverse-path filtering is off in the nodes, since a reply to another rail's address leaves on that rail.

Traffic between ranks of the same node targets the node's own address and is routed over ``lo`` by the kernel,
so it is never shaped and never counted on ``eth0``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

__all__ = ["EmulatedCluster", "NAMESPACE_PREFIX", "SUBNET", "parse_rate", "parse_delay_ms", "tbf_burst_bytes",
           "cpu_mask", "BW_FLAG", "DELAY_FLAG", "MTU_FLAG"]

# Every namespace this package creates starts with this, so leftovers can be found and nothing else is touched.
NAMESPACE_PREFIX = "ahzp"
SUBNET = "10.200.0.0/24"
DEVICE = "eth0"
BW_FLAG = "--inter-node-bw"
DELAY_FLAG = "--inter-node-delay"
MTU_FLAG = "--mtu"

# tbf's queue limit expressed as time; TCP small queues keep real queues far below it.
TBF_LATENCY = "50ms"
# A 1500-byte MTU caps veth goodput at 95.6 % of the rate; the relay wants 9000 to keep its packet rate low.
DEFAULT_VETH_MTU = 1500
DEFAULT_TUN_MTU = 9000
MIN_MTU, MAX_MTU = 576, 65535
MAX_NODES = 250  # 10.200.0.1 .. 10.200.0.250 in one /24
MAX_DELAY_MS = 10_000.0
TOPOLOGY_FLAG = "--topology"
TOPOLOGIES = ("shared", "rails")
RAILS_WITHOUT_DELAY = (f"{TOPOLOGY_FLAG} rails does not combine with {DELAY_FLAG} (the delay relay carries one link "
                       f"per node); use {TOPOLOGY_FLAG} shared for a delay")
MAX_RAILS = 64

# tc's unit names: "bit" units are bits per second, "bps" units are BYTES per second.
_RATE_UNITS = {
    "": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12,
}
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$")


UNLIMITED = "unlimited"


def parse_rate(text: str | int | float | None, flag: str = BW_FLAG) -> int | None:
    """Parse a tc-style rate ("200mbit", "1gbit", "500000kbit", plain bits/s) into bits per second; "unlimited"
    (or None) gives None: the nodes keep their namespaces and links, with no shaping (a baseline with the same
    network path and counters)."""
    if text is None or str(text).strip().lower() == UNLIMITED:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = _RATE_RE.match(str(text).lower())
        if not match or match.group(2) not in _RATE_UNITS:
            raise ValueError(f"{flag}: cannot parse rate {text!r}; use a number with a tc unit such as "
                             f"'200mbit', '1gbit' or '800kbit' (bits/s; 'mbps' means megaBYTES/s), or "
                             f"'{UNLIMITED}' for unshaped links")
        value, unit = float(match.group(1)), match.group(2)
    bits = int(round(value * _RATE_UNITS[unit]))
    # Below ~8 kbit/s tbf's bucket arithmetic and gloo's timeouts stop making sense.
    if bits < 8_000:
        raise ValueError(f"{flag}: rate {text!r} is {bits} bit/s; it must be at least 8kbit")
    if bits > 400 * 10**9:
        raise ValueError(f"{flag}: rate {text!r} is above 400gbit, which no emulated link can reach")
    return bits


def parse_delay_ms(value: str | int | float | None, flag: str = DELAY_FLAG) -> float | None:
    """Parse a one-way delay in milliseconds ("1", "2.5", "2.5ms"); None or 0 mean no added delay."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text.endswith("ms"):
        text = text[:-2].strip()
    try:
        delay = float(text)
    except ValueError:
        raise ValueError(f"{flag}: cannot parse delay {value!r}; give milliseconds such as '1' or '2.5'") from None
    if delay != delay or delay < 0:  # NaN or negative
        raise ValueError(f"{flag}: delay must be >= 0 ms, got {value!r}")
    if delay > MAX_DELAY_MS:
        raise ValueError(f"{flag}: delay {delay:g} ms is above the {MAX_DELAY_MS:g} ms limit")
    return delay or None


def tbf_burst_bytes(rate_bps: int, mtu: int) -> int:
    """Bucket size: 2 ms of traffic, but never below 4 packets or 32 KiB.

    A non-GSO packet larger than the bucket is dropped, and a bucket much smaller than 2 ms of traffic cost
    2-20 % of goodput because the tbf watchdog cannot refill it often enough."""
    return max(int(rate_bps * 0.002 / 8), 4 * mtu, 32 * 1024)


def cpu_mask(num_cpus: int) -> str:
    """Hex CPU mask covering CPUs 0..num_cpus-1 in sysfs format (32-bit groups separated by commas)."""
    if num_cpus < 1:
        raise ValueError(f"num_cpus must be >= 1, got {num_cpus}")
    bits = (1 << num_cpus) - 1
    groups = []
    while True:
        groups.append(bits & 0xFFFFFFFF)
        bits >>= 32
        if not bits:
            break
    return ",".join(f"{g:08x}" for g in reversed(groups))


def _default_prefix() -> str:
    return f"{NAMESPACE_PREFIX}{os.getpid()}"


@dataclass(frozen=True)
class EmulatedCluster:
    """Specification of one emulated cluster. Build it with :meth:`create` to get parsing and validation."""

    num_nodes: int
    rate_bps: int | None           # None: links not shaped
    delay_ms: float | None = None
    mtu: int = DEFAULT_VETH_MTU
    run_prefix: str = field(default_factory=_default_prefix)
    num_cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    links_per_node: int = 1        # 1: one link per node (shared); more: one per rank (rails)

    @classmethod
    def create(cls, num_nodes: int, inter_node_bw: str | int | float, delay_ms: str | float | None = None,
               mtu: int | None = None, run_prefix: str | None = None,
               num_cpus: int | None = None, links_per_node: int = 1) -> "EmulatedCluster":
        rate = parse_rate(inter_node_bw)
        delay = parse_delay_ms(delay_ms)
        if mtu is None:
            mtu = DEFAULT_TUN_MTU if delay is not None else DEFAULT_VETH_MTU
        spec = cls(num_nodes=num_nodes, rate_bps=rate, delay_ms=delay, mtu=int(mtu),
                   run_prefix=run_prefix or _default_prefix(), num_cpus=num_cpus or os.cpu_count() or 1,
                   links_per_node=int(links_per_node))
        spec.validate()
        return spec

    def validate(self) -> None:
        if not 2 <= self.num_nodes <= MAX_NODES:
            raise ValueError(f"an emulated cluster needs 2..{MAX_NODES} nodes, got {self.num_nodes}")
        if not MIN_MTU <= self.mtu <= MAX_MTU:
            raise ValueError(f"{MTU_FLAG}: MTU must be in {MIN_MTU}..{MAX_MTU}, got {self.mtu}")
        if not re.fullmatch(rf"{NAMESPACE_PREFIX}[A-Za-z0-9_]+", self.run_prefix):
            raise ValueError(f"run prefix must be '{NAMESPACE_PREFIX}' followed by letters, digits or '_', "
                             f"got {self.run_prefix!r}")
        if self.delay_ms is not None and self.delay_ms < 0:
            raise ValueError(f"{DELAY_FLAG}: delay must be >= 0 ms, got {self.delay_ms}")
        if not 1 <= self.links_per_node <= MAX_RAILS:
            raise ValueError(f"{TOPOLOGY_FLAG} rails: 1..{MAX_RAILS} links per node, got {self.links_per_node}")
        if self.links_per_node > 1 and self.delay_ms is not None:
            raise ValueError(RAILS_WITHOUT_DELAY)

    # ----- names and addresses -----------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """'veth' (rate only, kernel links) or 'tun' (rate plus delay through the userspace relay)."""
        return "tun" if self.delay_ms is not None else "veth"

    @property
    def node_namespaces(self) -> list[str]:
        return [f"{self.run_prefix}n{i}" for i in range(self.num_nodes)]

    @property
    def switch_namespace(self) -> str | None:
        """The bridge's namespace; only veth mode with more than two nodes needs one."""
        return f"{self.run_prefix}sw" if self.mode == "veth" and self.num_nodes > 2 else None

    @property
    def namespaces(self) -> list[str]:
        """Every namespace the plan creates, in creation order."""
        return self.node_namespaces + ([self.switch_namespace] if self.switch_namespace else [])

    @property
    def topology(self) -> str:
        return "rails" if self.links_per_node > 1 else "shared"

    @property
    def addresses(self) -> list[str]:
        """Each node's address on its first link (rail 0): the rendezvous address."""
        return [self.rail_address(i, 0) for i in range(self.num_nodes)]

    def rail_address(self, node: int, rail: int) -> str:
        return f"10.200.{rail}.{node + 1}"

    @property
    def device(self) -> str:
        return DEVICE

    @property
    def devices(self) -> list[str]:
        """The link devices of every node: ``eth0`` (shared), ``eth0`` .. ``eth<R-1>`` (rails)."""
        return [f"eth{r}" for r in range(self.links_per_node)]

    def _port(self, node: int, rail: int) -> str:
        return f"p{node}" if self.links_per_node == 1 else f"p{node}r{rail}"

    def _bridge(self, rail: int) -> str:
        return "br0" if self.links_per_node == 1 else f"br{rail}"

    @property
    def burst_bytes(self) -> int:
        return tbf_burst_bytes(self.rate_bps, self.mtu) if self.rate_bps else 0

    def node_of_rank(self, rank: int, node_size: int) -> int:
        if node_size < 1:
            raise ValueError(f"node_size must be >= 1, got {node_size}")
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        node = rank // node_size
        if node >= self.num_nodes:
            raise ValueError(f"rank {rank} with {node_size} ranks per node needs node {node}, "
                             f"but the cluster has {self.num_nodes} nodes")
        return node

    # ----- commands ----------------------------------------------------------------------------------------

    def namespace_commands(self) -> list[list[str]]:
        """Create the namespaces, bring up loopback (intra-node traffic uses it) and select reno.

        Reno reaches tbf's line rate; bbr got 71-90 % of it. In a non-initial namespace only reno or bbr can
        be chosen, so the host default (usually cubic) cannot be inherited anyway."""
        cmds = []
        for ns in self.namespaces:
            cmds.append(["ip", "netns", "add", ns])
            cmds.append(["ip", "-n", ns, "link", "set", "lo", "up"])
            # Devices created later inherit this: without it IPv6 neighbour discovery and MLD reports trickle
            # over the links and pollute the cross-node byte counts. lo already exists and keeps ::1.
            cmds.append(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.default.disable_ipv6=1"])
        for ns in self.node_namespaces:
            cmds.append(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.tcp_congestion_control=reno"])
            if self.links_per_node > 1:   # replies to another rail's address leave on that rail (see above)
                for key in ("all", "default"):
                    cmds.append(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv4.conf.{key}.rp_filter=0"])
        return cmds

    def link_commands(self) -> list[list[str]]:
        """Create the veth links (and the bridge). Empty in tun mode: the relay creates the tun devices."""
        if self.mode == "tun":
            return []
        nodes = self.node_namespaces
        if self.num_nodes == 2:
            return [["ip", "link", "add", dev, "netns", nodes[0], "type", "veth", "peer", "name", dev, "netns", nodes[1]]
                    for dev in self.devices]
        sw = self.switch_namespace
        cmds = []
        for rail, dev in enumerate(self.devices):
            cmds.append(["ip", "-n", sw, "link", "add", self._bridge(rail), "type", "bridge"])
            for i, ns in enumerate(nodes):
                port = self._port(i, rail)
                cmds.append(["ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port,
                             "netns", sw])
                cmds.append(["ip", "-n", sw, "link", "set", port, "mtu", str(self.mtu)])
                cmds.append(["ip", "-n", sw, "link", "set", port, "master", self._bridge(rail)])
        return cmds

    def configure_commands(self) -> list[list[str]]:
        """Address, MTU, shaping and RPS on every device; run after the devices exist (in tun mode: after the
        relay reported them ready)."""
        cmds = []
        for node, ns in enumerate(self.node_namespaces):
            for rail, dev in enumerate(self.devices):
                cmds.append(["ip", "-n", ns, "link", "set", dev, "mtu", str(self.mtu)])
                cmds.append(["ip", "-n", ns, "addr", "add", f"{self.rail_address(node, rail)}/24", "dev", dev])
                cmds.append(["ip", "-n", ns, "link", "set", dev, "up"])
                if self.rate_bps:
                    cmds.append(self._tbf(ns, dev))  # uplink: everything that leaves the node on this link
                cmds.append(self._rps(ns, dev))
        sw = self.switch_namespace
        if sw:
            for rail in range(self.links_per_node):
                cmds.append(["ip", "-n", sw, "link", "set", self._bridge(rail), "up"])
                for i in range(self.num_nodes):
                    port = self._port(i, rail)
                    cmds.append(["ip", "-n", sw, "link", "set", port, "up"])
                    # Downlink: egress of the switch port towards node i, so incast shares one link's rate.
                    if self.rate_bps:
                        cmds.append(self._tbf(sw, port))
                    cmds.append(self._rps(sw, port))
        return cmds

    def setup_commands(self) -> list[list[str]]:
        """The whole plan for veth mode (tun mode starts the relay between links and configuration)."""
        return self.namespace_commands() + self.link_commands() + self.configure_commands()

    def teardown_commands(self) -> list[list[str]]:
        """Deleting a namespace destroys its devices and the veth peers; processes inside must be gone first."""
        return [["ip", "netns", "del", ns] for ns in reversed(self.namespaces)]

    def _tbf(self, ns: str, dev: str) -> list[str]:
        # Always a fresh "add" on a new device: "tc qdisc replace" keeps old state and gave erratic rates.
        return ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_bps}bit",
                "burst", str(self.burst_bytes), "latency", TBF_LATENCY]

    def _rps(self, ns: str, dev: str) -> list[str]:
        # tbf dequeues on whichever CPU its timer fires and veth re-injects there; without RPS that reorders
        # packets (thousands of SACK reorder events, spurious retransmits). Spreading receive work over all
        # CPUs removes it. `ip netns exec` remounts /sys, so the path names the namespace's own device.
        path = f"/sys/class/net/{dev}/queues/rx-0/rps_cpus"
        return ["ip", "netns", "exec", ns, "sh", "-c", f"echo {cpu_mask(self.num_cpus)} > {path}"]

    def describe(self) -> str:
        delay = f", {self.delay_ms:g} ms one way" if self.delay_ms is not None else ""
        rate = f"{self.rate_bps / 1e6:g} Mbit/s" if self.rate_bps else "unshaped links"
        links = ("one link per node" if self.links_per_node == 1 else
                 f"{self.links_per_node} links per node, one per rank (rails)")
        return (f"{self.num_nodes} nodes, {links}, {rate}{delay}, MTU {self.mtu}, "
                f"{self.mode} links, namespaces {self.run_prefix}*")
