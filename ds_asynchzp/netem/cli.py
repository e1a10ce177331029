"""``asynchzp-cluster``: run one command per emulated node, as on a cluster of N machines joined by a slow link.

    asynchzp-cluster --nodes 2 --ranks-per-node 2 --bw 200mbit -- \\
        deepspeed --hostfile {hostfile} --no_ssh --node_rank {node_rank} --master_addr {master_addr} \\
        --master_port {master_port} --num_gpus 2 examples/train.py --deepspeed_config examples/ds_config_asynchzp.json

A `deepspeed` command that lacks the flags of a node without ssh (``--no_ssh``, ``--hostfile``, ``--node_rank``,
``--master_addr``, ``--master_port``) gets them added, as placeholders. Node i runs the command inside its network
namespace of a :class:`~.cluster.Cluster` and in its own UTS and PID namespaces (hostname ``node<i>``, its own pid
1), so launchers, ranks and the peer monitor see separate machines that share only the filesystem. Output lines come
back prefixed ``[node i]``; the exit code is the worst of the nodes'; the bytes that crossed each node link are
printed at the end (and written to ``--bytes-out``). Every exit path (the command ending or failing, ``--timeout``,
Ctrl-C / SIGTERM, an error here) stops every node process and removes the namespaces; if this process is SIGKILLed,
the cluster's watchdog does. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .cluster import Cluster, ClusterError
from .topology import MAX_NODES, EmulatedCluster, parse_delay_ms, parse_rate

PROG = "asynchzp-cluster"
DEFAULT_MASTER_PORT = 29500  # every node namespace is fresh: the usual port is always free there
TERMINATE_GRACE_S = 5.0      # SIGTERM to a node's process group, then SIGKILL of its PID namespace
POLL_S = 0.1
PLACEHOLDERS = ("node_rank", "nnodes", "master_addr", "master_port", "hostfile", "ranks_per_node")
# The node's pid 1 is this shell, not the command: the kernel drops signals without a handler sent to a
# namespace's init, so a command running as pid 1 would ignore the SIGTERM that stops a node. `exit $?` keeps
# the shell from exec'ing the command in its place.
_NODE_INIT = 'hostname "$0" || exit 125; "$@"; exit $?'


class UsageError(Exception):
    """Something to fix before anything is built; the message says what."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{PROG} --nodes N [options] -- COMMAND [ARG...]",
        description="Run COMMAND once per emulated node (network, UTS and PID namespaces) on this machine; "
                    "links between nodes shaped to --bw. Placeholders in COMMAND, filled per node: "
                    + ", ".join("{%s}" % name for name in PLACEHOLDERS) + ".",
        epilog=__doc__.split("\n\n")[1])
    p.add_argument("--nodes", type=int, default=2, help="number of nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=1, metavar="K",
                   help="slots per node in {hostfile} and {ranks_per_node} (default 1)")
    p.add_argument("--bw", default="200mbit",
                   help="rate of each node's link, tc syntax (200mbit, 1gbit) or 'unlimited' (default 200mbit)")
    p.add_argument("--delay", default=None, metavar="MS", help="one-way delay between nodes in ms (TUN relay)")
    p.add_argument("--mtu", type=int, default=None, help="link MTU (default 1500; 9000 with --delay)")
    p.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT, help=f"default {DEFAULT_MASTER_PORT}")
    p.add_argument("--hostname", default="node{node_rank}",
                   help="hostname of each node; a name without {node_rank} gives every node the same one "
                        "(default node{node_rank})")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="stop every node after S seconds")
    p.add_argument("--grace", type=float, default=30.0, metavar="S",
                   help="after a node fails, the others get S seconds to end by themselves (their ranks notice the "
                        "lost peer and name it) before they are stopped (default 30)")
    p.add_argument("--bytes-out", metavar="FILE", help="write the link byte counts as JSON to FILE")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]")
    return p


