"""Tests for ds_asynchzp.bench.launch: ordering, env layout, fail-fast, timeouts, cleanup."""

from __future__ import annotations

import _thread
import os
import threading
import time
from pathlib import Path

import pytest

from ds_asynchzp.bench import launch
from ds_asynchzp.bench.launch import RankFailure, free_port, launch_local

REPO_ROOT = Path(__file__).resolve().parent.parent
# The children must be able to import tests._launch_workers.
CHILD_ENV = {"PYTHONPATH": str(REPO_ROOT)}
WORKERS = "tests._launch_workers"


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed grandchild may linger as a zombie if nothing reaps it; that is not running.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _recorded_pids(pid_dir: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in pid_dir.glob("*.pid")}


def _wait_dead(pids, timeout=5.0) -> list[int]:
    end = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < end:
        alive = [pid for pid in alive if _is_alive(pid)]
        time.sleep(0.05)
    return alive


def test_free_port_is_bindable():
    import socket

    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_results_ordered_with_env_layout_and_gloo(tmp_path):
    results = launch_local(f"{WORKERS}:env_and_allreduce", 4, 2, {"echo": "hi"},
                           timeout_s=120, workdir=str(tmp_path), env=CHILD_ENV)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert [r["dist_rank"] for r in results] == [0, 1, 2, 3]
    assert [r["local_rank"] for r in results] == [0, 1, 0, 1]
    assert [r["node"] for r in results] == [0, 0, 1, 1]
    assert all(r["cross_size"] == 2 and r["world_size"] == 4 for r in results)
    assert all(r["allreduce_sum"] == 6.0 for r in results)
    assert all(r["echo"] == "hi" for r in results)
    assert (tmp_path / "rank3.log").exists()


def test_exception_in_one_rank_fails_fast(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch_local(f"{WORKERS}:raise_on_rank1", 3, 1, {}, timeout_s=60,
                     workdir=str(tmp_path), env=CHILD_ENV)
    assert time.monotonic() - start < 15
    message = str(info.value)
    assert "boom-42" in message and "ValueError" in message
    assert "rank 1" in message
    assert info.value.rank == 1


def test_timeout_kills_every_process(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    with pytest.raises(TimeoutError) as info:
        launch_local(f"{WORKERS}:hang_on_rank1", 2, 1, {"pid_dir": str(pid_dir)}, timeout_s=5,
                     workdir=str(tmp_path / "run"), env=CHILD_ENV)
    assert "[1]" in str(info.value)
    pids = _recorded_pids(pid_dir)
    assert {"rank0", "rank1", "grandchild"} <= set(pids)
    assert _wait_dead(pids.values()) == []


def test_a_hung_rank_shows_its_stack_even_after_a_peer_monitor_ran(tmp_path):
    # Before stopping a hung rank the launcher sends SIGUSR1, on which the rank entry dumps every thread's stack
    # (faulthandler, from C). A peer monitor that ran and closed must not get in the way.
    with pytest.raises(TimeoutError) as info:
        launch_local(f"{WORKERS}:hang_after_a_peer_monitor", 2, 1, {}, timeout_s=20,
                     workdir=str(tmp_path), env=CHILD_ENV)
    message = str(info.value)
    assert "[1]" in message
    assert "_stuck_in_here" in message and "hang_after_a_peer_monitor" in message, message


def test_deepspeeds_shared_memory_workspaces_are_removed_after_the_launch(tmp_path, deepspeed_cpu_ops):
    # DeepSpeed's CPU communication op leaves a 66 MiB workspace per rank in /dev/shm (RAM) at exit.
    results = launch_local(f"{WORKERS}:deepspeed_comm_workspaces", 2, 2, {}, timeout_s=120,
                           workdir=str(tmp_path), env=CHILD_ENV)
    seen = results[0]["workspaces"]
    assert len(seen) == 2, seen
    assert [path for path in seen if Path(path).exists()] == []


def test_ranks_get_the_launchers_cpu_description_without_a_child_process(tmp_path):
    """DeepSpeed's CPU op builders ask py-cpuinfo twice per op they load, a child interpreter each time; in a launched
    rank the answer is the launcher's, asked once, and every call gets its own copy."""
    import cpuinfo

    results = launch_local(f"{WORKERS}:cpu_info_without_a_child", 2, 2, {}, timeout_s=120, workdir=str(tmp_path),
                           env=CHILD_ENV)
    mine = cpuinfo.get_cpu_info()
    for result in results:
        assert result["children"] == 0 and result["fresh_copies"], {k: v for k, v in result.items() if k != "info"}
        assert (result["info"]["arch"], result["info"]["flags"]) == (mine["arch"], mine["flags"])
    # Without the launcher's answer a rank asks py-cpuinfo itself, as it would under any other launcher.
    asked = launch_local(f"{WORKERS}:cpu_info_without_a_child", 1, 1, {}, timeout_s=120,
                         workdir=str(tmp_path / "own"), env=dict(CHILD_ENV, **{launch.CPU_INFO_ENV: ""}))
    assert asked[0]["children"] >= 2 and asked[0]["info"]["flags"] == mine["flags"]


def test_rank_dying_without_result_reports_exit_code_and_log(tmp_path):
    with pytest.raises(RankFailure) as info:
        launch_local(f"{WORKERS}:exit3_on_rank1", 2, 2, {}, timeout_s=60,
                     workdir=str(tmp_path), env=CHILD_ENV)
    message = str(info.value)
    assert "rank 1" in message and "exit code 3" in message
    assert "about to die without a result" in message  # the log tail
    assert info.value.returncode == 3


def test_indivisible_layout_rejected_before_spawning(monkeypatch):
    def no_spawn(*args, **kwargs):
        raise AssertionError("no process may start for an invalid layout")

    monkeypatch.setattr(launch.subprocess, "Popen", no_spawn)
    with pytest.raises(ValueError, match=r"nproc \(3\).*node_size \(2\)"):
        launch_local(f"{WORKERS}:sleep_forever", 3, 2, {}, env=CHILD_ENV)


def test_keyboard_interrupt_kills_ranks(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    def interrupt_once_started():
        end = time.monotonic() + 30
        while len(_recorded_pids(pid_dir)) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        _thread.interrupt_main()

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        launch_local(f"{WORKERS}:sleep_forever", 2, 1, {"pid_dir": str(pid_dir)}, timeout_s=60,
                     workdir=str(tmp_path / "run"), env=CHILD_ENV)
    pids = _recorded_pids(pid_dir)
    assert len(pids) == 2
    assert _wait_dead(pids.values()) == []
