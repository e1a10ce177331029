"""Start N local CPU ranks of a Python worker function and collect their results.

Used by the test-suite and the benchmark CLI (which also builds the compiled ops here, before any rank
starts: `prepare_ops`). Every rank is a separate interpreter in
its own process group, so the whole tree a rank spawns can be killed at once, and no
rank outlives :func:`launch_local` on any path (success, failure, timeout, Ctrl-C).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, IO

__all__ = ["launch_local", "free_port", "prepare_ops", "remove_cpu_comm_workspaces", "RankFailure"]

# After the first rank fails, peers usually fail too (broken collectives); a short grace
# lets them write their own errors before being killed.
FAILURE_GRACE_S = 3.0
# Time between SIGTERM (the program's handlers may still clean up) and SIGKILL.
TERMINATE_GRACE_S = 2.0
STACK_DUMP_GRACE_S = 0.5
POLL_INTERVAL_S = 0.05
LOG_TAIL_LINES = 40
MASTER_ADDR = "127.0.0.1"
HUNG_LOG_TAIL_LINES = 80

# Directory holding the ds_asynchzp package; children need it on sys.path to run
# `-m ds_asynchzp.bench._rank_entry` when the package is used from a source checkout.
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent
# The machine's CPU description (py-cpuinfo's JSON), handed to the ranks: see `_cpu_info_json`.
CPU_INFO_ENV = "DS_ASYNCHZP_CPU_INFO"


class RankFailure(RuntimeError):
    """A rank raised, crashed or exited without a result."""

    def __init__(self, message: str, rank: int, returncode: int | None, log_path: str):
        super().__init__(message)
        self.rank = rank
        self.returncode = returncode
        self.log_path = log_path


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen
    log_path: Path
    result_path: Path
    log_file: IO[bytes]
    killed_by_launcher: bool = False


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local(target: str, nproc: int, node_size: int, payload: dict, *, timeout_s: float = 600,
                 workdir: str | None = None, env: dict | None = None,
                 rank_prefix_cmd: Callable[[int], list[str]] | None = None) -> list[dict]:
    """Run `target` ("package.module:function") on `nproc` ranks; rank r gets node r // node_size.
    Returns the per-rank return values (JSON-serialisable dicts), ordered by rank."""
    # Validate everything before any process exists.
    if nproc < 1 or node_size < 1:
        raise ValueError(f"nproc ({nproc}) and node_size ({node_size}) must both be >= 1")
    if nproc % node_size != 0:
        raise ValueError(f"nproc ({nproc}) must be a multiple of node_size ({node_size})")
    module_name, sep, fn_name = target.partition(":")
    if not sep or not module_name or not fn_name:
        raise ValueError(f"target must look like 'package.module:function', got {target!r}")

    own_workdir = workdir is None
    run_dir = Path(tempfile.mkdtemp(prefix="asynchzp-launch-") if own_workdir else workdir)
    run_dir.mkdir(parents=True, exist_ok=True)
    payload_path = run_dir / "payload.json"
    payload_path.write_text(json.dumps(payload), encoding="utf-8")
    port = free_port()

    ranks: list[_Rank] = []
    failed: _Rank | None = None
    still_running: list[_Rank] = []
    try:
        for r in range(nproc):
            ranks.append(_spawn(r, nproc, node_size, port, target, payload_path, run_dir, env,
                                rank_prefix_cmd))
        failed, still_running = _supervise(ranks, time.monotonic() + timeout_s)
    finally:
        # Runs on every path, including KeyboardInterrupt and spawn errors.
        _kill_all(ranks)
        for rk in ranks:
            rk.log_file.close()
        remove_cpu_comm_workspaces((env or {}).get("MASTER_ADDR", MASTER_ADDR), port)

    # Logs are read only now: killed ranks have had their chance to dump their stacks.
    if failed is not None:
        raise _failure(failed, ranks, nproc, node_size, target)
    if still_running:
        raise TimeoutError(_timeout_message(still_running, timeout_s, target))

    results = []
    for rk in ranks:
        record = _read_result(rk)
        if record is None or not record.get("ok"):
            raise _failure(rk, ranks, nproc, node_size, target)
        results.append(record["result"])
    if own_workdir:
        shutil.rmtree(run_dir, ignore_errors=True)
    return results


def _rank_env(r: int, nproc: int, node_size: int, port: int, overrides: dict | None) -> dict:
    env = dict(os.environ)
    env.update({
        "MASTER_ADDR": MASTER_ADDR,
        "MASTER_PORT": str(port),
        "RANK": str(r),
        "LOCAL_RANK": str(r % node_size),
        "WORLD_SIZE": str(nproc),
        "LOCAL_SIZE": str(node_size),
        "LOCAL_WORLD_SIZE": str(node_size),
        "CROSS_RANK": str(r // node_size),
        "NODE_RANK": str(r // node_size),
        "GROUP_RANK": str(r // node_size),
        "CROSS_SIZE": str(nproc // node_size),
        "DS_ACCELERATOR": "cpu",
        # Many ranks share few cores; intra-op thread pools would only oversubscribe them.
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    cpu_info = _cpu_info_json()
    if cpu_info:
        env[CPU_INFO_ENV] = cpu_info
    scripts_first_on_path(env)
    # A value may name the rank's local index (an emulated rail: `eth{local_rank}`).
    env.update({k: str(v).replace("{local_rank}", str(r % node_size)) for k, v in (overrides or {}).items()})
    if not _is_site_dir(_PACKAGE_ROOT):
        entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(_PACKAGE_ROOT) not in entries:
            env["PYTHONPATH"] = os.pathsep.join([str(_PACKAGE_ROOT), *entries])
    return env


@functools.lru_cache(maxsize=None)
def _cpu_info_json() -> str:
    """py-cpuinfo's description of this machine, asked once per launcher process. DeepSpeed's CPU op builders ask
    for it twice per op they load (for the compiler flags that key the build cache), and each answer starts a child
    Python (about 1 s of CPU): 4 to 6 s per rank, all ranks at once on a few cores. The ranks run on this machine,
    so the launcher's answer is theirs (`_rank_entry` calls `reuse_cpu_info`). Empty where py-cpuinfo fails."""
    try:
        import cpuinfo

        return cpuinfo.get_cpu_info_json()
    except Exception:  # noqa: BLE001 - the ranks then ask py-cpuinfo themselves, as they would without this
        return ""


