"""What happens when something breaks: a collective failing on a communication thread, a wait that never
ends, a rank killed mid-step, and threads left behind at teardown or interpreter exit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import psutil
import pytest

from ds_asynchzp.bench import launch
from ds_asynchzp.bench.launch import RankFailure, free_port, launch_local, remove_cpu_comm_workspaces
from ds_asynchzp.errors import CommThreadError, CommTimeoutError
from ds_asynchzp.scheduler.comm_thread import CommThread, InlineRunner
from tests.dist_harness import REPO_ROOT

LOST_WITHIN_S = 60


def _failing_collective():
    raise ValueError("gloo: connection closed by peer (simulated)")


def test_a_thread_failure_reaches_the_training_thread_with_its_traceback():
    thread = CommThread("probe", timeout=30)
    try:
        ok = thread.submit(lambda: 41 + 1, "first job", "probe_group")
        bad = thread.submit(_failing_collective, "parameter all-gather", "param_shard")
        after = thread.submit(lambda: "never run", "third job", "probe_group")
        assert ok.wait() == 42
        with pytest.raises(CommThreadError, match=r"parameter all-gather on process group 'param_shard'") as info:
            bad.wait()
        original = info.value.__cause__
        assert isinstance(original, ValueError)
        # The original traceback shows where it failed, on the communication thread.
        assert "_failing_collective" in "".join(traceback.format_tb(original.__traceback__))
        # The thread is poisoned: later jobs would issue collectives out of step with the other ranks.
        with pytest.raises(CommThreadError):
            after.wait()
        # A job submitted after the failure names the collective that failed, as a wait on it would.
        with pytest.raises(CommThreadError, match=r"parameter all-gather on process group 'param_shard' failed on a "
                                                  r"communication thread \('probe'\) earlier, so fourth job was not "
                                                  r"issued \(no peer rank is known to be lost\)"):
            thread.submit(lambda: None, "fourth job", "probe_group")
    finally:
        assert thread.stop()


def test_a_submit_after_a_failure_is_diagnosed_with_the_failed_jobs_ticket():
    """The diagnosis of a submit on a poisoned thread is the one a wait on the failed job gets (its ticket: where
    every rank is, which went silent), not only the lost-peer verdict."""
    seen = []

    def diagnose(ticket=None):
        seen.append(ticket)
        return f"no heartbeat from rank(s) 2, 3 (job #{ticket})"

    thread = CommThread("boundary", timeout=30, diagnose=diagnose)
    try:
        bad = thread.submit(_failing_collective, "cross-node gradient reduction", "grad_boundary")
        with pytest.raises(CommThreadError):
            bad.wait()
        with pytest.raises(CommThreadError, match=r"cross-node gradient reduction on process group 'grad_boundary' "
                                                  r"failed on a communication thread \('boundary'\) earlier, so "
                                                  r"parameter refresh was not issued \(no heartbeat from rank\(s\) "
                                                  rf"2, 3 \(job #{bad.ticket}\)\)"):
            thread.submit(lambda: None, "parameter refresh", "param_refresh")
        assert seen == [bad.ticket, bad.ticket]
    finally:
        assert thread.stop()


def test_every_wait_has_a_timeout_naming_the_collective_and_group():
    thread = CommThread("probe", timeout=0.2)
    release = threading.Event()
    try:
        stuck = thread.submit(lambda: release.wait(10), "cross-node gradient reduction", "grad_boundary")
        started = time.monotonic()
        with pytest.raises(CommTimeoutError, match=r"cross-node gradient reduction on process group "
                                                   r"'grad_boundary' did not complete within"):
            stuck.wait()
        assert time.monotonic() - started < 5
    finally:
        release.set()
        assert thread.stop()


def test_inline_runner_runs_each_job_at_once_on_the_caller():
    runner = InlineRunner("probe", timeout=1)
    seen = []
    job = runner.submit(lambda: seen.append(threading.current_thread().name) or 7, "job", "group")
    assert job.done and job.wait() == 7 and seen == [threading.current_thread().name]


def test_stop_joins_the_thread_after_its_queued_jobs():
    thread = CommThread("probe", timeout=30)
    done = []
    for i in range(5):
        thread.submit(lambda i=i: (time.sleep(0.01), done.append(i)), f"job {i}", "group")
    assert thread.stop()
    assert done == list(range(5))
    assert not [t for t in threading.enumerate() if t.name == "asynchzp-probe"]


_EXIT_SCRIPT = r"""
import atexit, threading
# Registered first, so it runs last: after the package's own exit handler.
atexit.register(lambda: print("left behind:", sorted(t.name for t in threading.enumerate()
                                                       if t.name.startswith("asynchzp-") and t.is_alive())))
