"""The order in which a rank's collectives are issued, and what happens when a peer stops.

* With `issue_order: "total"` every rank issues the same collectives in the same order, across all its threads,
  under random delays around every collective; with "per_thread" the same run interleaves differently on
  different ranks (so the comparison can fail), and both train to the same losses.
* Construction: every group of ours runs one collective on the training thread, in creation order, before any
  communication thread exists; the compiled ops are resolved on the training thread.
* A rank stopped with SIGSTOP: every other rank ends within `comm_timeout_s` + 60 s, and the ranks whose waits
  timed out name the collective, its group and the stopped rank.
"""

from __future__ import annotations

import re

import pytest

from ds_asynchzp.bench import launch
from ds_asynchzp.bench.launch import RankFailure, launch_local
from tests.dist_harness import LAUNCH_TIMEOUT_S, REPO_ROOT

# Random delays of 0 to 15 ms before and after every collective, seeded per rank and thread: threads on
# different ranks reach their collectives in different interleavings unless an order is imposed. DeepSpeed's
# default ZeRO-3 knobs (overlap_comm, prefetch, persistence), as users run it.
DELAYS = "0:15:5"
BASE = {"gas": 2, "steps": 3, "seq_len": 16, "model": "tiny", "comm_delay": DELAYS, "default_knobs": True}
CASES = [
    dict(BASE, name="total", async_hzp={"node_size": 2, "issue_order": "total"}),
    dict(BASE, name="per_thread", async_hzp={"node_size": 2, "issue_order": "per_thread"}),
]


@pytest.fixture(scope="module")
def recorded(deepspeed_cpu_ops):
    env = {"PYTHONPATH": str(REPO_ROOT)}
    return launch_local("tests._comm_order_workers:record_issue_order", 4, 2, {"cases": CASES},
                        timeout_s=LAUNCH_TIMEOUT_S, env=env)


def test_the_total_order_is_the_same_on_every_rank_under_random_delays(recorded):
    sequences = [rank["total"]["issued"] for rank in recorded]
    # Three threads issued (and the training thread, DeepSpeed's own collectives), many collectives each.
    assert len(sequences[0]) > 100 and len(recorded[0]["total"]["threads"]) >= 3, recorded[0]["total"]["threads"]
    for rank, sequence in enumerate(sequences[1:], start=1):
        first = next((i for i, (a, b) in enumerate(zip(sequences[0], sequence)) if a != b), None)
        assert sequence == sequences[0], (
            f"rank {rank} issued a different order than rank 0 from collective {first}: "
            f"{sequence[first:first + 3] if first is not None else sequence[len(sequences[0]):][:3]} against "
            f"{sequences[0][first:first + 3] if first is not None else sequences[0][len(sequence):][:3]}")


def test_without_the_total_order_the_ranks_interleave_differently(recorded):
    """The comparison above can fail: per-thread order under the same delays gives different interleavings (the
    same collectives, each thread in its own order)."""
    sequences = [rank["per_thread"]["issued"] for rank in recorded]
    assert any(sequence != sequences[0] for sequence in sequences[1:])
    assert all(sorted(sequence) == sorted(sequences[0]) for sequence in sequences[1:])


def test_the_order_changes_no_result(recorded):
    for rank in recorded:
        assert rank["total"]["losses"] == rank["per_thread"]["losses"]


def test_every_group_runs_a_collective_on_the_training_thread_before_the_threads_start(recorded):
    for rank in recorded:
        case = rank["total"]
        threads_at = case["threads_started_after"]
        assert len(threads_at) == 3, threads_at
        before = case["construction"][:threads_at[0]]
        warmed = [group for group, op, numel, thread in before
                  if thread == "MainThread" and op == "all_reduce" and numel == 1 and group != "deepspeed"]
        assert warmed == case["member_groups"] and warmed, (warmed, case["member_groups"])


def test_the_compiled_ops_are_resolved_on_the_training_thread(recorded):
    for rank in recorded:
        assert rank["ops_loaded_on"] == ["MainThread"], rank["ops_loaded_on"]


# --------------------------------------------------------------------------------------- the order itself
def test_a_later_ticket_waits_for_every_earlier_one_on_other_threads():
    import threading

    from ds_asynchzp.scheduler.comm_thread import CommThread
    from ds_asynchzp.scheduler.issue_order import IssueOrder

    for total in (True, False):
        order = IssueOrder(total=total, timeout_s=30)
        first, second = CommThread("first", 30, order), CommThread("second", 30, order)
        release, started = threading.Event(), []
        # Ticket 0 on one thread is held until released; ticket 1, on another thread, is free to run at once.
        slow = first.submit(lambda: (release.wait(10), started.append(0)), "slow", "g1")
        fast = second.submit(lambda: started.append(1), "fast", "g2")
        if total:
            assert not fast._done.wait(0.5) and started == []     # waits for its turn
        else:
            fast.wait()
            assert started == [1]
        release.set()
        slow.wait(), fast.wait()
        assert started == ([0, 1] if total else [1, 0])
        assert order.snapshot()["started"] == 1 and order.snapshot()["submitted"] == 2
        first.stop(), second.stop()