def reuse_cpu_info(text: str) -> None:
    """Answer py-cpuinfo's `get_cpu_info` in this process with `text` (its JSON, of this machine) instead of a child
    interpreter per call. Nothing changes where `text` is empty or py-cpuinfo is not installed."""
    if not text:
        return
    try:
        import cpuinfo
    except ImportError:
        return
    cpuinfo.get_cpu_info = lambda: json.loads(text)     # a fresh dict per call, as py-cpuinfo's


def remove_cpu_comm_workspaces(master_addr: str, master_port: int) -> None:
    """Remove the shared-memory workspaces that DeepSpeed's CPU communication op leaves behind, one per rank
    (66 MiB each, in RAM): a test suite's launches would otherwise fill /dev/shm and the machine's memory. Call
    it once every rank of the rendezvous has ended."""
    if "deepspeed" not in sys.modules and importlib.util.find_spec("deepspeed") is None:
        return   # a launch of plain torch ranks: nothing of DeepSpeed's to remove
    from ..platform.deepspeed_internals import cpu_comm_workspaces

    for path in cpu_comm_workspaces(master_addr, master_port):
        path.unlink(missing_ok=True)


def scripts_first_on_path(env) -> None:
    """DeepSpeed JIT-builds CPU ops with whichever ninja PATH finds, and ninja releases keep incompatible build
    records: a cached op found by another ninja is rebuilt from scratch (minutes on two cores). This
    interpreter's scripts directory first (its own ninja) behaves like an activated environment."""
    scripts = sysconfig.get_path("scripts")
    if scripts and os.path.isdir(scripts) and env.get("PATH", "").split(os.pathsep)[0] != scripts:
        env["PATH"] = os.pathsep.join([scripts, env["PATH"]]) if env.get("PATH") else scripts


def _is_site_dir(path: Path) -> bool:
    # An installed package is importable anyway; putting site-packages on PYTHONPATH
    # would move it ahead of the standard library.
    site_dirs = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    return any(os.path.realpath(d) == str(path) for d in site_dirs)


