"""Build an emulated cluster from a :class:`~.topology.EmulatedCluster` plan and always take it down again.

Usage::

    with Cluster(2, "200mbit") as cluster:
        before = cluster.read_tx_bytes()
        launch_local(target, 4, 2, payload, env=cluster.rank_env(),
                     rank_prefix_cmd=lambda r: cluster.rank_prefix_cmd(r, 2))
        sent = {n: b - before[n] for n, b in cluster.read_tx_bytes().items()}

Teardown runs on every exit path: leaving the ``with`` block (also by exception), SIGTERM / SIGINT (handlers
installed while the cluster is up), interpreter exit (``atexit``), and, if this process is SIGKILLed, a detached
watchdog shell that deletes the namespaces as soon as this process is gone (or after ``ttl_s``).
"""

from __future__ import annotations

import atexit
import itertools
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from . import tracking
from .topology import DEVICE, NAMESPACE_PREFIX, EmulatedCluster

#: A rank's own link on rails, filled per rank by the launcher.
RAIL_DEVICE_TEMPLATE = "eth{local_rank}"

__all__ = ["Cluster", "ClusterError", "EmulationUnavailable", "LeftoverNamespaces", "preflight", "find_leftovers"]

find_leftovers = tracking.find_leftovers

COMMAND_TIMEOUT_S = 30
RELAY_READY_TIMEOUT_S = 20
DEFAULT_TTL_S = 6 * 3600
_RELAY_PATH = Path(__file__).resolve().with_name("relay.py")
_prefix_counter = itertools.count()


class ClusterError(RuntimeError):
    """A command of the plan failed; the message names the command and its stderr."""


class EmulationUnavailable(ClusterError):
    """This machine or user cannot build namespaces / shaped links; the message says why."""


class LeftoverNamespaces(ClusterError):
    """Namespaces of an earlier run still exist; the message holds the command that removes them."""

    def __init__(self, message: str, namespaces: list[str]):
        super().__init__(message)
        self.namespaces = namespaces


def _run(cmd: list[str], what: str = "") -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except FileNotFoundError:
        raise ClusterError(f"{what or 'command'} failed: {cmd[0]!r} not found (command: {shlex.join(cmd)})") \
            from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{what or 'command'} timed out after {COMMAND_TIMEOUT_S}s: {shlex.join(cmd)}") \
            from None
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip() or "(no output)"
        raise ClusterError(f"{what or 'command'} failed with exit code {proc.returncode}: "
                           f"{shlex.join(cmd)}\n{detail}")
    return proc.stdout


def preflight(need_tun: bool = False) -> None:
    """Raise :class:`EmulationUnavailable` unless namespaces, veth and tbf (and TUN if asked) can be used."""
    if os.geteuid() != 0:
        raise EmulationUnavailable(f"emulated cluster needs root (creates network namespaces); "
                                   f"running as uid {os.geteuid()}")
    for tool in ("ip", "tc", "sysctl"):
        if shutil.which(tool) is None:
            raise EmulationUnavailable(f"emulated cluster needs the {tool!r} command (iproute2 / procps); "
                                       f"not found on PATH")
    if need_tun and not os.path.exists("/dev/net/tun"):
        raise EmulationUnavailable("--inter-node-delay needs /dev/net/tun (TUN devices); it does not exist")
    # The probe's name carries our pid, so a probe left by a SIGKILL here is found as a leftover later.
    probe = f"{NAMESPACE_PREFIX}{os.getpid()}probe"
    try:
        _run(["ip", "netns", "add", probe], "creating a probe network namespace")
    except ClusterError as exc:
        raise EmulationUnavailable(f"cannot create network namespaces: {exc}") from None
    try:
        _run(["ip", "-n", probe, "link", "set", "lo", "up"], "probe")
        _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "100mbit",
              "burst", "32768", "latency", "50ms"], "adding a tbf qdisc in the probe namespace")
    except ClusterError as exc:
        raise EmulationUnavailable(f"cannot shape links with tbf: {exc}") from None
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=COMMAND_TIMEOUT_S)


