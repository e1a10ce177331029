"""Ends a rank whose peer died, with a message naming the lost rank, instead of letting it hang.

A rank killed mid-step (SIGKILL, out-of-memory killer) leaves its peers blocked in collectives: NCCL waits until
its watchdog fires (10 to 30 minutes), and a launcher that stops the other ranks says only which process ended.
Each rank publishes its hostname, pid and host identity in the rendezvous store at start. The host identity is
the kernel boot id with the PID namespace's inode: ranks with equal identities can see each other's pids, whatever
their hostnames say (containers and cloned VMs share hostnames; the hostname is kept only for messages). Where the
identity cannot be read (not Linux), every peer counts as on another host.

A daemon thread then checks, every half second, that every peer of the same identity is alive (its pid), and
watches one more rank, its target: the next rank in a ring over all ranks that has not closed. It reads the
target's heartbeat counter in the store once per heartbeat period (counters, not clocks: hosts need not agree on
the time); a target of another identity is lost when its counter stops for REMOTE_SILENCE_S, one of the same
identity is judged by its pid. Each rank thus reads one heartbeat per heartbeat period, and the lost-rank verdict
key once per poll: store reads grow with the world size, not its square. Whatever set of ranks dies (a whole node
with its watchers included), unless all do, some live rank's target is dead: walking the ring back from a dead
rank reaches a live one whose next rank is dead. A peer that ended cleanly marks itself closed first (also in its
heartbeat) and is not reported; its watcher takes the next rank as target, so the ring keeps no gap. When a peer is lost the rank that found it prints one line, publishes the verdict in the store
and ends; every other rank reads the verdict at its next poll (ranks whose collectives failed first also look for
it), prints it and ends.

A launcher that stops the surviving ranks itself (the `deepspeed` launcher sends SIGTERM once one rank dies)
may do so before the next poll: a SIGTERM handler, chained to the one it replaces, checks the peers of the same
identity once and names the lost rank before the rank ends; closing the monitor puts the replaced handler back.

A peer that is alive but stuck (stopped with SIGSTOP, hung in a kernel, or firing fewer hooks than its peers)
is not lost: the waits of this rank time out instead (`comm_timeout_s`). To say where every rank is then, each
rank publishes with its heartbeat the latest job it started in its issue order (`IssueOrder.snapshot`), and the
rank that timed out names the ranks that have not reached the job it waits on, and those whose heartbeat has
stopped.

Setting DS_ASYNCHZP_PEER_MONITOR=0 turns it off.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Dict, NamedTuple, Optional

import torch.distributed as dist

POLL_S = 0.5
HEARTBEAT_EVERY = 4          # polls between heartbeat bumps and target reads (2 s)
REMOTE_SILENCE_S = 20.0      # a remote peer whose heartbeat does not move this long is lost
STORE_HOST_LINGER_S = 3.0    # rank 0 (the store host) waits this long after publishing a lost peer
DIAGNOSIS_LINGER_S = 10.0    # rank 0 keeps the store up this long after its own timeout diagnosis
CLOSED = b"closed"           # the heartbeat of a rank that ended cleanly: its watcher moves on at once
_GENERATION = [0]            # engines made in this process so far: keys of one engine never mix with another's


def rendezvous_store():
    """The default group's rendezvous store, or None. torch keeps it private; what uses it (the monitor, the read
    agreement) is best-effort without it."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    return getter() if getter is not None else None



