"""Tests for ds_asynchzp.netem: topology planning (no root) and real emulated clusters (root + namespaces)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_asynchzp.bench.launch import launch_local
from ds_asynchzp.netem import Cluster, EmulatedCluster, EmulationUnavailable, LeftoverNamespaces, preflight
from ds_asynchzp.netem import tracking
from ds_asynchzp.netem.topology import cpu_mask, parse_delay_ms, parse_rate, tbf_burst_bytes

REPO_ROOT = Path(__file__).resolve().parent.parent
CHILD_ENV = {"PYTHONPATH": str(REPO_ROOT)}
WORKER = "tests._netem_workers:allreduce_phases"
NUMEL = 1 << 20  # 4 MiB of fp32: large enough to stand out from rendezvous and barrier traffic
TENSOR_BYTES = NUMEL * 4


# ----- planning, no root needed --------------------------------------------------------------------------------

@pytest.mark.parametrize("text,bits", [("200mbit", 200_000_000), ("1gbit", 10**9), ("1.5GBit", 1_500_000_000),
                                       ("800kbit", 800_000), ("10mbps", 80_000_000), (5_000_000, 5_000_000),
                                       ("250000000", 250_000_000)])
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "200 mbits", "-5mbit", "", "1kbit", "1000gbit"])
def test_parse_rate_errors_name_the_flag(text):
    with pytest.raises(ValueError, match="--inter-node-bw"):
        parse_rate(text)


def test_unlimited_keeps_the_namespaces_and_drops_the_shaping():
    assert parse_rate("unlimited") is None and parse_rate("Unlimited") is None
    for nodes in (2, 3):
        spec = EmulatedCluster.create(nodes, "unlimited")
        commands = spec.setup_commands()
        assert not [c for c in commands if c[0] == "tc"]
        assert len([c for c in commands if c[:3] == ["ip", "netns", "add"]]) == len(spec.namespaces)
        assert "unshaped links" in spec.describe()


def test_parse_delay():
    assert parse_delay_ms(None) is None
    assert parse_delay_ms(0) is None  # no delay: plain veth links
    assert parse_delay_ms("2.5") == 2.5
    assert parse_delay_ms("1ms") == 1.0
    for bad in ("-1", "soon", "nan", "99999"):
        with pytest.raises(ValueError, match="--inter-node-delay"):
            parse_delay_ms(bad)


def test_burst_sizing():
    assert tbf_burst_bytes(200_000_000, 1500) == 50_000  # 2 ms of traffic
    assert tbf_burst_bytes(1_000_000_000, 1500) == 250_000
    assert tbf_burst_bytes(10_000_000, 1500) == 32 * 1024  # floor
    assert tbf_burst_bytes(10_000_000, 9000) == 36_000  # 4 packets
    spec = EmulatedCluster.create(2, "200mbit")
    tbf = [c for c in spec.setup_commands() if c[0] == "tc"]
    assert len(tbf) == 2
    assert all(c[c.index("burst") + 1] == "50000" and c[c.index("rate") + 1] == "200000000bit" for c in tbf)
    assert all(c[c.index("latency") + 1] == "50ms" and "add" in c and "replace" not in c for c in tbf)


def test_cpu_mask():
    assert cpu_mask(1) == "00000001"
    assert cpu_mask(2) == "00000003"
    assert cpu_mask(40) == "000000ff,ffffffff"


def test_two_node_plan():
    spec = EmulatedCluster.create(2, "200mbit", run_prefix="ahzp42")
    assert spec.mode == "veth" and spec.mtu == 1500 and spec.switch_namespace is None
    assert spec.namespaces == ["ahzp42n0", "ahzp42n1"]
    assert spec.addresses == ["10.200.0.1", "10.200.0.2"]
    cmds = [" ".join(c) for c in spec.setup_commands()]
    assert cmds[0] == "ip netns add ahzp42n0"
    assert "ip link add eth0 netns ahzp42n0 type veth peer name eth0 netns ahzp42n1" in cmds
    assert "ip -n ahzp42n1 addr add 10.200.0.2/24 dev eth0" in cmds
    assert "ip -n ahzp42n0 link set lo up" in cmds
    assert "ip netns exec ahzp42n1 sysctl -q -w net.ipv4.tcp_congestion_control=reno" in cmds
    assert any("rps_cpus" in c and c.startswith("ip netns exec ahzp42n0") for c in cmds)
    assert not any("bridge" in c for c in cmds)
    for c in spec.setup_commands() + spec.teardown_commands():
        assert _stays_inside(c, "ahzp42"), c
    assert spec.teardown_commands() == [["ip", "netns", "del", "ahzp42n1"], ["ip", "netns", "del", "ahzp42n0"]]


def _stays_inside(cmd: list[str], prefix: str) -> bool:
    """True if the command only acts inside namespaces named `prefix...`: no host interface is touched."""
    if cmd[:3] in (["ip", "netns", "add"], ["ip", "netns", "del"], ["ip", "netns", "exec"]):
        return cmd[3].startswith(prefix)
    if cmd[0] in ("ip", "tc") and cmd[1] == "-n":
        return cmd[2].startswith(prefix)
    if cmd[:3] == ["ip", "link", "add"]:  # a veth: both ends are created directly inside namespaces
        targets = [cmd[i + 1] for i, word in enumerate(cmd) if word == "netns"]
        return len(targets) == 2 and all(t.startswith(prefix) for t in targets)
    return False


def test_more_nodes_use_a_bridge_shaped_both_ways():
    spec = EmulatedCluster.create(4, "1gbit", run_prefix="ahzp7")
    assert spec.switch_namespace == "ahzp7sw"
    assert spec.namespaces[-1] == "ahzp7sw"
    cmds = [" ".join(c) for c in spec.setup_commands()]
    assert "ip -n ahzp7sw link add br0 type bridge" in cmds
    assert "ip link add eth0 netns ahzp7n3 type veth peer name p3 netns ahzp7sw" in cmds
    assert "ip -n ahzp7sw link set p3 master br0" in cmds
    tbf_devices = [(c.split()[2], c.split()[6]) for c in cmds if c.startswith("tc ")]
    assert len(tbf_devices) == 8  # uplink per node + downlink per switch port
    assert ("ahzp7sw", "p0") in tbf_devices and ("ahzp7n0", "eth0") in tbf_devices
    assert spec.addresses[-1] == "10.200.0.4"
    assert ["ip", "netns", "del", "ahzp7sw"] == spec.teardown_commands()[0]
    for c in spec.setup_commands():
        assert _stays_inside(c, "ahzp7"), c


def test_delay_plan_uses_tun_relay():
    spec = EmulatedCluster.create(3, "100mbit", delay_ms=1, run_prefix="ahzp9")
    assert spec.mode == "tun" and spec.mtu == 9000 and spec.switch_namespace is None
    assert spec.link_commands() == []  # the relay creates the devices
    assert any(c[0] == "tc" for c in spec.configure_commands())
    assert EmulatedCluster.create(2, "100mbit", delay_ms=1, mtu=1500).mtu == 1500


def test_plan_validation():
    with pytest.raises(ValueError, match="nodes"):
        EmulatedCluster.create(1, "100mbit")
    with pytest.raises(ValueError, match="--mtu"):
        EmulatedCluster.create(2, "100mbit", mtu=100)
    with pytest.raises(ValueError, match="ahzp"):
        EmulatedCluster.create(2, "100mbit", run_prefix="node")


def test_rails_plan_one_network_per_rail():
    """Rails: every node has eth0..eth<R-1>, rail r on 10.200.r.0/24 with its own veth pair (2 nodes) or bridge (more),
    every device shaped, reverse-path filtering off; a delay (one relay link per node) is refused."""
    two = EmulatedCluster.create(2, "200mbit", run_prefix="ahzp5", links_per_node=2)
    assert two.topology == "rails" and two.devices == ["eth0", "eth1"] and two.addresses == ["10.200.0.1", "10.200.0.2"]
    cmds = [" ".join(c) for c in two.setup_commands()]
    assert "ip link add eth1 netns ahzp5n0 type veth peer name eth1 netns ahzp5n1" in cmds
    assert "ip -n ahzp5n1 addr add 10.200.1.2/24 dev eth1" in cmds
    assert "ip netns exec ahzp5n0 sysctl -q -w net.ipv4.conf.all.rp_filter=0" in cmds
    assert sum(c.startswith("tc ") for c in cmds) == 4
    four = EmulatedCluster.create(4, "1gbit", run_prefix="ahzp6", links_per_node=2)
    cmds = [" ".join(c) for c in four.setup_commands()]
    assert "ip -n ahzp6sw link add br1 type bridge" in cmds
    assert "ip link add eth1 netns ahzp6n3 type veth peer name p3r1 netns ahzp6sw" in cmds
    assert "ip -n ahzp6sw link set p3r1 master br1" in cmds
    assert sum(c.startswith("tc ") for c in cmds) == 16   # 8 node devices, 8 switch ports
    for c in two.setup_commands() + four.setup_commands():
        assert _stays_inside(c, "ahzp"), c
    with pytest.raises(ValueError, match="--topology rails does not combine with --inter-node-delay"):
        EmulatedCluster.create(2, "100mbit", delay_ms=1, links_per_node=2)
    shared = EmulatedCluster.create(2, "200mbit", run_prefix="ahzp5")
    assert shared.topology == "shared" and shared.devices == ["eth0"]
    assert not any("rp_filter" in " ".join(c) for c in shared.setup_commands())
    assert Cluster(2, "100mbit", ranks_per_node=2, links_per_node=2).rank_env()["GLOO_SOCKET_IFNAME"] == \
        "eth{local_rank}"


def test_rank_mapping_without_root():
    cluster = Cluster(2, "100mbit", ranks_per_node=2)  # nothing is created before start()
    ns = cluster.namespaces
    assert ns[0].startswith(f"ahzp{os.getpid()}")
    assert [cluster.rank_prefix_cmd(r) for r in range(4)] == [["ip", "netns", "exec", ns[r // 2]] for r in range(4)]
    assert cluster.rank_prefix_cmd(3, 4) == ["ip", "netns", "exec", ns[0]]
    with pytest.raises(ValueError, match="node"):
        cluster.rank_prefix_cmd(4)
    assert cluster.rank_env() == {"MASTER_ADDR": "10.200.0.1", "GLOO_SOCKET_IFNAME": "eth0",
                                  "TP_SOCKET_IFNAME": "eth0"}
    assert Cluster(2, "100mbit").namespaces != ns  # unique prefix per cluster


def test_preflight_explains_missing_rights(monkeypatch):
    from ds_asynchzp.netem import cluster as cluster_module

    monkeypatch.setattr(cluster_module.os, "geteuid", lambda: 1000)
    with pytest.raises(EmulationUnavailable, match="needs root"):
        preflight()
    monkeypatch.setattr(cluster_module.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster_module.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/sbin/{tool}")
    with pytest.raises(EmulationUnavailable, match="'tc'"):
        preflight()


# ----- real namespaces -----------------------------------------------------------------------------------------

def _unavailable_reason() -> str | None:
    try:
        preflight(need_tun=True)  # tries `ip netns add` of a probe namespace, a tbf on it, and deletes it
    except EmulationUnavailable as exc:
        return str(exc)
    return None


_REASON = _unavailable_reason()
needs_netns = pytest.mark.skipif(_REASON is not None, reason=f"network namespaces unavailable: {_REASON}")


def _ours(prefix: str) -> list[str]:
    return [ns for ns in tracking.list_namespaces() if ns.startswith(prefix)]


def _wait(condition, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def _run_smoke(cluster: Cluster) -> tuple[list[dict], dict, dict]:
    before = cluster.read_link_bytes()
    results = launch_local(WORKER, 4, 2, {"numel": NUMEL}, timeout_s=180,
                           env={**CHILD_ENV, **cluster.rank_env()}, rank_prefix_cmd=cluster.rank_prefix_cmd)
    after = cluster.read_link_bytes()
    sent = {n: after[n]["tx"] - before[n]["tx"] for n in after}
    received = {n: after[n]["rx"] - before[n]["rx"] for n in after}
    return results, sent, received


def _check_smoke(results: list[dict], sent: dict, received: dict) -> None:
    assert [r["world_sum"] for r in results] == [10.0] * 4  # 1 + 2 + 3 + 4, every element
    assert [r["intra_sum"] for r in results] == [3.0, 3.0, 7.0, 7.0]
    assert results[0]["netns_inode"] == results[1]["netns_inode"] != results[2]["netns_inode"]
    for node in (0, 1):
        local0 = results[2 * node]
        # Each node must receive the other node's contribution: at least one tensor's worth crosses.
        assert local0["tx_world"] >= TENSOR_BYTES, local0
        assert local0["tx_intra"] < 16 * 1024, local0  # intra-node traffic goes over lo; stray ACKs at most
        assert sent[node] >= local0["tx_world"]
    # What one side sent is what the other received.
    assert abs(sent[0] - received[1]) <= 0.01 * sent[0] and abs(sent[1] - received[0]) <= 0.01 * sent[1]


def _summary(label: str, results: list[dict], sent: dict) -> str:
    world = [results[0]["tx_world"], results[2]["tx_world"]]
    intra = [results[0]["tx_intra"], results[2]["tx_intra"]]
    return (f"\n{label}: link tx bytes per node over the launch {sent}; during the world all_reduce of "
            f"{TENSOR_BYTES} B {world}; during the intra-node all_reduce {intra}; "
            f"small all_reduce median {results[0]['small_allreduce_ms_median']:.2f} ms")


@needs_netns
def test_two_nodes_veth_smoke(capsys):
    with Cluster(2, "200mbit", ranks_per_node=2) as cluster:
        prefix = cluster.spec.run_prefix
        assert sorted(_ours(prefix)) == sorted(cluster.namespaces)
        results, sent, received = _run_smoke(cluster)
    _check_smoke(results, sent, received)
    with capsys.disabled():
        print(_summary("veth 2x2 @200mbit", results, sent))
    assert _ours(prefix) == []


@needs_netns
def test_rails_route_by_the_receivers_rail(capsys):
    """On rails each rank binds to its own link, and bytes for a rank of local index j leave on rail j: a world
    all-reduce of S over 4 ranks in 2 nodes (gloo's ring 0 -> 1 -> 2 -> 3 -> 0) crosses nodes on 1 -> 2 and 3 -> 0,
    both into local index 0, so rail 0 of each node carries 2 * 3/4 * S (one ring edge of each pass) and rail 1
    nothing but stray frames: what `formulas.links` predicts for gloo on one link per rank."""
    from ds_asynchzp.bench.plan_check import wire_overhead_factor
    from ds_asynchzp.formulas import links

    with Cluster(2, "unlimited", ranks_per_node=2, links_per_node=2) as cluster:
        prefix = cluster.spec.run_prefix
        before = cluster.read_link_bytes()
        results = launch_local(WORKER, 4, 2, {"numel": NUMEL, "small_iters": 1}, timeout_s=180,
                               env={**CHILD_ENV, **cluster.rank_env()}, rank_prefix_cmd=cluster.rank_prefix_cmd)
        after = cluster.read_link_bytes()
    assert [r["world_sum"] for r in results] == [10.0] * 4
    sent = {(n, dev): after[n]["links"][dev]["tx"] - before[n]["links"][dev]["tx"]
            for n in after for dev in after[n]["links"]}
    load = links.link_load([links.Collective("all_reduce", (tuple(range(4)),), TENSOR_BYTES)],
                           links.Topology(4, 2, 2, "gloo"))
    for node in (0, 1):
        for rail in (0, 1):
            predicted = load.nic[node][rail]
            # Frame headers and acknowledgements add at most wire_overhead_factor (less with segmentation
            # offload); the intra-node all-reduce stays on lo and the small ones are tiny.
            measured = sent[(node, f"eth{rail}")]
            assert predicted - 64 * 1024 <= measured <= predicted * wire_overhead_factor(1500) + 64 * 1024, sent
    assert load.nic[0][0] == pytest.approx(1.5 * TENSOR_BYTES) and load.nic[0][1] == 0
    with capsys.disabled():
        print(f"\nrails 2x2: link tx bytes over the launch {sent}")
    assert _ours(prefix) == []


@needs_netns
def test_two_nodes_tun_delay_smoke(capsys):
    delay_ms = 5.0
    with Cluster(2, "200mbit", delay_ms=delay_ms, ranks_per_node=2) as cluster:
        prefix, relay = cluster.spec.run_prefix, cluster.relay_pid
        assert tracking.pid_alive(relay)
        results, sent, received = _run_smoke(cluster)
    _check_smoke(results, sent, received)
    # A world all_reduce needs data from the other node: at least one one-way delay.
    assert results[0]["small_allreduce_ms_median"] >= delay_ms
    with capsys.disabled():
        print(_summary(f"tun 2x2 @200mbit +{delay_ms:g}ms", results, sent))
    assert _ours(prefix) == []
    assert not tracking.pid_alive(relay)


@needs_netns
def test_exception_inside_block_tears_down():
    with pytest.raises(RuntimeError, match="boom"):
        with Cluster(3, "100mbit", delay_ms=1) as cluster:
            prefix, relay, watchdog = cluster.spec.run_prefix, cluster.relay_pid, cluster.watchdog_pid
            assert len(_ours(prefix)) == 3
            raise RuntimeError("boom")
    assert _ours(prefix) == []
    assert not tracking.pid_alive(relay) and not tracking.pid_alive(watchdog)
    assert not list(tracking.STATE_DIR.glob(f"{prefix}.*"))
    assert signal.getsignal(signal.SIGTERM) != cluster._on_signal  # handlers restored


@needs_netns
def test_leftover_namespace_blocks_start_until_cleaned():
    stale = f"ahzpstale{os.getpid()}"  # no owner pid right after "ahzp": always a leftover
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        cluster = Cluster(2, "100mbit")
        with pytest.raises(LeftoverNamespaces) as info:
            with cluster:
                pass
        message = str(info.value)
        assert f"ip netns del {stale}" in message and "python -m ds_asynchzp.netem.cleanup" in message
        assert _ours(cluster.spec.run_prefix) == []  # refused before creating anything
        out = subprocess.run([sys.executable, "-m", "ds_asynchzp.netem.cleanup"], capture_output=True,
                             text=True, timeout=120, env={**os.environ, **CHILD_ENV})
        assert out.returncode == 0, out.stderr
        assert f"deleted namespace {stale}" in out.stdout
        assert stale not in tracking.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


_CHILD = """
import json, sys, time
from ds_asynchzp.netem import Cluster
cluster = Cluster(2, "100mbit", delay_ms=1, ttl_s=300)
cluster.start()
print("CLUSTER", json.dumps({"prefix": cluster.spec.run_prefix, "relay": cluster.relay_pid,
                  "watchdog": cluster.watchdog_pid}), flush=True)
time.sleep(300)
"""


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_signals_tear_down(sig):
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, **CHILD_ENV})
    try:
        line = ""
        while not line.startswith("CLUSTER "):  # importing the package may print DeepSpeed warnings first
            line = child.stdout.readline()
            assert line, "child exited before reporting its cluster"
        info = json.loads(line.split(" ", 1)[1])
        assert len(_ours(info["prefix"])) == 2
        child.send_signal(sig)
        # SIGTERM / SIGINT: torn down, then the previous handler acts (default death; KeyboardInterrupt, which
        # an uncaught one turns into death by SIGINT).
        assert child.wait(timeout=30) == -sig
        # SIGKILL: the watchdog notices the owner is gone (polls every second) and removes everything.
        assert _wait(lambda: not _ours(info["prefix"]), 15), tracking.list_namespaces()
        assert _wait(lambda: not tracking.pid_alive(info["relay"]), 10)
        assert _wait(lambda: not tracking.pid_alive(info["watchdog"]), 10)
        assert _wait(lambda: not list(tracking.STATE_DIR.glob(f"{info['prefix']}.*")), 5)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@needs_netns
def test_cleanup_removes_what_a_killed_run_left():
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, **CHILD_ENV})
    try:
        line = ""
        while not line.startswith("CLUSTER "):
            line = child.stdout.readline()
            assert line, "child exited before reporting its cluster"
        info = json.loads(line.split(" ", 1)[1])
        # The worst case: the watchdog is gone too, so nothing removes the namespaces on its own.
        os.killpg(info["watchdog"], signal.SIGKILL)
        child.kill()
        child.wait(timeout=30)
        assert _wait(lambda: not tracking.pid_alive(info["relay"]), 10)  # the relay notices its owner died
        left = _ours(info["prefix"])
        assert len(left) == 2
        with pytest.raises(LeftoverNamespaces) as refused:
            with Cluster(2, "100mbit"):
                pass
        assert all(f"ip netns del {ns}" in str(refused.value) for ns in left)
        out = subprocess.run([sys.executable, "-m", "ds_asynchzp.netem.cleanup"], capture_output=True, text=True,
                             timeout=120, env={**os.environ, **CHILD_ENV})
        assert out.returncode == 0, out.stderr
        assert _ours(info["prefix"]) == []
        assert not list(tracking.STATE_DIR.glob(f"{info['prefix']}.*"))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for ns in _ours(f"ahzp{child.pid}"):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
