"""Shared helpers of the tests that run commands through `asynchzp-cluster` (emulated nodes): the CLI as users
start it, the skip where namespaces cannot be made, a run whose output lines are collected as they come, and the
documented launch commands."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ds_asynchzp.netem import EmulationUnavailable, preflight, tracking

REPO_ROOT = Path(__file__).resolve().parent.parent
_SCRIPT = Path(sys.executable).with_name("asynchzp-cluster")
# The installed entry point, as users run it; the module where the package is used without installing it.
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "ds_asynchzp.netem.cli"]
DEEPSPEED = Path(sys.executable).with_name("deepspeed")
# What docs/multinode.md tells users to run (test_cluster_cli.test_the_docs_show_these_commands keeps them equal).
DOC_DEEPSPEED = ("asynchzp-cluster --nodes 2 --ranks-per-node 2 --bw 200mbit -- deepspeed --hostfile {hostfile} "
                 "--no_ssh --node_rank {node_rank} --master_addr {master_addr} --master_port {master_port} "
                 "--num_gpus 2 examples/train.py --deepspeed_config examples/ds_config_asynchzp.json")
RUN_TIMEOUT_S = 240


def _unavailable_reason() -> str | None:
    try:
        preflight()
    except EmulationUnavailable as exc:
        return str(exc)
    probe = subprocess.run(["unshare", "--uts", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                           text=True)
    return None if probe.returncode == 0 else f"unshare --uts --pid failed: {probe.stderr.strip()}"


REASON = _unavailable_reason()
if REASON:
    print(f"asynchzp-cluster tests skipped: {REASON}")
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"namespaces unavailable: {REASON}")


def launch_deepspeed(env: dict, num_gpus: int, script: str, *args: str, timeout: float = RUN_TIMEOUT_S) -> str:
    """Run `script` on `num_gpus` CPU ranks of this machine under the real deepspeed launcher; assert it exits 0
    and return its output."""
    from ds_asynchzp.bench.launch import free_port, remove_cpu_comm_workspaces

    # A free port keeps concurrent runs from colliding on the launcher's default 29500.
    port = free_port()
    cmd = [str(DEEPSPEED), "--num_gpus", str(num_gpus), "--master_port", str(port), script, *args]
    # start_new_session lets a timeout kill every rank, not just the launcher.
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{script} did not finish in {timeout} s; output tail:\n{out[-4000:]}")
    finally:
        remove_cpu_comm_workspaces("*", port)   # the deepspeed launcher leaves DeepSpeed's behind
    assert proc.returncode == 0, f"exit code {proc.returncode}; output tail:\n{out[-4000:]}"
    return out


def env() -> dict:
    # One OpenMP thread per rank on every run, the references included: losses are compared bit for bit.
    return {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}


def with_options(doc_command: str, options: list[str], wrap: list[str] = (), train_args: list[str] = ()) -> list:
    """A documented command with extra asynchzp-cluster options, a wrapper before the node command, and more
    arguments for the training script."""
    words = shlex.split(doc_command)
    cut = words.index("--")
    return [*CLI, *words[1:cut], *options, "--", *wrap, *words[cut + 1:], *train_args]


class Run:
    """asynchzp-cluster as a child process; its output lines are collected with their arrival times."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            hit = next((t for t, line in self.lines if re.search(pattern, line)), None)
            if hit is not None:
                return hit
            assert self.proc.poll() is None, f"ended before {pattern!r}:\n{self.output[-4000:]}"
            time.sleep(0.1)
        pytest.fail(f"no line matching {pattern!r} within {timeout} s:\n{self.output[-4000:]}")

    def finish(self, timeout: float = RUN_TIMEOUT_S + 60) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()  # the CLI stops its nodes and removes its namespaces on SIGTERM
            self.proc.wait(timeout=60)
            pytest.fail(f"asynchzp-cluster did not end in {timeout} s:\n{self.output[-4000:]}")
        self._reader.join(timeout=10)
        return code

    @property
    def prefix(self) -> str:
        return f"ahzp{self.proc.pid}"  # the cluster's namespaces: ahzp<pid of asynchzp-cluster>n<i>


def namespaces(prefix: str) -> list[str]:
    # Exactly this cluster's: "ahzp12n0".startswith("ahzp1") would also catch another run's namespaces.
    return [ns for ns in tracking.list_namespaces() if re.fullmatch(rf"{prefix}(n\d+|sw)", ns)]


def losses(out: str, node_prefix: str = r"\[node 0\] ") -> list[float]:
    """The `losses=` line of examples/train.py (rank 0), at full precision."""
    match = re.search(rf"^{node_prefix}losses=(\S+)$", out, re.M)
    assert match, f"no losses line:\n{out[-4000:]}"
    return [float(x) for x in match.group(1).split(",")]


def doc_text(path: Path) -> str:
    """A markdown file with continued shell lines joined and runs of blanks made one, to find commands in it."""
    text = re.sub(r"\s*\\\n\s*", " ", path.read_text())
    return re.sub(r"[ \t]+", " ", text)
