"""Emulate a multi-node cluster on one Linux host with network namespaces and rate-limited links.

Each node is a namespace with an ``eth0`` on 10.200.0.0/24; inter-node links are shaped with tbf (and, with a
one-way delay, carried by a userspace TUN relay, because the kernel has no netem). Ranks of one node talk over
``lo`` and are never shaped, so per-node ``eth0`` byte counters are the ground truth for cross-node traffic.
Needs root. See :class:`Cluster`.
"""

from .cluster import Cluster, ClusterError, EmulationUnavailable, LeftoverNamespaces, find_leftovers, preflight
from .topology import EmulatedCluster, parse_delay_ms, parse_rate, tbf_burst_bytes

__all__ = ["Cluster", "ClusterError", "EmulationUnavailable", "LeftoverNamespaces", "find_leftovers", "preflight",
           "EmulatedCluster", "parse_rate", "parse_delay_ms", "tbf_burst_bytes"]
