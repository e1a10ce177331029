"""Bookkeeping shared by :mod:`.cluster` and :mod:`.cleanup`: which namespaces and processes a run owns.

A run records its namespaces and helper processes in ``/tmp/ahzp-netem/<prefix>.json`` before creating them,
so that a later ``python -m ds_asynchzp.netem.cleanup`` can remove exactly what a killed run left behind.
Namespace names embed the owner's pid (``ahzp<pid>...``); a namespace whose owner is gone is a leftover.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from .topology import NAMESPACE_PREFIX

__all__ = ["STATE_DIR", "RELAY_SCRIPT", "relay_marker", "list_namespaces", "owner_pid", "pid_alive", "find_leftovers",
           "cleanup_hint", "write_state", "read_states", "remove_state", "process_cmdline", "stop_process",
           "namespace_pids", "kill_namespace_processes", "register_active", "unregister_active"]

STATE_DIR = Path("/tmp/ahzp-netem")
# The relay runs as a script (importing the ds_asynchzp package would pull in torch and DeepSpeed for nothing);
# this path fragment plus "--prefix <prefix> " identifies it in /proc/PID/cmdline.
RELAY_SCRIPT = "ds_asynchzp/netem/relay.py"
CLEANUP_MODULE = "ds_asynchzp.netem.cleanup"
_OWNER_RE = re.compile(rf"^{NAMESPACE_PREFIX}(\d+)")

# Prefixes of clusters that are up in this process; their namespaces are never leftovers.
_ACTIVE_PREFIXES: set[str] = set()


def register_active(prefix: str) -> None:
    _ACTIVE_PREFIXES.add(prefix)


def unregister_active(prefix: str) -> None:
    _ACTIVE_PREFIXES.discard(prefix)


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``); empty when ``ip`` is unusable."""
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    # Lines look like "name (id: 3)" or just "name".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def owner_pid(namespace: str) -> int | None:
    match = _OWNER_RE.match(namespace)
    return int(match.group(1)) if match else None


def pid_alive(pid: int | None) -> bool:
    """True for a running (non-zombie) process. pid 0 / negative are never a process: kill() would signal groups."""
    if pid is None or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return True


def _is_active_here(namespace: str) -> bool:
    return any(namespace.startswith(prefix) and _suffix_is_ours(namespace[len(prefix):])
               for prefix in _ACTIVE_PREFIXES)


def _suffix_is_ours(suffix: str) -> bool:
    # "<prefix>n3" / "<prefix>sw", but not "<prefix>_1n0", which belongs to another cluster of this process.
    return re.fullmatch(r"n\d+|sw|probe", suffix) is not None


def find_leftovers() -> list[str]:
    """Project namespaces (``ahzp*``) whose owner process is gone or unknown, or that this process owns but
    no live Cluster uses. Namespaces of other live runs are not leftovers."""
    leftovers = []
    for ns in list_namespaces():
        if not ns.startswith(NAMESPACE_PREFIX):
            continue
        owner = owner_pid(ns)
        if owner == os.getpid():
            if not _is_active_here(ns):
                leftovers.append(ns)
        elif not pid_alive(owner):
            leftovers.append(ns)
    return leftovers


def relay_marker(prefix: str) -> str:
    return f"{RELAY_SCRIPT} --prefix {prefix} "


def cleanup_hint(namespaces: list[str]) -> str:
    dels = "; ".join(f"ip netns del {ns}" for ns in namespaces)
    return f"run `python -m {CLEANUP_MODULE}` (as root) or: {dels}"


# ----- state files ---------------------------------------------------------------------------------------------

def _state_path(prefix: str) -> Path:
    return STATE_DIR / f"{prefix}.json"


def write_state(prefix: str, state: dict) -> None:
    STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = _state_path(prefix).with_suffix(".tmp")
    tmp.write_text(json.dumps(state), encoding="utf-8")
    os.replace(tmp, _state_path(prefix))  # never a half-written file for cleanup to misread


def read_states() -> dict[str, dict]:
    states = {}
    for path in sorted(STATE_DIR.glob(f"{NAMESPACE_PREFIX}*.json")) if STATE_DIR.is_dir() else []:
        try:
            states[path.stem] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
    return states


def remove_state(prefix: str) -> None:
    """Delete the run's state file and its relay pid file and log."""
    paths = [_state_path(prefix), *STATE_DIR.glob(f"{prefix}.relay.*")] if STATE_DIR.is_dir() else []
    for path in paths:
        path.unlink(missing_ok=True)


# ----- processes -----------------------------------------------------------------------------------------------

def process_cmdline(pid: int | None) -> str:
    if pid is None or pid <= 0:
        return ""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stop_process(pid: int | None, must_contain: str, group: bool = False, grace_s: float = 3.0) -> bool:
    """SIGTERM then SIGKILL `pid` (or its process group), but only if its command line contains
    `must_contain`: a recorded pid may have been reused by an unrelated process since.
    Returns True if something was signalled."""
    if not pid_alive(pid) or must_contain not in process_cmdline(pid):
        return False
    send = (lambda sig: os.killpg(pid, sig)) if group else (lambda sig: os.kill(pid, sig))
    try:
        send(signal.SIGTERM)
        end = time.monotonic() + grace_s
        while pid_alive(pid) and time.monotonic() < end:
            time.sleep(0.02)
        if pid_alive(pid) or group:
            send(signal.SIGKILL)  # a group may hold children (e.g. `sleep`) that ignore the leader's death
    except ProcessLookupError:
        pass
    return True


def namespace_pids(namespace: str) -> list[int]:
    try:
        out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(tok) for tok in out.split() if tok.isdigit()]


def kill_namespace_processes(namespace: str) -> list[int]:
    """SIGKILL every process inside one of our namespaces: it can only be there because a run put it there,
    and after the namespace's name is deleted nothing could find it any more."""
    killed = []
    for pid in namespace_pids(namespace):
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed
