"""Rank-side code of tests/test_peer_monitor.py (run by ds_asynchzp.bench.launch in fresh processes)."""

from __future__ import annotations

import os
import socket
import time

import deepspeed


def train_with_the_monitor_on(payload: dict) -> dict:
    """Train a few steps with the peer monitor on, linger a few polls, and say how this rank saw its peers. A
    monitor that takes a live peer for lost ends this rank (exit code 1) instead of returning."""
    from ds_asynchzp.scheduler import context
    from tests._dist_workers import _build_engine, train_step

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    case = {"name": "monitored", "gas": 1, "steps": payload["steps"], "async_hzp": {"node_size": payload["node_size"]}}
    engine = _build_engine(case)
    (monitor,) = [live.monitor for live in context.live_contexts()]
    losses = [train_step(engine, case, step, rank, world) for step in range(case["steps"])]
    time.sleep(payload["linger_s"])   # polls after training: a false verdict would end the rank here
    deepspeed.comm.barrier()
    return {"rank": rank, "hostname": socket.gethostname(), "pid": os.getpid(), "identity": monitor.node,
            "watching": monitor._thread is not None, "local_peers": sorted(p for p, peer in monitor.peers.items()
                                                                          if peer.local),
            "losses": losses}