class Cluster:
    """An emulated cluster of ``num_nodes`` nodes joined by links of ``inter_node_bw`` (tc syntax, e.g.
    "200mbit"), optionally with a one-way ``delay_ms`` (then a userspace TUN relay carries the traffic)."""

    def __init__(self, num_nodes: int = 2, inter_node_bw: str | int = "200mbit", delay_ms: float | str | None = None,
                 mtu: int | None = None, *, ranks_per_node: int | None = None, ttl_s: float = DEFAULT_TTL_S,
                 spec: EmulatedCluster | None = None, links_per_node: int = 1):
        if spec is None:
            seq = next(_prefix_counter)
            prefix = f"{NAMESPACE_PREFIX}{os.getpid()}" + (f"_{seq}" if seq else "")
            spec = EmulatedCluster.create(num_nodes, inter_node_bw, delay_ms, mtu, run_prefix=prefix,
                                          links_per_node=links_per_node)
        self.spec = spec
        self.ranks_per_node = ranks_per_node
        self.ttl_s = ttl_s
        self.created: list[str] = []  # namespaces that exist because of us, in creation order
        self.teardown_errors: list[str] = []
        self._relay: subprocess.Popen | None = None
        self._watchdog: subprocess.Popen | None = None
        self._prev_handlers: dict[int, object] = {}
        self._active = False
        self._lock = threading.RLock()
        self._owner_pid = os.getpid()

    # ----- lifecycle ---------------------------------------------------------------------------------------

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def start(self) -> None:
        spec = self.spec
        if self._active:
            raise ClusterError(f"{self!r} is already running")
        self._owner_pid = os.getpid()
        preflight(need_tun=spec.mode == "tun")
        leftovers = tracking.find_leftovers()
        existing = set(tracking.list_namespaces())
        clash = [ns for ns in spec.namespaces if ns in existing]
        if leftovers:
            raise LeftoverNamespaces(
                f"refusing to start: network namespaces of an earlier emulated-cluster run still exist: "
                f"{', '.join(leftovers)}.\nRemove them with: {tracking.cleanup_hint(leftovers)}", leftovers)
        if clash:
            raise ClusterError(f"namespaces {clash} already exist and belong to a live cluster of this process")
        # From here on every exit path must end in close().
        try:
            self._active = True
            tracking.register_active(spec.run_prefix)
            self._save_state()
            self._install_handlers()
            atexit.register(self.close)
            self._arm_watchdog()
            for cmd in spec.namespace_commands():
                _run(cmd, "building the emulated cluster")
                if cmd[:3] == ["ip", "netns", "add"]:
                    self.created.append(cmd[3])
                    self._save_state()
            for cmd in spec.link_commands():
                _run(cmd, "creating the inter-node links")
            if spec.mode == "tun":
                self._start_relay()
            for cmd in spec.configure_commands():
                _run(cmd, "configuring the inter-node links")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Tear everything down; safe to call repeatedly and from a signal handler."""
        if os.getpid() != self._owner_pid:
            return  # a forked child inherited our atexit/signal hooks; the cluster is its parent's business
        main = threading.current_thread() is threading.main_thread()
        # Defer SIGINT/SIGTERM while tearing down: a second Ctrl-C must not cut the cleanup short. Pending
        # signals are delivered to the restored handlers right after.
        blocked = {signal.SIGINT, signal.SIGTERM}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked) if main else None
        try:
            with self._lock:
                if not self._active:
                    return
                self._teardown()
                self._active = False
                self._restore_handlers()
                atexit.unregister(self.close)
        finally:
            if old_mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _teardown(self) -> None:
        errors = []
        if self._relay is not None:
            tracking.stop_process(self._relay.pid, self._relay_marker())
            try:
                self._relay.wait(timeout=5)
            except subprocess.TimeoutExpired:
                errors.append(f"relay pid {self._relay.pid} did not exit")
        # Every existing namespace of the plan is ours: the names carry our unique prefix and start() checked
        # that none existed. Going by the plan, not `created`, also catches one whose `ip netns add` succeeded
        # just before a signal interrupted the bookkeeping.
        existing = set(tracking.list_namespaces())
        for ns in reversed([ns for ns in self.spec.namespaces if ns in existing]):
            # Ranks left running inside would keep the namespace alive, unnamed and unreachable.
            tracking.kill_namespace_processes(ns)
            proc = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True,
                                  timeout=COMMAND_TIMEOUT_S)
            if proc.returncode != 0 and ns in tracking.list_namespaces():
                errors.append(f"ip netns del {ns}: {proc.stderr.strip()}")
        if self._watchdog is not None:
            try:
                os.killpg(self._watchdog.pid, signal.SIGKILL)  # its `sleep` child too
            except ProcessLookupError:
                pass
            try:
                self._watchdog.wait(timeout=5)
            except subprocess.TimeoutExpired:
                errors.append(f"watchdog pid {self._watchdog.pid} did not exit")
        tracking.unregister_active(self.spec.run_prefix)
        if errors:
            self.teardown_errors = errors
            left = [ns for ns in self.spec.namespaces if ns in tracking.list_namespaces()]
            print(f"ds_asynchzp.netem: teardown incomplete: {'; '.join(errors)}\n"
                  f"{tracking.cleanup_hint(left) if left else ''}", file=sys.stderr)
        else:
            tracking.remove_state(self.spec.run_prefix)
        self.created = [ns for ns in self.spec.namespaces if ns in tracking.list_namespaces()] if errors else []

    # ----- signals, watchdog, relay ------------------------------------------------------------------------

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; atexit and the watchdog remain
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._prev_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        for sig, prev in self._prev_handlers.items():
            # Leave a handler alone that someone installed after us.
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._prev_handlers = {}

    def _on_signal(self, signum, frame) -> None:
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        self.close()
        # Then behave as if we had never been there.
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _arm_watchdog(self) -> None:
        """A shell in its own session that outlives a SIGKILL of this process: it waits while we live (at most
        ttl_s), then removes the relay, every process inside our namespaces, the namespaces and the state."""
        prefix = self.spec.run_prefix
        relay_pid_file = tracking.STATE_DIR / f"{prefix}.relay.pid"
        names = " ".join(self.spec.namespaces)
        script = (
            f"i=0; while [ $i -lt {int(self.ttl_s)} ] && kill -0 {os.getpid()} 2>/dev/null; "
            f"do sleep 1; i=$((i+1)); done; "
            f"p=$(cat {relay_pid_file} 2>/dev/null); "
            f"if [ -n \"$p\" ] && tr '\\0' ' ' < /proc/$p/cmdline 2>/dev/null "
            f"| grep -qF '{self._relay_marker()}'; then kill -9 $p; fi; "
            f"for ns in {names}; do ip netns pids $ns 2>/dev/null | xargs -r kill -9; "
            f"ip netns del $ns 2>/dev/null; done; "
            f"rm -f {tracking.STATE_DIR}/{prefix}.json {tracking.STATE_DIR}/{prefix}.relay.*")
        self._watchdog = subprocess.Popen(["sh", "-c", script, f"ahzp-netem-watchdog {prefix}"],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True)
        self._save_state()

    def _start_relay(self) -> None:
        spec = self.spec
        tracking.STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        log_path = tracking.STATE_DIR / f"{spec.run_prefix}.relay.log"
        # As a script: `-m ds_asynchzp.netem.relay` would import the package and with it torch (seconds, ~GB).
        cmd = [sys.executable, str(_RELAY_PATH), "--prefix", spec.run_prefix,
               "--delay-ms", repr(spec.delay_ms), "--mtu", str(spec.mtu), "--rate-bps", str(spec.rate_bps or 0),
               "--namespaces", *spec.node_namespaces, "--addresses", *spec.addresses]
        with open(log_path, "wb") as log:
            self._relay = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                           start_new_session=True)
        (tracking.STATE_DIR / f"{spec.run_prefix}.relay.pid").write_text(str(self._relay.pid))
        self._save_state()
        ready, _, _ = select.select([self._relay.stdout], [], [], RELAY_READY_TIMEOUT_S)
        line = self._relay.stdout.readline().decode(errors="replace").strip() if ready else ""
        if line != "ready":
            self._relay.poll()
            log_text = log_path.read_text(errors="replace")[-3000:]
            raise ClusterError(f"the TUN delay relay did not start (said {line!r}, exit code "
                               f"{self._relay.returncode}); its log {log_path}:\n{log_text}")

    def _relay_marker(self) -> str:
        # Identifies our relay in /proc/PID/cmdline (arguments joined by spaces), so a reused pid is never hit.
        return tracking.relay_marker(self.spec.run_prefix)

    def _save_state(self) -> None:
        tracking.write_state(self.spec.run_prefix, {
            "owner_pid": os.getpid(), "prefix": self.spec.run_prefix,
            "namespaces": self.spec.namespaces, "created": self.created,
            "relay_pid": self._relay.pid if self._relay else None,
            "watchdog_pid": self._watchdog.pid if self._watchdog else None,
        })

    # ----- what callers use --------------------------------------------------------------------------------

    @property
    def namespaces(self) -> list[str]:
        return list(self.spec.namespaces)

    @property
    def relay_pid(self) -> int | None:
        return self._relay.pid if self._relay is not None else None

    @property
    def watchdog_pid(self) -> int | None:
        return self._watchdog.pid if self._watchdog is not None else None

    def rank_prefix_cmd(self, rank: int, node_size: int | None = None) -> list[str]:
        """Command prefix that runs a rank inside its node's namespace (node = rank // node_size)."""
        size = node_size if node_size is not None else self.ranks_per_node
        if size is None:
            raise ValueError("rank_prefix_cmd needs node_size (or Cluster(ranks_per_node=...))")
        return ["ip", "netns", "exec", self.spec.node_namespaces[self.spec.node_of_rank(rank, size)]]

    def rank_env(self) -> dict[str, str]:
        """Environment overrides for ranks: rendezvous at node 0's address, gloo/tensorpipe bound to eth0
        (unset, gloo resolves the shared hostname, which no namespace can reach). On rails each rank binds to its
        own link: ``{local_rank}`` is filled per rank by the launcher (`bench.launch`)."""
        device = DEVICE if self.spec.links_per_node == 1 else RAIL_DEVICE_TEMPLATE
        return {"MASTER_ADDR": self.spec.addresses[0], "GLOO_SOCKET_IFNAME": device, "TP_SOCKET_IFNAME": device}

    def read_link_bytes(self) -> dict[int, dict]:
        """{node: {"tx": bytes, "rx": bytes, "links": {device: {"tx", "rx"}}}}: what really crossed each node's
        links, summed and per link (headers included; intra-node traffic goes over lo and never shows up here)."""
        if not self._active:
            raise ClusterError("the emulated cluster is not running")
        counts = {}
        for node, ns in enumerate(self.spec.node_namespaces):
            paths = [f"/sys/class/net/{dev}/statistics/{d}_bytes" for dev in self.spec.devices for d in ("tx", "rx")]
            out = _run(["ip", "netns", "exec", ns, "cat", *paths], f"reading link counters of node {node}")
            values = [int(v) for v in out.split()]
            links = {dev: {"tx": values[2 * k], "rx": values[2 * k + 1]} for k, dev in enumerate(self.spec.devices)}
            counts[node] = {"tx": sum(v["tx"] for v in links.values()), "rx": sum(v["rx"] for v in links.values()),
                            "links": links}
        return counts

    def read_tx_bytes(self) -> dict[int, int]:
        return {node: c["tx"] for node, c in self.read_link_bytes().items()}

    def read_rx_bytes(self) -> dict[int, int]:
        return {node: c["rx"] for node, c in self.read_link_bytes().items()}

    def __repr__(self) -> str:
        state = "up" if self._active else "down"
        return f"Cluster({self.spec.describe()}, {state})"