def check_before_building(args) -> None:
    """Every error that can be found without creating anything, with the fix."""
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        raise UsageError(f"no command given: {PROG} --nodes 2 -- COMMAND [ARG...]")
    if args.ranks_per_node < 1:
        raise UsageError(f"--ranks-per-node must be >= 1, got {args.ranks_per_node}")
    if not 1 <= args.master_port <= 65535:
        raise UsageError(f"--master-port must be in 1..65535, got {args.master_port}")
    for flag, value in (("--timeout", args.timeout), ("--grace", args.grace)):
        if value is not None and value < 0:
            raise UsageError(f"{flag} must be >= 0 seconds, got {value:g}")
    if not 2 <= args.nodes <= MAX_NODES:
        raise UsageError(f"--nodes must be in 2..{MAX_NODES}, got {args.nodes}")
    try:
        parse_rate(args.bw, "--bw")
        parse_delay_ms(args.delay, "--delay")
        EmulatedCluster.create(args.nodes, args.bw, args.delay, args.mtu)  # the MTU, against the link mode
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if os.geteuid() != 0:
        raise UsageError(f"{PROG} needs root (it creates network, UTS and PID namespaces); run it as root, "
                         f"e.g. `sudo -E env PATH=\"$PATH\" {PROG} ...`")
    if shutil.which("unshare") is None:
        raise UsageError("the 'unshare' command (util-linux) is not on PATH; install util-linux "
                         "(apt-get install util-linux)")
    probe = subprocess.run(["unshare", "--uts", "--pid", "--fork", "--mount-proc", "--kill-child", "true"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        raise UsageError("cannot give nodes their own UTS and PID namespaces: `unshare --uts --pid --fork "
                         f"--mount-proc true` failed: {probe.stderr.strip()}; run on a host or in a privileged "
                         "container (CAP_SYS_ADMIN)")


def fill(words: list[str], values: dict) -> list[str]:
    """Replace the known {placeholders} only, so other braces (a `python -c` body, a JSON argument) pass through."""
    pattern = re.compile(r"\{(%s)\}" % "|".join(values))
    return [pattern.sub(lambda m: str(values[m.group(1)]), word) for word in words]


# What DeepSpeed's launcher needs to start one node's ranks of a multi-node job without ssh.
_DEEPSPEED_NODE_FLAGS = (("--hostfile", "{hostfile}"), ("--node_rank", "{node_rank}"),
                         ("--master_addr", "{master_addr}"), ("--master_port", "{master_port}"))


def complete_deepspeed_command(words: list[str]) -> tuple[list[str], list[str]]:
    """A `deepspeed` launcher command with what each node needs added where it lacks it (`--no_ssh` and the
    hostfile, node rank and master flags, as placeholders), right after the launcher's name, where the launcher's
    own options go; and the words added. Any other command is returned as it is."""
    if not words or os.path.basename(words[0]) != "deepspeed":
        return words, []
    # The launcher's options end at the script: only those count (the script may take flags of the same names).
    script = next((i for i, word in enumerate(words[1:], 1) if not word.startswith("-")
                   and not words[i - 1].startswith("--") or word.endswith(".py")), len(words))
    options = words[1:script]
    given = {word.split("=", 1)[0] for word in options if word.startswith("--")}
    added = [] if "--no_ssh" in given else ["--no_ssh"]
    for flag, placeholder in _DEEPSPEED_NODE_FLAGS:
        if flag not in given:
            added += [flag, placeholder]
    return [words[0], *added, *words[1:]], added


def write_hostfile(directory: Path, nodes: int, slots: int) -> Path:
    # The deepspeed launcher needs it even with --no_ssh, identical on every node; the names are labels only
    # (never resolved) and their order is the node order.
    path = directory / "hostfile"
    path.write_text("".join(f"node{i} slots={slots}\n" for i in range(nodes)))
    return path


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal S: 128 + S, as shells say


def _describe(code: int) -> str:
    if code > 128:
        try:
            return f"exit code {code} (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exit code {code}"


class Node:
    def __init__(self, index: int, proc: subprocess.Popen):
        self.index, self.proc = index, proc
        self.stopped = False     # we stopped it: its exit code says nothing about the command
        self.reader: threading.Thread | None = None

    @property
    def code(self) -> int | None:
        return None if self.proc.returncode is None else _exit_code(self.proc.returncode)

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the node's session: started with start_new_session
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        # SIGKILL to `unshare` makes it SIGKILL its child (--kill-child), the PID namespace's init; the kernel then
        # kills every process of the namespace, also those that left the process group (setsid, daemons). Once
        # `unshare` is reaped nothing of the node is left, and its pid may belong to someone else: hands off.
        if self.proc.poll() is None:
            self.signal_group(signal.SIGKILL)
            self.proc.kill()


class Runner:
    def __init__(self, args):
        self.args = args
        # A fresh namespace prefix per cluster (Cluster picks it); start() refuses leftovers of killed runs.
        self.cluster = Cluster(args.nodes, args.bw, args.delay, args.mtu, ranks_per_node=args.ranks_per_node)
        self.spec = self.cluster.spec
        self.nodes: list[Node] = []
        self.signalled: int | None = None
        self._out_lock = threading.Lock()
        self._previous_handlers: dict = {}

    def say(self, text: str) -> None:
        self._write(f"[{PROG}] {text}\n", sys.stderr)

    def _write(self, text: str, stream) -> None:
        with self._out_lock:
            stream.write(text)
            stream.flush()

    # ----- signals: turn SIGTERM / SIGINT / SIGHUP into an orderly stop of every node ------------------------
    def _on_signal(self, signum, frame) -> None:
        if self.signalled is None:
            self.signalled = signum

    def _install_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        for sig, previous in self._previous_handlers.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)

    # ----- nodes -----------------------------------------------------------------------------------------------
    def node_env(self, cluster: Cluster, index: int) -> dict:
        env = dict(os.environ)
        env.update(cluster.rank_env())  # MASTER_ADDR = node 0's address, gloo/tensorpipe bound to eth0
        env.update(NODE_RANK=str(index), NNODES=str(self.spec.num_nodes), MASTER_PORT=str(self.args.master_port))
        # CPU ranks: no accelerator probing, gloo; one OpenMP thread per core share instead of every rank
        # spinning on every core. A value the user exported wins.
        env.setdefault("DS_ACCELERATOR", "cpu")
        ranks = self.spec.num_nodes * self.args.ranks_per_node
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
        env.setdefault("PYTHONUNBUFFERED", "1")  # lines arrive as they are printed, and survive a kill
        return env

    def start_node(self, cluster: Cluster, index: int, values: dict) -> Node:
        command = fill(self.args.command, values)
        hostname = fill([self.args.hostname], values)[0]
        argv = ["ip", "netns", "exec", self.spec.node_namespaces[index],
                "unshare", "--uts", "--pid", "--fork", "--mount-proc", "--kill-child",
                "sh", "-c", _NODE_INIT, hostname, *command]
        # Own session: one killpg reaches the launcher and the ranks it starts (the deepspeed launcher does not
        # forward signals to its ranks in --no_ssh mode).
        proc = subprocess.Popen(argv, env=self.node_env(cluster, index), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        node = Node(index, proc)
        node.reader = threading.Thread(target=self._relay_output, args=(node,), daemon=True,
                                       name=f"{PROG}-node{index}")
        node.reader.start()
        return node

    def _relay_output(self, node: Node) -> None:
        for raw in iter(node.proc.stdout.readline, b""):
            self._write(f"[node {node.index}] {raw.decode(errors='replace').rstrip()}\n", sys.stdout)
        node.proc.stdout.close()

    def stop(self, nodes: list[Node], why: str) -> None:
        """SIGTERM to each node's process group (handlers may still clean up), then SIGKILL of its namespace."""
        running = [n for n in nodes if n.proc.poll() is None]
        if not running:
            return
        self.say(f"{why}: stopping node(s) {', '.join(str(n.index) for n in running)}")
        for node in running:
            node.stopped = True
            node.signal_group(signal.SIGTERM)
        end = time.monotonic() + TERMINATE_GRACE_S
        while time.monotonic() < end and any(n.proc.poll() is None for n in running):
            time.sleep(POLL_S)
        for node in running:
            node.kill()
        for node in running:
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.say(f"node {node.index} (pid {node.proc.pid}) did not exit after SIGKILL; "
                         "the cluster teardown kills what is left in its namespace")

    def supervise(self) -> int:
        """Wait for every node, saying when each ends; on a failure (after --grace), a timeout or a signal, stop
        the rest. Returns the worst exit code of the nodes that ended by themselves, else why we stopped them."""
        args = self.args
        deadline = time.monotonic() + args.timeout if args.timeout else None
        failed_at = forced = None
        announced = set()
        while True:
            if forced is None and self.signalled is not None:
                forced = 128 + self.signalled
                self.stop(self.nodes, f"received {signal.Signals(self.signalled).name}")
            elif forced is None and deadline is not None and time.monotonic() > deadline:
                forced = 124  # as timeout(1)
                self.stop(self.nodes, f"the command did not end within --timeout {args.timeout:g} s")
            elif forced is None and failed_at is not None and time.monotonic() - failed_at > args.grace:
                forced = 1
                self.stop(self.nodes, f"a node failed {args.grace:g} s ago (--grace)")
            for node in self.nodes:
                if node.index in announced or node.proc.poll() is None:
                    continue
                announced.add(node.index)
                self.say(f"node {node.index} {'was stopped' if node.stopped else 'ended'}: {_describe(node.code)}")
                if node.code and not node.stopped and failed_at is None and len(announced) < len(self.nodes):
                    failed_at = time.monotonic()
                    self.say(f"the other nodes get {args.grace:g} s (--grace) to end by themselves")
            if len(announced) == len(self.nodes) or forced is not None:  # after a stop every node is dead
                break
            time.sleep(POLL_S)
        own = [n.code for n in self.nodes if not n.stopped and n.code]
        return max(own) if own else (forced or 0)

    def report_bytes(self, before: dict, after: dict, code: int, seconds: float) -> None:
        links = {node: {k: after[node][k] - before[node][k] for k in ("tx", "rx")} for node in after}
        total = sum(c["tx"] for c in links.values())
        per_node = "; ".join(f"node {n} tx {c['tx']} rx {c['rx']}" for n, c in links.items())
        self._write(f"[{PROG}] link bytes (eth0 frames, headers included): {per_node}; total tx {total}\n",
                    sys.stdout)
        if self.args.bytes_out:
            spec = self.spec
            record = {"nodes": spec.num_nodes, "ranks_per_node": self.args.ranks_per_node, "bw": self.args.bw,
                      "rate_bps": spec.rate_bps, "delay_ms": spec.delay_ms, "mtu": spec.mtu, "mode": spec.mode,
                      "exit_code": code, "seconds": round(seconds, 3), "total_tx_bytes": total,
                      "links": {str(n): c for n, c in links.items()},
                      "before": {str(n): c for n, c in before.items()},
                      "after": {str(n): c for n, c in after.items()}}
            Path(self.args.bytes_out).write_text(json.dumps(record, indent=2) + "\n")

    def run(self) -> int:
        workdir = Path(tempfile.mkdtemp(prefix=f"{PROG}-"))
        try:
            with self.cluster as cluster:
                # After the cluster's own handlers (which only tear the cluster down): ours also stop the nodes.
                self._install_handlers()
                try:
                    return self._run_nodes(cluster, workdir)
                finally:
                    self.stop(self.nodes, "cleaning up")  # an error here: no node may outlive us
                    self._restore_handlers()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _run_nodes(self, cluster: Cluster, workdir: Path) -> int:
        spec = self.spec
        self.args.command, added = complete_deepspeed_command(self.args.command)
        if added:
            self.say(f"added to the deepspeed command on every node: {' '.join(added)}")
        hostfile = write_hostfile(workdir, spec.num_nodes, self.args.ranks_per_node)
        self.say(f"{spec.describe()}; node 0 at {spec.addresses[0]}:{self.args.master_port}; hostfile {hostfile}")
        before, start = cluster.read_link_bytes(), time.monotonic()
        for index in range(spec.num_nodes):
            values = {"node_rank": index, "nnodes": spec.num_nodes, "master_addr": spec.addresses[0],
                      "master_port": self.args.master_port, "hostfile": hostfile,
                      "ranks_per_node": self.args.ranks_per_node}
            self.nodes.append(self.start_node(cluster, index, values))
        code = self.supervise()
        for node in self.nodes:  # the last lines of output before the summary
            node.reader.join(timeout=5)
        self.report_bytes(before, cluster.read_link_bytes(), code, time.monotonic() - start)
        return code


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        check_before_building(args)
        return Runner(args).run()
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except ClusterError as exc:  # no rights for namespaces, leftovers of a killed run, a failed ip/tc command
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
