"""Tiny worker functions run by tests/test_launch.py inside launched ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def _rank() -> int:
    return int(os.environ["RANK"])


def _record_pid(payload: dict, name: str, pid: int) -> None:
    pid_dir = payload.get("pid_dir")
    if pid_dir:
        # Written aside, then renamed: a test polling the directory never reads a file not yet written.
        path = os.path.join(pid_dir, f"{name}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(pid))
        os.replace(path + ".tmp", path)


def env_and_allreduce(payload: dict) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    result = {
        "rank": _rank(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node": int(os.environ["NODE_RANK"]),
        "cross_size": int(os.environ["CROSS_SIZE"]),
        "world_size": dist.get_world_size(),
        "dist_rank": dist.get_rank(),
        "allreduce_sum": value.item(),
        "echo": payload["echo"],
    }
    dist.destroy_process_group()
    return result


def raise_on_rank1(payload: dict) -> dict:
    if _rank() == 1:
        raise ValueError("boom-42")
    time.sleep(120)  # peers hang, as they would in a collective; the launcher must kill them
    return {}


def hang_on_rank1(payload: dict) -> dict:
    _record_pid(payload, f"rank{_rank()}", os.getpid())
    if _rank() != 1:
        return {"rank": _rank()}
    # A grandchild in the rank's process group must die with it.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
    _record_pid(payload, "grandchild", child.pid)
    while True:
        time.sleep(1)


def exit3_on_rank1(payload: dict) -> dict:
    if _rank() == 1:
        print("about to die without a result", flush=True)
        os._exit(3)
    time.sleep(120)
    return {}


def sleep_forever(payload: dict) -> dict:
    _record_pid(payload, f"rank{_rank()}", os.getpid())
    while True:
        time.sleep(1)


def hang_after_a_peer_monitor(payload: dict) -> dict:
    """Runs a peer monitor (as an engine does) and closes it, then rank 1 hangs in `_stuck_in_here`."""
    import torch.distributed as dist

    from ds_asynchzp.scheduler.peer_monitor import PeerMonitor

    dist.init_process_group("gloo", init_method="env://")
    monitor = PeerMonitor(dist.get_rank(), dist.get_world_size())
    monitor.start()
    dist.barrier()
    monitor.close()
    if _rank() == 1:
        _stuck_in_here()
    return {"rank": _rank()}


def _stuck_in_here() -> None:
    while True:
        time.sleep(1)


def deepspeed_comm_workspaces(payload: dict) -> dict:
    """Initialise deepspeed.comm on CPU and report the shared-memory workspaces its CPU op created."""
    import deepspeed

    from ds_asynchzp.platform.deepspeed_internals import cpu_comm_workspaces

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.comm.barrier()   # every rank has created its own
    return {"workspaces": [str(p) for p in cpu_comm_workspaces(os.environ["MASTER_ADDR"],
                                                               int(os.environ["MASTER_PORT"]))]}


def cpu_info_without_a_child(payload: dict) -> dict:
    """py-cpuinfo's answer inside a rank, the way DeepSpeed's CPU op builders ask for it, and how many processes
    asking started."""
    started = []
    original = subprocess.Popen.__init__

    def counting(self, *args, **kwargs):
        started.append(args[0] if args else kwargs.get("args"))
        return original(self, *args, **kwargs)

    subprocess.Popen.__init__ = counting
    try:
        from cpuinfo import get_cpu_info
        first, second = get_cpu_info(), get_cpu_info()
    finally:
        subprocess.Popen.__init__ = original
    second["flags"].append("changed-by-the-caller")
    return {"info": first, "children": len(started), "fresh_copies": "changed-by-the-caller" not in first["flags"]}
