"""The peer monitor (ds_asynchzp.scheduler.peer_monitor): which peers it judges by pid and which by heartbeat,
how many store reads it costs per heartbeat period, and that a killed rank or a whole killed node is named on
every survivor.

The unit tests run one monitor per rank in this process, on one in-memory store, and drive their polls by hand
(`_poll`), in rank order, so reads are counted exactly. Each rank's "process" is a `sleep` child: killing a rank
kills its child (its local peers see the pid end) and stops its polls (its heartbeat stops)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from contextlib import contextmanager

import pytest

from ds_asynchzp.bench.launch import launch_local
from ds_asynchzp.scheduler import peer_monitor
from ds_asynchzp.scheduler.peer_monitor import HEARTBEAT_EVERY, PeerMonitor
from tests.dist_harness import REPO_ROOT

SILENCE_S = 0.3       # REMOTE_SILENCE_S in the unit tests (20 s in a run)
ROUND_S = 0.01        # between two polls of every monitor
# A stopped heartbeat is named after SILENCE_S plus up to a heartbeat period (HEARTBEAT_EVERY rounds) and a round
# for the verdict to reach every rank: well under a second here, with slack for a loaded machine.
NAMED_WITHIN_S = SILENCE_S + 1.5


class CountingStore:
    """What the monitor uses of torch's Store, in memory; `get` blocks until the key exists, as torch's does.
    Counts requests: reads (get, check, multi_get) and writes (set)."""

    def __init__(self):
        self.data, self.reads, self.writes = {}, 0, 0
        self._cond = threading.Condition()

    def set(self, key, value):
        with self._cond:
            self.writes += 1
            self.data[key] = value.encode() if isinstance(value, str) else value
            self._cond.notify_all()

    def get(self, key):
        with self._cond:
            self.reads += 1
            assert self._cond.wait_for(lambda: key in self.data, timeout=10), f"no key {key}"
            return self.data[key]

    def multi_get(self, keys):
        with self._cond:
            self.reads += 1
            assert self._cond.wait_for(lambda: all(k in self.data for k in keys), timeout=10), keys
            return [self.data[k] for k in keys]

    def check(self, keys):
        with self._cond:
            self.reads += 1
            return all(k in self.data for k in keys)


class Ring:
    """`world` monitors; rank r on the host identity `node_of(r)`, all with this machine's hostname, and with the
    pid of its child unless `pid_of(r)` says another."""

    def __init__(self, world: int, node_of, pid_of=lambda rank: None):
        self.store = CountingStore()
        self.children = [subprocess.Popen(["sleep", "120"]) for _ in range(world)]
        self.exits = {}
        self.monitors = []
        for rank in range(world):
            monitor = PeerMonitor(rank, world, exit_process=lambda code, rank=rank: self.exits.setdefault(rank, code),
                                  store=self.store)
            monitor.prefix = "test/monitor"          # one engine on every rank: one prefix
            monitor.node, monitor.pid = node_of(rank), pid_of(rank) or self.children[rank].pid
            self.monitors.append(monitor)
        for monitor in self.monitors:
            monitor._announce()
        for monitor in self.monitors:
            monitor._meet_peers()
        self.running = set(range(world))

    def kill(self, *ranks) -> float:
        for rank in ranks:
            self.children[rank].kill()
            self.children[rank].wait()               # reaped: its pid is gone, as a dead peer's would be
            self.running.discard(rank)
        return time.monotonic()

    def close(self, rank: int) -> None:
        """The rank ends cleanly, the way `PeerMonitor.close` does it."""
        monitor = self.monitors[rank]
        monitor._thread = threading.Thread(target=monitor._stop.wait)   # stands for the poll thread
        monitor._thread.start()
        monitor.close()
        self.running.discard(rank)

    def poll_round(self) -> None:
        for rank in sorted(self.running):
            if self.monitors[rank]._poll():
                self.running.discard(rank)

    def run(self, seconds: float, until=lambda: False) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not until():
            self.poll_round()
            time.sleep(ROUND_S)

    def stop(self) -> None:
        for child in self.children:
            child.kill()
            child.wait()


@contextmanager
def ring(world: int, node_of, pid_of=lambda rank: None):
    made = Ring(world, node_of, pid_of)
    try:
        yield made
    finally:
        made.stop()


@pytest.fixture(autouse=True)
def fast_monitor(monkeypatch):
    monkeypatch.setattr(peer_monitor, "REMOTE_SILENCE_S", SILENCE_S)
    monkeypatch.setattr(peer_monitor, "STORE_HOST_LINGER_S", 0.0)


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_the_host_identity_is_the_boot_id_and_the_pid_namespace():
    identity = peer_monitor.host_identity()
    assert identity is not None, "readable on Linux"
    with open("/proc/sys/kernel/random/boot_id") as boot:
        assert identity.startswith(boot.read().strip() + "/pidns:")
    assert identity.endswith(f":{os.stat('/proc/self/ns/pid').st_ino}")


def test_a_peer_with_this_hostname_but_another_identity_is_judged_by_heartbeat(capfd):
    # Containers or cloned VMs with one hostname: the peer's pid means nothing here (here it has ended), yet the
    # peer is alive. Judged by hostname (the old logic), it was "lost" at the first poll.
    dead_here = _dead_pid()
    with ring(2, node_of=lambda rank: f"machine-{rank}", pid_of=lambda rank: dead_here if rank == 1 else None) as made:
        peer = made.monitors[0].peers[1]
        assert peer.host == made.monitors[0].host and not peer.local
        made.run(4 * SILENCE_S)                       # both alive: several silence periods without a verdict
        assert made.exits == {} and made.monitors[0].lost is None, capfd.readouterr().err
        killed = made.kill(1)
        made.run(10.0, until=lambda: 0 in made.exits)
        assert made.exits == {0: 1}
        assert made.monitors[0].lost.startswith("rank 1 was lost: its heartbeat"), made.monitors[0].lost
        assert time.monotonic() - killed < NAMED_WITHIN_S


def test_peers_of_this_identity_are_judged_by_pid_and_named_at_the_next_poll():
    with ring(4, node_of=lambda rank: "one-machine") as made:
        assert all(peer.local for monitor in made.monitors for peer in monitor.peers.values())
        made.run(0.1)
        made.kill(2)
        made.poll_round()
        made.poll_round()                              # the first poll finds it, the next one reads the verdict
        assert made.exits == {0: 1, 1: 1, 3: 1}
        assert all(made.monitors[r].lost.startswith("rank 2 was lost: its process") for r in (0, 1, 3))


def test_without_a_host_identity_every_peer_is_remote(monkeypatch):
    monkeypatch.setattr(peer_monitor, "host_identity", lambda: None)
    assert PeerMonitor(0, 2, store=CountingStore()).node is None
    with ring(3, node_of=lambda rank: None) as made:
        assert not any(peer.local for monitor in made.monitors for peer in monitor.peers.values())


def _reads_per_period(world: int, node_size: int) -> int:
    with ring(world, node_of=lambda rank: f"node-{rank // node_size}") as made:
        for _ in range(HEARTBEAT_EVERY):              # a first period: every watcher has read its target once
            made.poll_round()
        before = made.store.reads
        periods = 3
        for _ in range(periods * HEARTBEAT_EVERY):
            made.poll_round()
        assert made.exits == {}
        return (made.store.reads - before) // periods


@pytest.mark.parametrize("node_size", [1, 4])
def test_store_reads_per_heartbeat_period_grow_linearly_with_the_world(node_size):
    # Per rank and period: the verdict key at each of the HEARTBEAT_EVERY polls, and its target's heartbeat.
    # Before, every rank read every peer on another host each period: world * (4 + world - node_size) in all,
    # 28 / 88 / 304 for 4 / 8 / 16 ranks of one rank per host.
    counts = {world: _reads_per_period(world, node_size) for world in (4, 8, 16)}
    print(f"store reads per heartbeat period, node_size {node_size}: {counts}")
    for world, reads in counts.items():
        assert reads <= (HEARTBEAT_EVERY + 1) * world, counts
    assert counts[16] * 4 == counts[4] * 16, counts


def _run_until_every_survivor_ends(made) -> None:
    made.run(10.0, until=lambda: not made.running)
    assert not made.running, f"ranks {sorted(made.running)} still watching; verdicts: {made.exits}"


def test_a_killed_rank_on_its_own_host_is_named_on_every_survivor():
    # One rank per host identity (one container per rank): only its watcher, the rank before it, reads it.
    with ring(8, node_of=lambda rank: f"container-{rank}") as made:
        made.run(0.1)
        killed = made.kill(5)
        _run_until_every_survivor_ends(made)
        elapsed = time.monotonic() - killed
        survivors = [r for r in range(8) if r != 5]
        assert made.exits == {r: 1 for r in survivors}
        assert all(made.monitors[r].lost.startswith("rank 5 was lost: its heartbeat") for r in survivors)
        assert elapsed < NAMED_WITHIN_S, elapsed


@pytest.mark.parametrize("node", [1, 3])
def test_a_whole_killed_node_is_named_on_every_survivor(node):
    # Node `node` of 4 (4 ranks each) dies at once, the watchers of its ranks 2 to 4 with it: the last rank of
    # the node before, on another host, watches its first rank and names it.
    node_size, world = 4, 16
    with ring(world, node_of=lambda rank: f"node-{rank // node_size}") as made:
        made.run(0.1)
        dead = list(range(node * node_size, (node + 1) * node_size))
        killed = made.kill(*dead)
        _run_until_every_survivor_ends(made)
        elapsed = time.monotonic() - killed
        survivors = [r for r in range(world) if r not in dead]
        assert made.exits == {r: 1 for r in survivors}
        first = dead[0]
        assert all(made.monitors[r].lost.startswith(f"rank {first} was lost: its heartbeat") for r in survivors), \
            [made.monitors[r].lost for r in survivors]
        assert elapsed < NAMED_WITHIN_S, elapsed


@pytest.mark.parametrize("silent_node", [0, 1])
def test_a_diagnosis_names_the_silent_ranks_and_their_host(monkeypatch, silent_node):
    # What a rank whose collective failed says about ranks whose heartbeat stopped. A silent rank of its own host
    # identity is alive (its pid is checked), so stopped or hung; a whole node gone resets the connections to it,
    # and the collective fails long before its ranks' silence makes them lost: those may have ended.
    # The diagnosis watches the heartbeats for HEARTBEAT_EVERY + 1 polls (0.1 s here): a heartbeat every poll
    # lets a live rank show one in that window however busy the machine.
    monkeypatch.setattr(peer_monitor, "POLL_S", 0.05)
    monkeypatch.setattr(peer_monitor, "HEARTBEAT_EVERY", 1)
    with ring(4, node_of=lambda rank: f"node-{rank // 2}") as made:
        made.run(0.1)
        witness = made.monitors[3]
        witness._thread = threading.Thread(target=lambda: None)   # stands for its poll thread: it is diagnosing
        if silent_node == 1:
            made.kill(0, 1)
        else:
            made.running.discard(2)                    # rank 2 stops beating, its process alive (SIGSTOP)
        made.running.discard(3)
        beating = threading.Thread(target=made.run, args=(1.0,))   # the others keep polling meanwhile
        beating.start()
        text = witness.whereabouts(ticket=0)
        beating.join()
    host = witness.host  # every rank of the ring has this machine's hostname
    if silent_node == 1:
        assert f"no heartbeat for 0.1 s from rank(s) 0, 1 on {host}: stopped (SIGSTOP, a debugger), hung, or " \
               "ended (a node that went down silences all its ranks)" in text, text
    else:
        assert text.endswith(f"no heartbeat for 0.1 s from rank(s) 2 on {host}: stopped (SIGSTOP, a debugger) or "
                             "hung"), text


def test_a_rank_that_closed_hands_the_watch_on():
    # Rank 2 ends cleanly (not lost); its watcher, rank 1, then watches rank 3, which is killed later.
    with ring(4, node_of=lambda rank: f"container-{rank}") as made:
        made.run(0.1)
        made.close(2)
        made.run(4 * SILENCE_S)
        assert made.exits == {}
        assert made.monitors[1]._target == 3
        made.kill(3)
        _run_until_every_survivor_ends(made)
        assert made.exits == {0: 1, 1: 1}
        assert made.monitors[1].lost.startswith("rank 3 was lost") and made.monitors[0].lost == made.monitors[1].lost


# ------------------------------------------------------------------------ ranks in their own PID and UTS namespaces
SAME_HOSTNAME = "asynchzp-same-host"


def _namespaces_usable() -> str:
    try:
        done = subprocess.run(["unshare", "--pid", "--uts", "--fork", "--mount-proc", "hostname", SAME_HOSTNAME],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unshare cannot run: {error}"
    return "" if done.returncode == 0 else f"unshare --pid --uts --mount-proc is not permitted: {done.stderr.strip()}"


def _own_namespaces(rank: int) -> list:
    # A PID and UTS namespace per rank, one hostname for all. Each rank's pids start at a different number
    # (ns_last_pid; `"$@"` without exec, so the rank is the shell's child and takes the next pid): a peer's pid
    # then names no process in this rank's namespace, as on separate machines.
    script = f'hostname {SAME_HOSTNAME} && echo {10000 * (rank + 1)} > /proc/sys/kernel/ns_last_pid; "$@"'
    return ["unshare", "--pid", "--uts", "--fork", "--mount-proc", "sh", "-c", script, "sh"]


def test_ranks_in_own_pid_namespaces_with_one_hostname_train_to_the_end(tmp_path, deepspeed_cpu_ops):
    reason = _namespaces_usable()
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    # Two ranks (start-up dominates the cost), each its own node to the package as to the monitor.
    payload = {"steps": 3, "node_size": 1, "linger_s": 2.0}
    results = launch_local("tests._peer_monitor_workers:train_with_the_monitor_on", 2, 1, payload, timeout_s=120,
                           workdir=str(tmp_path), env={"PYTHONPATH": str(REPO_ROOT), "GLOO_SOCKET_IFNAME": "lo"},
                           rank_prefix_cmd=_own_namespaces)
    assert [r["rank"] for r in results] == [0, 1]
    assert {r["hostname"] for r in results} == {SAME_HOSTNAME}
    assert len({r["identity"] for r in results}) == 2, [r["identity"] for r in results]
    assert all(r["watching"] and r["local_peers"] == [] for r in results), results
    assert len({r["pid"] for r in results}) == 2, [r["pid"] for r in results]