import deepspeed, torch
import ds_asynchzp
from ds_asynchzp.models.gpt import build_model
deepspeed.init_distributed(dist_backend="gloo")
model = build_model("tiny", seed=0)
config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3}, "async_hzp": {}}
engine, *_ = ds_asynchzp.initialize(model=model, model_parameters=list(model.parameters()), config=config)
x = torch.randint(0, 64, (1, 16))
engine.backward(engine(x, x)); engine.step()
print("running:", sorted(t.name for t in threading.enumerate() if t.name.startswith("asynchzp-")))
# No engine.destroy(): interpreter exit must stop the threads.
"""


def test_interpreter_exit_stops_the_threads_without_destroy():
    env = dict(os.environ, DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    try:
        done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=300, cwd=REPO_ROOT)
    finally:
        remove_cpu_comm_workspaces(env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "running: ['asynchzp-boundary', 'asynchzp-gather', 'asynchzp-reduce']" in done.stdout, done.stdout
    assert "left behind: []" in done.stdout, done.stdout


def _survivor_messages(log_dir: Path, victim: int) -> dict:
    messages = {}
    for log in sorted(log_dir.glob("rank*.log")):
        rank = int(re.match(r"rank(\d+)", log.name).group(1))
        if rank != victim:
            messages[rank] = f"rank {victim} was lost" in log.read_text(errors="replace")
    return messages


def test_a_rank_killed_mid_step_ends_every_other_rank_naming_it(tmp_path, monkeypatch, deepspeed_cpu_ops):
    # The launcher would stop the survivors 3 s after the first failure; give them a minute to end on their
    # own, so what is tested is the ranks' own behaviour.
    monkeypatch.setattr(launch, "FAILURE_GRACE_S", float(LOST_WITHIN_S))
    kill_time = tmp_path / "killed_at"
    payload = {"node_size": 2, "victim": 1, "kill_time_file": str(kill_time)}
    env = {"PYTHONPATH": str(REPO_ROOT)}
    with pytest.raises(RankFailure) as info:
        launch_local("tests._dist_workers:train_until_killed", 4, 2, payload, timeout_s=300,
                     workdir=str(tmp_path / "run"), env=env)
    ended = time.time()
    assert info.value.rank == 1 and "killed by SIGKILL" in str(info.value), str(info.value)[:2000]
    assert ended - float(kill_time.read_text()) < LOST_WITHIN_S
    # Every survivor ended by itself (not killed by the launcher) and said which rank it lost.
    assert "killed by launcher" not in str(info.value), str(info.value)[-2000:]
    assert _survivor_messages(tmp_path / "run", victim=1) == {0: True, 2: True, 3: True}


def test_a_rank_that_finishes_first_is_not_taken_for_lost(deepspeed_cpu_ops, tmp_path):
    # The rank entry ends processes with os._exit (no atexit): it must close the peer monitor itself first.
    payload = {"node_size": 2, "early": 1, "linger_s": 3.0}
    results = launch_local("tests._dist_workers:finish_unevenly", 4, 2, payload, timeout_s=300,
                           workdir=str(tmp_path / "run"), env={"PYTHONPATH": str(REPO_ROOT)})
    assert [r["rank"] for r in results] == [0, 1, 2, 3]


def test_a_rank_killed_under_the_deepspeed_launcher_is_named(deepspeed_cpu_ops):
    deepspeed_cli = Path(sys.executable).with_name("deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    port = free_port()
    cmd = [str(deepspeed_cli), "--num_gpus", "4", "--master_port", str(port), "examples/train.py",
           "--deepspeed_config", "examples/ds_config_asynchzp.json", "--steps", "1000", "--log-every", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.match(r"step\s+2\s", line):
                break
        victims = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if p.environ().get("RANK") == "1" and "train.py" in " ".join(p.cmdline())]
        assert len(victims) == 1, "".join(lines[-50:])
        victims[0].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=LOST_WITHIN_S + 30)
        elapsed = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        remove_cpu_comm_workspaces("*", port)   # the deepspeed launcher leaves DeepSpeed's behind
    output = "".join(lines) + out
    assert proc.returncode != 0
    assert elapsed < LOST_WITHIN_S, elapsed
    assert "rank 1 was lost" in output, output[-4000:]