def test_a_turn_that_never_comes_times_out_naming_the_job_before():
    from ds_asynchzp.errors import CommTimeoutError
    from ds_asynchzp.scheduler.issue_order import IssueOrder

    order = IssueOrder(total=True, timeout_s=0.3)
    order.ticket(), order.ticket()
    with order.turn(0, "gather", "parameter all-gather", "param_shard"):
        pass
    order.ticket()
    expected = r"#2\) waited 0 s for its turn.*job #1 has not finished.*#0 parameter all-gather"
    with pytest.raises(CommTimeoutError, match=expected):
        with order.turn(2, "reduce", "gradient reduce-scatter", "grad_shard"):
            pass


# ------------------------------------------------------------------------------------------ a stopped rank
COMM_TIMEOUT_S = 10
VICTIM = 3


def test_a_stopped_rank_ends_the_others_within_the_timeout_naming_it(tmp_path, monkeypatch, deepspeed_cpu_ops):
    # The launcher would stop the survivors a few seconds after the first failure; give them 30 s more (a rank's
    # own timeout, its diagnosis and rank 0's linger fit well inside), so what is tested is the ranks' own
    # behaviour. The launcher then kills the stopped victim.
    bound = COMM_TIMEOUT_S + 60
    monkeypatch.setattr(launch, "FAILURE_GRACE_S", 30.0)
    stop_time = tmp_path / "stopped_at"
    payload = {"node_size": 2, "victim": VICTIM, "kill_time_file": str(stop_time), "signal": "SIGSTOP",
               "async_hzp": {"comm_timeout_s": COMM_TIMEOUT_S}}
    with pytest.raises(RankFailure) as info:
        launch_local("tests._dist_workers:train_until_killed", 4, 2, payload, timeout_s=300,
                     workdir=str(tmp_path / "run"), env={"PYTHONPATH": str(REPO_ROOT)})
    stopped = float(stop_time.read_text())
    assert info.value.rank != VICTIM, str(info.value)[:3000]
    # A survivor's log is last written as it ends (its error, or the verdict of its peer monitor).
    ended = {rank: (tmp_path / "run" / f"rank{rank}.log").stat().st_mtime for rank in range(4) if rank != VICTIM}
    assert all(end - stopped < bound for end in ended.values()), {r: end - stopped for r, end in ended.items()}
    logs = {int(re.match(r"rank(\d+)", log.name).group(1)): log.read_text(errors="replace")
            for log in (tmp_path / "run").glob("rank*.log")}
    # A rank that waited on the stopped one says which collective on which group, and that rank 3 stopped.
    named = [rank for rank, text in logs.items() if rank != VICTIM
             and re.search(r"on process group '\w+'", text) and f"rank(s) {VICTIM}" in text
             and "stopped (SIGSTOP" in text]
    assert named, "\n\n".join(f"rank {r}:\n{t[-2500:]}" for r, t in sorted(logs.items()))
    # The survivors ended by themselves, not by the launcher's kill.
    for rank in range(4):
        if rank != VICTIM:
            assert f"rank {rank}: killed by launcher" not in str(info.value), str(info.value)[-2000:]


_USER_COLLECTIVE_SCRIPT = r"""
import json, threading, time
import deepspeed, torch, torch.distributed
import deepspeed.comm as ds_comm
from ds_asynchzp.scheduler.issue_order import IssueOrder
deepspeed.init_distributed(dist_backend="gloo")
original = torch.distributed.all_reduce
order = IssueOrder(total=True, timeout_s=30)
order.guard_backend()
earlier = order.ticket()                      # a job submitted before the user's call, not yet issued
done = []
user = threading.Thread(target=lambda: (torch.distributed.all_reduce(torch.ones(1)), done.append(1)))
user.start()
time.sleep(0.5)
waited = not done                             # the user's collective waits for the earlier ticket
with order.turn(earlier, "reduce", "an earlier job", "g"):
    pass
user.join(10)
what = order.last.what
before = order.snapshot()["submitted"]
ds_comm.all_reduce(torch.ones(1))             # through DeepSpeed's backend, which calls torch.distributed: one turn
tickets = order.snapshot()["submitted"] - before
order.release_backend()
print(json.dumps({"waited": waited, "done": done, "what": what, "tickets": tickets,
                  "restored": torch.distributed.all_reduce is original}))
# A program that ends right after a collective issued on a second thread, leaving its gloo group to the interpreter's
# exit, aborts now and then inside torch ("terminate called without an active exception"; 7 of 28 runs here);
# torch asks every program to destroy its group before it exits, and with that it ends cleanly (0 in 40).
torch.distributed.destroy_process_group()
"""


def test_a_users_torch_distributed_collective_takes_its_turn_in_the_total_order():
    """A collective the user calls on `torch.distributed` directly (ALST's loss all-gather, a logging all-reduce)
    takes a ticket and waits for every job submitted before it, as DeepSpeed's own do; a DeepSpeed collective,
    which reaches `torch.distributed` inside its turn, takes one ticket, not two; release puts the function back."""
    import json
    import os
    import subprocess
    import sys

    from ds_asynchzp.bench.launch import free_port

    env = dict(os.environ, DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", _USER_COLLECTIVE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"waited": True, "done": [1], "what": "torch.distributed's all_reduce", "tickets": 1,
                      "restored": True}, result