def _spawn(r: int, nproc: int, node_size: int, port: int, target: str, payload_path: Path,
           run_dir: Path, env: dict | None, rank_prefix_cmd) -> _Rank:
    log_path = run_dir / f"rank{r}.log"
    result_path = run_dir / f"rank{r}.result.json"
    result_path.unlink(missing_ok=True)  # a stale result from a reused workdir must not count
    prefix = list(rank_prefix_cmd(r)) if rank_prefix_cmd is not None else []
    cmd = [*prefix, sys.executable, "-m", "ds_asynchzp.bench._rank_entry", target,
           str(payload_path), str(result_path)]
    log_file = open(log_path, "wb")
    try:
        log_file.write(f"# rank {r}/{nproc} node {r // node_size}: {' '.join(cmd)}\n".encode())
        log_file.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT,
                                env=_rank_env(r, nproc, node_size, port, env),
                                start_new_session=True)
    except BaseException:
        log_file.close()
        raise
    return _Rank(r, proc, log_path, result_path, log_file)


def _supervise(ranks: list[_Rank], deadline: float) -> tuple[_Rank | None, list[_Rank]]:
    """Poll until all ranks exit, a failure's grace period ends, or the deadline passes.
    Returns (first failed rank or None, ranks still running)."""
    failed: _Rank | None = None
    grace_end = float("inf")
    while True:
        running = [rk for rk in ranks if rk.proc.poll() is None]
        if failed is None:
            bad = [rk for rk in ranks if rk.proc.returncode is not None and not _succeeded(rk)]
            if bad:
                # Prefer a rank killed by a signal (nothing else sends one before the launcher does), then one
                # with a Python traceback: the root cause, while its peers merely failed on the broken
                # collective or ended because they lost it.
                bad.sort(key=lambda rk: (rk.proc.returncode >= 0, _read_result(rk) is None, rk.rank))
                failed = bad[0]
                grace_end = time.monotonic() + FAILURE_GRACE_S
        now = time.monotonic()
        if not running or now >= grace_end or now >= deadline:
            return failed, running
        time.sleep(POLL_INTERVAL_S)


def _succeeded(rk: _Rank) -> bool:
    record = _read_result(rk)
    return rk.proc.returncode == 0 and record is not None and bool(record.get("ok"))


def _read_result(rk: _Rank) -> dict | None:
    try:
        return json.loads(rk.result_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _signal_group(rk: _Rank, sig: int) -> bool:
    """Signal the rank's whole process group; returns False when nothing is left in it."""
    try:
        os.killpg(rk.proc.pid, sig)  # start_new_session: the group id is the leader's pid
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        # e.g. a prefix command changed user; the leader is the best we can still reach.
        if rk.proc.poll() is None:
            rk.proc.send_signal(sig)
            return True
        return False


def _dump_stacks(running: list[_Rank]) -> None:
    """The rank entry dumps every thread's stack into its log on SIGUSR1 (faulthandler, from C: it works while
    the rank is blocked in native code). A signal of its own, because SIGTERM handlers belong to the program
    (DeepSpeed's, the peer monitor's) and may replace faulthandler's."""
    signalled = False
    for rk in running:
        try:
            rk.proc.send_signal(signal.SIGUSR1)
            signalled = True
        except ProcessLookupError:
            pass
    if signalled:
        time.sleep(STACK_DUMP_GRACE_S)


def _kill_all(ranks: list[_Rank]) -> None:
    """Ask every rank still running for its stacks, SIGTERM every rank's process group, then SIGKILL what
    survives, then reap."""
    running = [rk for rk in ranks if rk.proc.poll() is None]
    for rk in running:
        rk.killed_by_launcher = True
    interrupted = False
    try:
        _dump_stacks(running)
        alive = [rk for rk in ranks if _signal_group(rk, signal.SIGTERM)]
        end = time.monotonic() + TERMINATE_GRACE_S
        while alive and time.monotonic() < end:
            time.sleep(POLL_INTERVAL_S)
            alive = [rk for rk in alive if rk.proc.poll() is None or _signal_group(rk, 0)]
    except KeyboardInterrupt:
        interrupted = True  # a second Ctrl-C skips the grace period, not the cleanup
    for rk in ranks:
        _signal_group(rk, signal.SIGKILL)
    for rk in ranks:
        try:
            rk.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass  # unkillable (uninterruptible sleep); nothing more can be done from here
    if interrupted:
        raise KeyboardInterrupt


def _describe_exit(rk: _Rank) -> str:
    code = rk.proc.returncode
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        how = "killed by launcher with" if rk.killed_by_launcher else "killed by"
        return f"{how} {name} (exit code {code})"
    return f"exit code {code}"


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))  # logs can be huge; the tail is enough
            text = f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"<could not read {path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


