"""Userspace L3 relay that adds a one-way delay between emulated nodes (the kernel here has no netem).

Started by :class:`~ds_asynchzp.netem.cluster.Cluster` as a plain script (standard library only, so it does not
import torch): ``python .../relay.py --prefix P --delay-ms D --mtu M --rate-bps R --namespaces NS... --addresses A...``
(``python -m ds_asynchzp.netem.relay`` works too).

For each node namespace it enters the namespace, opens ``/dev/net/tun`` as ``eth0`` (the device is created in the
opener's namespace) and returns to its own namespace. Every IPv4 packet a node sends comes out of that node's tun
fd; the relay hands it to the tun fd of the node owning the destination address once the delay has passed.
Rate limiting stays in the kernel (a tbf on each tun ``eth0``, which gives TCP back-pressure); with more than two
nodes the relay also meters each output port with a 2 ms token bucket, so senders to one node share its downlink.

Prints ``ready`` on stdout once all devices exist. Exits on SIGTERM, when its parent dies, or when a device
disappears (its namespace was deleted). Closing the fds removes the tun devices.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import os
import select
import signal
import socket
import struct
import sys
import time
from collections import deque

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
DEVICE = "eth0"
# Reads per device per wake-up: bounds the time one busy sender can starve the others' delivery.
READ_BATCH = 64
# Drop instead of growing without bound if a destination stops accepting packets.
MAX_QUEUED_PACKETS = 200_000
# Longest sleep, so a dead parent is noticed within this time even on an idle link.
IDLE_WAKE_S = 0.5
DOWNLINK_BUCKET_S = 0.002  # a strict serialiser in series with tbf lost ~30 % of the rate; 2 ms of slack does not
# Reading a tun fd whose device went away with its namespace fails with one of these.
_GONE_ERRNOS = {errno.EBADFD, errno.EIO, errno.ENODEV, errno.ENXIO}

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _netns_path(name: str) -> str:
    for base in ("/run/netns", "/var/run/netns"):
        path = os.path.join(base, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"network namespace {name!r} not found under /run/netns")


def open_tun_in_namespace(namespace: str, home_fd: int) -> int:
    """Create tun device eth0 inside `namespace`; return its non-blocking fd. Always returns to `home_fd`."""
    target = os.open(_netns_path(namespace), os.O_RDONLY)
    try:
        _setns(target)
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            try:
                fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", DEVICE.encode(), IFF_TUN | IFF_NO_PI))
            except BaseException:
                os.close(fd)
                raise
        finally:
            _setns(home_fd)
    finally:
        os.close(target)
    return fd


class Port:
    """One node's tun device: packets waiting for delivery to it, and its downlink token bucket."""

    def __init__(self, fd: int, address: bytes, rate_Bps: float | None, mtu: int):
        self.fd = fd
        self.address = address
        self.queue: deque[tuple[float, bytes]] = deque()
        self.rate_Bps = rate_Bps
        self.bucket = max(rate_Bps * DOWNLINK_BUCKET_S, 2 * mtu) if rate_Bps else 0.0
        self.tokens = self.bucket
        self.refilled_at = time.monotonic()
        self.dropped = 0

    def deliver_due(self, now: float) -> float | None:
        """Write every packet that is due (and allowed by the bucket); return when to look again, or None."""
        while self.queue:
            due, packet = self.queue[0]
            if due > now:
                return due
            if self.rate_Bps:
                self.tokens = min(self.bucket, self.tokens + (now - self.refilled_at) * self.rate_Bps)
                self.refilled_at = now
                if self.tokens <= 0:
                    return now + (-self.tokens + 1) / self.rate_Bps
                self.tokens -= len(packet)
            self.queue.popleft()
            try:
                os.write(self.fd, packet)
            except BlockingIOError:
                self.dropped += 1  # like a full NIC ring: TCP retransmits
            except OSError as exc:
                if exc.errno == errno.EBADFD:
                    raise  # the device was destroyed with its namespace
                self.dropped += 1  # e.g. EIO: the device is not up yet
        return None


def run(namespaces: list[str], addresses: list[str], delay_s: float, mtu: int, rate_bps: int) -> int:
    parent = os.getppid()
    home_fd = os.open("/proc/self/ns/net", os.O_RDONLY)
    # Two nodes: the sender's tbf is the whole link; rate 0: unshaped links.
    meter = rate_bps / 8 if len(namespaces) > 2 and rate_bps else None
    ports = [Port(open_tun_in_namespace(ns, home_fd), socket.inet_aton(addr), meter, mtu)
             for ns, addr in zip(namespaces, addresses)]
    os.close(home_fd)
    by_address = {port.address: port for port in ports}
    by_fd = {port.fd: port for port in ports}
    fds = list(by_fd)
    read_size = mtu + 64
    print("ready", flush=True)

    while True:
        now = time.monotonic()
        wake = now + IDLE_WAKE_S
        for port in ports:
            try:
                when = port.deliver_due(now)
            except OSError as exc:
                print(f"relay: cannot deliver to {socket.inet_ntoa(port.address)} ({exc}); exiting", file=sys.stderr)
                return 0
            if when is not None and when < wake:
                wake = when
        readable, _, _ = select.select(fds, [], [], max(0.0, wake - time.monotonic()))
        now = time.monotonic()
        due = now + delay_s
        for fd in readable:
            source = by_fd[fd]
            for _ in range(READ_BATCH):
                try:
                    packet = os.read(fd, read_size)
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno in _GONE_ERRNOS:
                        print(f"relay: device of {socket.inet_ntoa(source.address)} gone ({exc}); exiting", file=sys.stderr)
                        return 0
                    raise
                if not packet:
                    return 0
                # IPv4 only: the emulated subnet is IPv4; IPv6 router solicitations and the like are dropped.
                if len(packet) < 20 or packet[0] >> 4 != 4:
                    continue
                target = by_address.get(packet[16:20])
                if target is None or target is source:
                    continue
                if len(target.queue) >= MAX_QUEUED_PACKETS:
                    target.dropped += 1
                    continue
                target.queue.append((due, packet))
        if os.getppid() != parent:
            print("relay: parent exited; exiting", file=sys.stderr)
            return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_asynchzp.netem.relay", description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", required=True, help="run prefix (identifies this relay to cleanup tools)")
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--mtu", type=int, required=True)
    parser.add_argument("--rate-bps", type=int, required=True)
    parser.add_argument("--namespaces", nargs="+", required=True)
    parser.add_argument("--addresses", nargs="+", required=True)
    args = parser.parse_args(argv)
    if len(args.namespaces) != len(args.addresses):
        parser.error("--namespaces and --addresses must have the same length")
    # Stopped by SIGTERM from its owner; Ctrl-C in the owner's terminal is the owner's business.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return run(args.namespaces, args.addresses, args.delay_ms / 1000.0, args.mtu, args.rate_bps)


if __name__ == "__main__":
    sys.exit(main())