def host_identity() -> Optional[str]:
    """What tells this process's machine and PID namespace apart from any other: the kernel boot id (random at
    each boot, so distinct between machines and cloned VMs, which may share a hostname) and the PID namespace's
    device and inode (distinct between containers of one machine). Processes with equal identities see each
    other's pids. None where either cannot be read (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            boot_id = boot.read().strip()
        namespace = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{boot_id}/pidns:{namespace.st_dev}:{namespace.st_ino}" if boot_id else None


def _proc_is_ours() -> bool:
    # A /proc mounted for another PID namespace (`unshare --pid` without --mount-proc) numbers processes as that
    # namespace does: /proc/<pid> there is some other process, so it cannot tell a zombie.
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def _pid_alive(pid: int, read_proc: bool = True) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not read_proc:
        return True
    try:  # a killed process not yet reaped by its parent is a zombie: ended
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class Peer(NamedTuple):
    host: str        # hostname: for messages only, never to decide anything
    pid: int
    local: bool      # same host identity as this rank: its pid can be checked


class PeerMonitor:
    def __init__(self, rank: int, world: int, exit_process=None, progress=None, store=None):
        self.rank, self.world = rank, world
        self.progress = progress       # () -> this rank's position in its issue order, published with each poll
        self._published = None
        self.store = store if store is not None else rendezvous_store()
        _GENERATION[0] += 1
        self.prefix = f"asynchzp/monitor/{_GENERATION[0]}"
        self.host = socket.gethostname()
        self.node = host_identity()
        self.pid = os.getpid()
        self._read_proc = _proc_is_ours()
        self.peers: Dict[int, Peer] = {}
        self.lost: Optional[str] = None
        self.store_unreachable = False
        self._exit = exit_process or (lambda code: os._exit(code))
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._previous_sigterm = None
        self._polls = self._beats = 0
        self._target: Optional[int] = None     # the rank this one watches by heartbeat (see the module docstring)
        self._target_seen = None               # (its heartbeat, when it was first read)
        self._closed_peers = set()             # ranks known to have ended cleanly: watched no more

    def start(self) -> None:
        if self.store is None or self.world == 1 or os.environ.get("DS_ASYNCHZP_PEER_MONITOR", "1") == "0":
            return
        self._announce()
        self._meet_peers()
        # Created here rather than in scheduler.context: it exists per engine, like the communication threads,
        # and the context starts it.
        self._thread = threading.Thread(target=self._run, name="asynchzp-peer-monitor", daemon=True)
        self._thread.start()
        self._install_sigterm_handler()

    def _announce(self) -> None:
        record = {"host": self.host, "node": self.node, "pid": self.pid}
        self.store.set(f"{self.prefix}/peer/{self.rank}", json.dumps(record))
        self.store.set(f"{self.prefix}/beat/{self.rank}", "0")
        self._publish_progress()

    def _meet_peers(self) -> None:
        """Every peer's record (blocks until each has announced itself), read once at start: one request where the
        store answers several keys at once, since every rank reads every record."""
        others = [peer for peer in range(self.world) if peer != self.rank]
        keys = [f"{self.prefix}/peer/{peer}" for peer in others]
        try:
            values = self.store.multi_get(keys)
        except (AttributeError, NotImplementedError):  # a store without it
            values = [self.store.get(key) for key in keys]
        for peer, value in zip(others, values):
            record = json.loads(value.decode())
            local = self.node is not None and record["node"] == self.node
            self.peers[peer] = Peer(record["host"], int(record["pid"]), local)
        self._target = None if not others else (self.rank + 1) % self.world

    def _install_sigterm_handler(self) -> None:
        # Only a handler Python can chain to and put back is replaced: getsignal() answers None for one
        # installed outside Python. SIG_IGN is the program's choice and stays too.
        if threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGTERM)
        if current is None or current is signal.SIG_IGN:
            return
        self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _restore_sigterm_handler(self) -> None:
        if self._previous_sigterm is None or threading.current_thread() is not threading.main_thread():
            return
        # Put back only while ours is still the handler: one installed after it stays.
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        self._previous_sigterm = None

    def _on_sigterm(self, signum, frame) -> None:
        self._check_local_peers(exit_when_lost=False)
        # None once the monitor has closed: reached then only through a handler installed after ours.
        previous = self._previous_sigterm if self._previous_sigterm is not None else signal.SIG_DFL
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signum, frame)
        else:  # SIG_DFL: end the way the signal would have
            os.kill(os.getpid(), signal.SIGTERM)

    def _check_local_peers(self, exit_when_lost: bool) -> bool:
        """Every peer of this rank's host identity, by its pid: no store read unless one has ended."""
        for peer, (host, pid, local) in self.peers.items():
            if local and peer not in self._closed_peers and not _pid_alive(pid, self._read_proc):
                try:
                    if self._closed(peer):
                        self._closed_peers.add(peer)   # asked once: its pid stays ended
                        continue
                except Exception:  # noqa: BLE001 - store gone: see _closed
                    self.store_unreachable = True
                    return False
                self._report(peer, f"its process (pid {pid} on {host}) has ended", exit_when_lost)
                return True
        return False

    def explain(self, ticket: int = None, patience_s: float = 3.0):
        """Why a collective failed, if a peer is gone: 'rank R was lost: ...' (also printed). A peer that was just
        killed may take a moment to be reaped, so this looks for up to `patience_s`. Otherwise, for a job with a
        `ticket` in the issue order, where every rank is (`whereabouts`), else None."""
        lost = self._lost_peer(patience_s)
        if lost is None and ticket is not None and ticket >= 0:
            return self.whereabouts(ticket)
        return lost

    def _lost_peer(self, patience_s: float):
        if self.lost is None and self.peers:
            end = time.monotonic() + patience_s
            while time.monotonic() < end:
                if self._verdict_of_others() or self._check_local_peers(exit_when_lost=False):
                    break
                if self.store_unreachable:
                    return ("the rendezvous store is unreachable: the rank hosting it (MASTER_ADDR, usually rank 0) "
                            "has probably ended")
                time.sleep(0.1)
            if self.lost is not None:
                self._linger_if_store_host()
        return self.lost

    def _verdict_of_others(self) -> bool:
        """Another rank already found the lost peer (and published it): take its verdict."""
        key = f"{self.prefix}/lost"
        try:
            if not self.store.check([key]):
                return False
            verdict = self.store.get(key).decode()
        except Exception:  # noqa: BLE001 - store gone
            self.store_unreachable = True
            return False
        if self.lost is None:
            self.lost = verdict
            print(f"[ds_asynchzp] rank {self.rank}: {verdict}; ending this rank instead of waiting on collectives "
                  "that can never complete", file=sys.stderr, flush=True)
        return True

    def _linger_if_store_host(self) -> None:
        # The rendezvous store lives in rank 0's process: give the other ranks a moment to read the verdict
        # before it goes, or they could only say that the store vanished.
        if self.rank == 0:
            time.sleep(STORE_HOST_LINGER_S)

    def close(self) -> None:
        """This rank ends cleanly: tell the peers, then stop watching them."""
        if self._thread is None:
            return
        self._restore_sigterm_handler()
        self._stop.set()
        self._thread.join(5.0)
        self._thread = None
        try:
            self.store.set(f"{self.prefix}/closed/{self.rank}", "1")
            # In the heartbeat too: the rank watching this one reads only that, and moves on to the next.
            self.store.set(f"{self.prefix}/beat/{self.rank}", CLOSED)
        except Exception:  # noqa: BLE001 - the store may already be gone at interpreter exit
            pass

    def _closed(self, peer: int) -> bool:
        """Whether the peer ended cleanly. Raises when the store cannot say (its host ended): then nobody is
        accused, since a run whose store host finished is ending anyway."""
        return self.store.check([f"{self.prefix}/closed/{peer}"])

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                if self._poll():
                    return
            except Exception as error:  # noqa: BLE001 - the store went away: leave the run to its own errors
                print(f"[ds_asynchzp] rank {self.rank}: peer monitor stopped, rendezvous store unreachable: {error}",
                      file=sys.stderr, flush=True)
                return

    def _poll(self) -> bool:
        """One look at the peers; True once there is nothing more to watch (a rank was lost, the store is gone).
        Store reads: the verdict once, and every HEARTBEAT_EVERY polls the target's heartbeat."""
        self._polls += 1
        self._publish_progress()      # every poll: a rank that stops leaves a fresh position behind
        if self._polls % HEARTBEAT_EVERY == 0:
            self._beats += 1
            self.store.set(f"{self.prefix}/beat/{self.rank}", str(self._beats))
        if self._verdict_of_others():
            self._linger_if_store_host()
            self._exit(1)
            return True
        if self._check_local_peers(exit_when_lost=True) or self.store_unreachable:
            return True
        return self._polls % HEARTBEAT_EVERY == 0 and self._watch_target()

    def _watch_target(self) -> bool:
        """Read the target's heartbeat; report it when it has stopped on another host. A target of this rank's
        host identity is judged by its pid (`_check_local_peers`): its heartbeat only says whether it closed. A
        closed target hands the watch on to the next rank in the ring, read at the next period."""
        if self._target is None:
            return False
        peer = self._target
        value = self.store.get(f"{self.prefix}/beat/{peer}")
        if value != CLOSED and peer not in self._closed_peers:
            if self.peers[peer].local or not self._target_silent(value):
                return False
            if not self._closed(peer):  # raises when the store is gone: nobody accused
                self._report(peer, f"its heartbeat (on {self.peers[peer].host}) stopped {REMOTE_SILENCE_S:.0f} s ago")
                return True
        self._closed_peers.add(peer)
        self._target, self._target_seen = None, None
        for step in range(1, self.world):
            candidate = (peer + step) % self.world
            if candidate == self.rank:
                break                      # every other rank has closed: nothing left to watch
            if candidate not in self._closed_peers:
                self._target = candidate
                break
        return False

    def _target_silent(self, value: bytes) -> bool:
        now = time.monotonic()
        if self._target_seen is None or self._target_seen[0] != value:
            self._target_seen = (value, now)
            return False
        return now - self._target_seen[1] > REMOTE_SILENCE_S

    def _report(self, peer: int, why: str, exit_now: bool = True) -> None:
        if self.lost is None:
            self.lost = f"rank {peer} was lost: {why}"
            try:
                self.store.set(f"{self.prefix}/lost", self.lost)
            except Exception:  # noqa: BLE001 - store gone; the line below still names the rank
                pass
            print(f"[ds_asynchzp] rank {self.rank}: {self.lost}; ending this rank instead of waiting on collectives "
                  "that can never complete", file=sys.stderr, flush=True)
        if exit_now:
            self._linger_if_store_host()
            self._exit(1)

    # ------------------------------------------------------------------------------- where every rank is
    def _publish_progress(self) -> None:
        """This rank's position in its issue order, written to the store when it changed."""
        if self.progress is not None:
            text = json.dumps(self.progress())
            if text != self._published:
                self.store.set(f"{self.prefix}/progress/{self.rank}", text)
                self._published = text

    def _read_peers(self) -> Dict[int, tuple]:
        # Every peer's heartbeat and progress: 2 to 3 reads per peer, so O(world) per rank and O(world²) when
        # every rank does it. Only on a failure path (a wait that timed out), never per poll.
        out = {}
        for peer in self.peers:
            beat = self.store.get(f"{self.prefix}/beat/{peer}")
            key = f"{self.prefix}/progress/{peer}"
            progress = json.loads(self.store.get(key).decode()) if self.store.check([key]) else None
            out[peer] = (beat, progress)
        return out

    def whereabouts(self, ticket: int):
        """For a wait on job `ticket` that timed out: which ranks have not started that job yet (with the last job
        each did start), and which have stopped beating (a stopped or hung process). Takes one heartbeat period
        and a poll, to tell a live rank from a silent one. None when the peers cannot be read."""
        if not self.peers or self._thread is None:
            return None
        try:
            before = self._read_peers()
            time.sleep(HEARTBEAT_EVERY * POLL_S + POLL_S)
            after = self._read_peers()
        except Exception:  # noqa: BLE001 - the store went away
            return ("the rendezvous store is unreachable, so where the other ranks are is unknown: the rank hosting "
                    "it (MASTER_ADDR, usually rank 0) has probably ended first")
        finally:
            # Peers that time out a little later read this rank's store (rank 0 hosts it): stay that long.
            if self.rank == 0:
                time.sleep(DIAGNOSIS_LINGER_S)
        behind, silent = [], []
        for peer in sorted(after):
            beat, progress = after[peer]
            if beat == before[peer][0] and beat != CLOSED:
                silent.append(peer)
            if progress is not None and progress["started"] < ticket:
                behind.append(f"rank {peer} (last started {progress['what']}, as of its last report)")
        mine = self.progress() if self.progress is not None else None
        parts = [f"this rank waits on job #{ticket}" + (f" and last started {mine['what']}" if mine else "")]
        if behind:
            parts.append("ranks that have not reached it: " + ", ".join(behind))
        if silent:
            parts.append(self._describe_silent(silent))
        if not behind and not silent:
            parts.append("every rank has started it and is alive: a collective inside it is stuck (a rank issued "
                         "a different collective, or the network is down)")
        return "; ".join(parts)

    def _describe_silent(self, silent: list) -> str:
        """Ranks whose heartbeat stopped, with their hosts. One of this rank's host identity is alive (a dead one
        is named lost by its pid before any diagnosis), so stopped or hung; one on another host may as well have
        ended, with its whole node: a collective to it fails (connection reset) before REMOTE_SILENCE_S."""
        hosts = ", ".join(sorted({self.peers[peer].host for peer in silent}))
        if all(self.peers[peer].local for peer in silent):
            why = "stopped (SIGSTOP, a debugger) or hung"
        else:
            why = "stopped (SIGSTOP, a debugger), hung, or ended (a node that went down silences all its ranks)"
        return (f"no heartbeat for {HEARTBEAT_EVERY * POLL_S + POLL_S:.1f} s from rank(s) "
                f"{', '.join(map(str, silent))} on {hosts}: {why}")