def _failure(rk: _Rank, ranks: list[_Rank], nproc: int, node_size: int, target: str) -> RankFailure:
    record = _read_result(rk)
    header = (f"rank {rk.rank} of {nproc} (node {rk.rank // node_size}) failed running {target}: "
              f"{_describe_exit(rk)}")
    if record is not None and not record.get("ok") and record.get("error"):
        detail = f"--- traceback of rank {rk.rank} ---\n{record['error'].rstrip()}"
    else:
        reason = "exited without a result" if record is None else "reported no error text"
        detail = (f"rank {rk.rank} {reason}; --- last {LOG_TAIL_LINES} lines of {rk.log_path} ---\n"
                  f"{_log_tail(rk.log_path)}")
    others = "; ".join(f"rank {o.rank}: {_describe_exit(o)}" for o in ranks if o is not rk)
    message = f"{header}\n{detail}"
    if others:
        message += f"\nother ranks: {others}"
    message += f"\nlogs: {rk.log_path.parent}"
    return RankFailure(message, rk.rank, rk.proc.returncode, str(rk.log_path))


def _timeout_message(still_running: list[_Rank], timeout_s: float, target: str) -> str:
    rank_ids = [rk.rank for rk in still_running]
    parts = [f"{target} timed out after {timeout_s:g}s; ranks still running: {rank_ids}"]
    for rk in still_running[:8]:  # bounded: a 64-rank hang should not produce a novel
        # Enough lines for the stacks each hung rank dumped (a training thread and a few communication threads).
        parts.append(f"--- last {HUNG_LOG_TAIL_LINES} lines of {rk.log_path} ---\n"
                     f"{_log_tail(rk.log_path, HUNG_LOG_TAIL_LINES)}")
    if len(still_running) > 8:
        parts.append(f"... {len(still_running) - 8} more; logs in {still_running[0].log_path.parent}")
    return "\n".join(parts)


# DeepSpeed's JIT-built CPU ops every rank loads: (builder, what the progress line calls it).
_DEEPSPEED_CPU_OPS = (("ShareMemCommBuilder", "communication op"),
                      ("FusedAdamBuilder", "Adam (the ds_config optimizer)"),
                      ("CPUAdamBuilder", "host Adam (DeepSpeedCPUAdam, with offload_optimizer)"))


def prepare_ops() -> None:
    """Build the compiled ops the ranks load, here, before any rank starts, saying so: on a first run each takes
    minutes on a small host, and every rank would otherwise sit at 0 % of its progress bar meanwhile. Both are
    cached (DeepSpeed's CPU ops by torch, ours by source hash); later runs only load them. Built inside a launch
    instead, one rank builds while the others wait on torch's build lock, against the launch's timeout; a rank
    stopped mid-build leaves that lock behind, and every later process waits on it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    scripts_first_on_path(os.environ)    # the ninja the ranks will use, so they find the build cached
    reuse_cpu_info(_cpu_info_json())     # asked once here, not twice per op
    from deepspeed.accelerator import get_accelerator

    for builder, what in _DEEPSPEED_CPU_OPS:
        started = time.monotonic()
        print(f"preparing: DeepSpeed's CPU {what} (built on first use, a few minutes; cached afterwards) ...",
              flush=True)
        get_accelerator().create_op_builder(builder).load()
        print(f"preparing: DeepSpeed's CPU {what} ready ({time.monotonic() - started:.1f} s)", flush=True)
    print("preparing: the package's ops ...", flush=True)
    started = time.monotonic()
    from ds_asynchzp import ops

    print(f"preparing: the package's ops: {ops.status('cpu')} ({time.monotonic() - started:.1f} s)", flush=True)
