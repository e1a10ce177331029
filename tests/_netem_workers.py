"""Worker run by tests/test_netem.py inside the namespaces of an emulated cluster."""

from __future__ import annotations

import os
import statistics
import time


def _eth0_tx_bytes() -> int:
    # `ip netns exec` remounts /sys for the namespace, so this is the rank's own node link.
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def allreduce_phases(payload: dict) -> dict:
    """A world all_reduce, then one inside each node, with this node's link tx bytes around each."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    node_size = int(os.environ["LOCAL_WORLD_SIZE"])
    node = rank // node_size
    # Every rank must create every group, in the same order.
    groups = [dist.new_group(list(range(n * node_size, (n + 1) * node_size))) for n in range(world // node_size)]
    numel = int(payload["numel"])

    # Small all_reduces: their latency shows an added link delay.
    small = torch.zeros(1)
    times = []
    for _ in range(int(payload.get("small_iters", 10))):
        start = time.perf_counter()
        dist.all_reduce(small)
        times.append((time.perf_counter() - start) * 1e3)

    world_tensor = torch.full((numel,), float(rank + 1))
    dist.barrier()
    tx0 = _eth0_tx_bytes()
    dist.all_reduce(world_tensor)
    dist.barrier()
    tx1 = _eth0_tx_bytes()
    # No world collective between these reads: only this node's ranks talk, over lo.
    intra_tensor = torch.full((numel,), float(rank + 1))
    dist.all_reduce(intra_tensor, group=groups[node])
    tx2 = _eth0_tx_bytes()
    dist.barrier()

    def uniform_value(t):
        return t[0].item() if bool((t == t[0]).all()) else None

    return {
        "rank": rank, "node": node, "netns_inode": os.stat("/proc/self/ns/net").st_ino,
        "world_sum": uniform_value(world_tensor), "intra_sum": uniform_value(intra_tensor),
        "tx_world": tx1 - tx0, "tx_intra": tx2 - tx1,
        "small_allreduce_ms_median": statistics.median(times),
    }
