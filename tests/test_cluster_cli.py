"""asynchzp-cluster: a command run as N emulated nodes (network, UTS and PID namespaces) on one machine.

The training runs follow the commands of docs/multinode.md (checked below): examples/train.py on 2 nodes x 2 ranks,
one `deepspeed` launcher per node and one `torchrun` per node, against the same script on one node of 4 ranks with
node_size 2. Skipped, with the reason printed, only where namespaces cannot be created (not root, no iproute2/tc,
no unshare). About 95 s on 2 idle cores (150 s on a busy machine): three short trainings, one killed mid-run,
and some cheap runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from ds_asynchzp.bench import plan_check
from ds_asynchzp.formulas import step_collectives, traffic
from ds_asynchzp.config import resolve_layout
from ds_asynchzp.netem import tracking
from ds_asynchzp.netem import cli
from tests.cluster_harness import (CLI, DOC_DEEPSPEED, REPO_ROOT, RUN_TIMEOUT_S, Run, doc_text, env,
                                   launch_deepspeed, losses, namespaces, needs_netns, with_options)

CONFIG = REPO_ROOT / "examples" / "ds_config_asynchzp.json"
DOC_TORCHRUN = ("asynchzp-cluster --nodes 2 --bw 200mbit -- torchrun --nnodes {nnodes} --nproc-per-node 2 "
                "--node-rank {node_rank} --master-addr {master_addr} --master-port {master_port} "
                "examples/train.py --deepspeed_config examples/ds_config_asynchzp.json")
LONG_STEPS, SHORT_STEPS = 6, 2
LOST_WITHIN_S = 60


def _train(doc_command: str, steps: int, tmp: Path, options=(), wrap=()) -> dict:
    bytes_out = tmp / "bytes.json"
    run = Run(with_options(doc_command, ["--timeout", str(RUN_TIMEOUT_S), "--bytes-out", str(bytes_out), *options],
                           wrap, ["--steps", str(steps), "--log-every", "1", "--print-losses"]))
    start = time.monotonic()
    code = run.finish()
    assert code == 0, f"exit code {code}:\n{run.output[-6000:]}"
    assert namespaces(run.prefix) == [], "the emulated cluster was not torn down"
    return {"out": run.output, "bytes": json.loads(bytes_out.read_text()), "seconds": time.monotonic() - start}


def _check_trained_with_asynchzp_on_two_nodes(out: str) -> None:
    assert re.search(r"^\[node 0\] final_loss=\S+ optimizer=HierarchicalZeroOptimizer ", out, re.M), out[-4000:]
    assert "[node 0] [ds_asynchzp] async_hzp layout: world=4 (2 node(s) x 2 ranks)" in out, out[-4000:]
    assert "was lost" not in out, out[-4000:]


@pytest.fixture(scope="module")
def one_node(deepspeed_cpu_ops):
    """The reference: examples/train.py on one node of 4 ranks under the deepspeed launcher, with node_size 2
    (LOCAL_WORLD_SIZE, which AsyncHZP reads before the launcher's LOCAL_SIZE): the same layout and global batch."""
    out = launch_deepspeed({**env(), "LOCAL_WORLD_SIZE": "2"}, 4, "examples/train.py", "--deepspeed_config",
                           str(CONFIG), "--steps", str(LONG_STEPS), "--log-every", "1", "--print-losses")
    assert "world=4 (2 node(s) x 2 ranks)" in out, out[-4000:]
    return losses(out, node_prefix="")


@pytest.fixture(scope="module")
def deepspeed_run(deepspeed_cpu_ops, tmp_path_factory):
    return _train(DOC_DEEPSPEED, LONG_STEPS, tmp_path_factory.mktemp("deepspeed"))


# Node 1 uses up 50 pids before its launcher starts, so its ranks' pids are not those of node 0's ranks: a peer
# monitor that took the equal hostnames for one machine would then find no such pid and report a rank lost.
_SAME_HOST_WRAP = ["sh", "-c", 'echo "host $(hostname) pidns $(readlink /proc/self/ns/pid)"; i=0; '
                   'while [ $i -lt $((50 * $NODE_RANK)) ]; do /bin/true; i=$((i+1)); done; exec "$@"', "sh"]


@pytest.fixture(scope="module")
def torchrun_run(deepspeed_cpu_ops, tmp_path_factory):
    return _train(DOC_TORCHRUN, SHORT_STEPS, tmp_path_factory.mktemp("torchrun"),
                  options=["--hostname", "trainer"], wrap=_SAME_HOST_WRAP)


# ----- training ------------------------------------------------------------------------------------------------

@needs_netns
def test_deepspeed_launcher_on_two_nodes_trains_as_one_node_does(deepspeed_run, one_node):
    out = deepspeed_run["out"]
    _check_trained_with_asynchzp_on_two_nodes(out)
    # fp32, the same groups (d_p = d_g = 2, d_o = 4), data and seed: every sum is done in the same order, so the
    # losses are bit-identical; only the transport (TCP between namespaces vs loopback) differs.
    assert losses(out) == one_node


@needs_netns
def test_torchrun_on_two_nodes_with_one_hostname_trains_to_the_end(torchrun_run, one_node):
    out = torchrun_run["out"]
    hosts = re.findall(r"^\[node (\d)\] host (\S+) pidns (\S+)$", out, re.M)
    assert sorted(n for n, _, _ in hosts) == ["0", "1"], out[-4000:]
    assert len({h for _, h, _ in hosts}) == 1 and len({ns for _, _, ns in hosts}) == 2, hosts
    _check_trained_with_asynchzp_on_two_nodes(out)  # no "rank ... was lost" from the peer monitor
    assert losses(out) == one_node[:SHORT_STEPS]


@needs_netns
def test_link_bytes_per_step_match_the_prediction(deepspeed_run, torchrun_run, capsys):
    """Both runs cross the link with the same start-up (model broadcast, partitioning, rendezvous: 3.5 KB apart
    between the launchers when measured); their difference is LONG_STEPS - SHORT_STEPS steady steps, which
    step_collectives.link_bytes predicts (payload, per rank) and the frame overhead turns into eth0 bytes."""
    long_, short = (run["bytes"]["total_tx_bytes"] for run in (deepspeed_run, torchrun_run))
    for run in (deepspeed_run, torchrun_run):  # what one node sent, the other received
        links = run["bytes"]["links"]
        assert links["0"]["tx"] == links["1"]["rx"] and links["1"]["tx"] == links["0"]["rx"], links
    measured = (long_ - short) / (LONG_STEPS - SHORT_STEPS)
    layout = resolve_layout(CONFIG, world_size=4, local_world_size=2)
    sizes = layout.sizes
    d_p, d_g, d_o = sizes.param_shard_size, sizes.grad_shard_size, sizes.optimizer_shard_size
    elements = plan_check.bench_element_counts({"model": "tiny", "nproc": 4}, multiple=d_o)  # train.py's model
    inputs = traffic.TrafficInputs(world=4, node_size=2, grad_accum=json.loads(CONFIG.read_text())[
        "gradient_accumulation_steps"], gathered_elements=elements["gathered"], reduced_elements=elements["reduced"],
        trainable_elements=elements["trainable"])
    predicted = 4 * step_collectives.link_bytes("asynchzp", inputs, d_p, d_g, d_o) * plan_check.wire_overhead_factor(1500)
    with capsys.disabled():
        print(f"\nlink bytes per step, 2 x 2 ranks: measured {measured:.0f} (runs of {LONG_STEPS} and {SHORT_STEPS} "
              f"steps: {long_} and {short}), predicted {predicted:.0f}, {measured / predicted - 1:+.1%}; "
              f"run times {deepspeed_run['seconds']:.0f} s and {torchrun_run['seconds']:.0f} s")
    assert abs(measured / predicted - 1) <= 0.05


def test_the_docs_show_these_commands():
    for doc in (REPO_ROOT / "docs" / "multinode.md", REPO_ROOT / "README.md"):
        text = doc_text(doc)
        assert DOC_DEEPSPEED in text, doc
        if doc.name == "multinode.md":
            assert DOC_TORCHRUN in text, doc


# ----- failures and cleanup ------------------------------------------------------------------------------------

def _pids_of_rank(namespace: str, rank: int) -> list[int]:
    pids = []
    for pid in tracking.namespace_pids(namespace):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and "examples/train.py" in tracking.process_cmdline(pid):
            pids.append(pid)
    return pids


@needs_netns
def test_a_rank_killed_on_node_1_ends_node_0_naming_it(deepspeed_cpu_ops):
    # --grace 60: asynchzp-cluster leaves node 0 alone for as long as the ranks have to end by themselves.
    run = Run(with_options(DOC_DEEPSPEED, ["--timeout", str(RUN_TIMEOUT_S), "--grace", str(LOST_WITHIN_S)],
                            train_args=["--steps", "500", "--log-every", "1"]))
    try:
        run.wait_for(r"^\[node 0\] step +1 ", RUN_TIMEOUT_S)
        victim = _pids_of_rank(f"{run.prefix}n1", 3)
        assert len(victim) == 1, victim
        os.kill(victim[0], signal.SIGKILL)
        killed_at = time.monotonic()
        ended_at = run.wait_for(r"node 0 (ended|was stopped):", LOST_WITHIN_S + 15)
    finally:
        code = run.finish()
    out = run.output
    assert "node 0 ended:" in out, out[-4000:]  # by itself, not stopped by asynchzp-cluster
    assert ended_at - killed_at < LOST_WITHIN_S, out[-4000:]
    # The peer monitor's line, from each rank of node 0 (rank 2, the only one that can see rank 3's pid, has to
    # publish the verdict before it ends itself).
    silent = [rank for rank in (0, 1) if f"[node 0] [ds_asynchzp] rank {rank}: rank 3 was lost" not in out]
    about_3 = "\n".join(line[:400] for line in out.splitlines() if "rank 3" in line or "rank(s) 3" in line)
    assert silent == [], f"ranks {silent} of node 0 did not name rank 3 as lost; lines about it:\n{about_3}"
    assert code != 0
    assert namespaces(run.prefix) == []


@needs_netns
@pytest.mark.parametrize("sig,ignore_term", [(signal.SIGTERM, True), (signal.SIGINT, False)])
def test_a_signal_mid_run_leaves_no_namespace_and_no_node_process(sig, ignore_term):
    # One node process has left the process group, so only the end of the node's PID namespace takes it down.
    # With SIGTERM every node process also ignores SIGTERM: they go only with the SIGKILL that follows (5 s later).
    run = Run([*CLI, "--nodes", "2", "--", "sh", "-c",
               ('trap "" TERM; ' if ignore_term else "") + "setsid sleep 1000 & sleep 1000 & echo started; wait"])
    try:
        for node in (0, 1):
            run.wait_for(rf"^\[node {node}\] started$", 30)
        pids = [p for n in (0, 1) for p in tracking.namespace_pids(f"{run.prefix}n{n}")]
        assert len(pids) >= 8, pids  # per node: unshare, sh (pid 1), sh, 2 x sleep
        hostfile = Path(re.search(r"hostfile (\S+)", run.output).group(1))
        run.proc.send_signal(sig)
        assert run.finish(timeout=60) == 128 + sig
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    assert f"received {sig.name}: stopping node(s) 0, 1" in run.output
    assert namespaces(run.prefix) == []
    assert [pid for pid in pids if tracking.pid_alive(pid)] == []
    assert not hostfile.parent.exists()


@needs_netns
def test_node_processes_die_when_asynchzp_cluster_is_killed():
    # SIGKILL leaves no handler to run: the cluster's watchdog (it polls its owner every second) kills every
    # process inside the node namespaces and deletes them. Only the hostfile's temporary folder stays behind.
    run = Run([*CLI, "--nodes", "2", "--", "sh", "-c", 'setsid sleep 1000 & sleep 1000 & echo started; wait'])
    try:
        for node in (0, 1):
            run.wait_for(rf"^\[node {node}\] started$", 30)
        pids = [p for n in (0, 1) for p in tracking.namespace_pids(f"{run.prefix}n{n}")]
        hostfile = Path(re.search(r"hostfile (\S+)", run.output).group(1))
        run.proc.kill()
        assert run.finish(timeout=30) == -signal.SIGKILL
        end = time.monotonic() + 20
        while (namespaces(run.prefix) or any(map(tracking.pid_alive, pids))) and time.monotonic() < end:
            time.sleep(0.2)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    assert namespaces(run.prefix) == [] and [pid for pid in pids if tracking.pid_alive(pid)] == []
    hostfile.unlink()
    hostfile.parent.rmdir()


@needs_netns
def test_nodes_get_their_own_hostname_pid_namespace_environment_and_placeholders(tmp_path):
    script = ('echo "host=$(hostname) pidns=$(readlink /proc/self/ns/pid) netns=$(readlink /proc/self/ns/net) '
              'env=$NODE_RANK/$NNODES/$MASTER_ADDR/$MASTER_PORT/$GLOO_SOCKET_IFNAME/$DS_ACCELERATOR '
              'args={node_rank}/{nnodes}/{master_addr}/{master_port}/{ranks_per_node} braces={other}"; '
              'cat {hostfile}; exit {node_rank}')
    run = Run([*CLI, "--nodes", "3", "--ranks-per-node", "4", "--master-port", "29555", "--timeout", "60",
               "--bytes-out", str(tmp_path / "b.json"), "--", "sh", "-c", script])
    code = run.finish(timeout=90)
    out = run.output
    assert code == 2, out  # the worst of the nodes' exit codes (0, 1, 2)
    seen = dict(re.findall(r"^\[node (\d)\] (host=.*)$", out, re.M))
    assert sorted(seen) == ["0", "1", "2"], out
    own = {os.readlink("/proc/self/ns/pid"), os.readlink("/proc/self/ns/net")}
    for node, line in seen.items():
        fields = dict(word.split("=", 1) for word in line.split())
        assert fields["host"] == f"node{node}"
        assert fields["env"] == f"{node}/3/10.200.0.1/29555/eth0/cpu" and fields["braces"] == "{other}"
        assert fields["args"] == f"{node}/3/10.200.0.1/29555/4"
        assert fields["pidns"] not in own and fields["netns"] not in own
    assert len({f.split()[1] for f in seen.values()}) == 3  # three PID namespaces
    assert re.findall(r"^\[node 0\] (node\d slots=4)$", out, re.M) == ["node0 slots=4", "node1 slots=4",
                                                                       "node2 slots=4"]
    record = json.loads((tmp_path / "b.json").read_text())
    assert record["nodes"] == 3 and record["exit_code"] == 2 and set(record["links"]) == {"0", "1", "2"}
    assert "total tx" in out and namespaces(run.prefix) == []


@needs_netns
def test_timeout_stops_a_command_that_runs_forever():
    run = Run([*CLI, "--timeout", "1", "--", "sleep", "1000"])
    assert run.finish(timeout=60) == 124
    assert "the command did not end within --timeout 1 s" in run.output
    assert namespaces(run.prefix) == []


def test_a_deepspeed_command_gets_the_flags_each_node_needs():
    """`deepspeed --no_ssh --num_gpus 2 train.py` alone ends in DeepSpeed's own "--node_rank is not set correctly" on
    every node: the flags it lacks are added as placeholders, before the script; flags the script takes are its own;
    a complete command and other launchers are left alone."""
    words = ["deepspeed", "--num_gpus", "2", "train.py", "--hostfile", "mine", "--deepspeed_config", "c.json"]
    completed, added = cli.complete_deepspeed_command(words)
    assert added == ["--no_ssh", "--hostfile", "{hostfile}", "--node_rank", "{node_rank}", "--master_addr",
                     "{master_addr}", "--master_port", "{master_port}"]
    assert completed == ["deepspeed", *added, *words[1:]]
    partial = ["/venv/bin/deepspeed", "--no_ssh", "--node_rank={node_rank}", "--hostfile", "{hostfile}", "t.py"]
    assert cli.complete_deepspeed_command(partial)[1] == ["--master_addr", "{master_addr}", "--master_port",
                                                          "{master_port}"]
    full, _ = cli.complete_deepspeed_command(partial)
    assert cli.complete_deepspeed_command(full) == (full, [])
    assert cli.complete_deepspeed_command(["torchrun", "--nnodes", "2", "t.py"]) == (["torchrun", "--nnodes", "2",
                                                                                      "t.py"], [])


# ----- errors found before anything is built (no root needed) -------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--bw", "fast", "--", "true"], "--bw: cannot parse rate 'fast'"),
    (["--delay", "soon", "--", "true"], "--delay: cannot parse delay"),
    (["--nodes", "1", "--", "true"], "--nodes must be in 2.."),
    (["--mtu", "100", "--", "true"], "--mtu: MTU must be in"),
    (["--"], "no command given"),
])
def test_bad_arguments_are_refused_with_the_fix(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(cli, "Runner", None)  # nothing may be built
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_missing_rights_and_tools_are_named(capsys, monkeypatch):
    monkeypatch.setattr(cli, "Runner", None)
    monkeypatch.setattr(cli.os, "geteuid", lambda: 1000)
    assert cli.main(["--", "true"]) == 2
    assert "needs root" in capsys.readouterr().err
    monkeypatch.setattr(cli.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cli.shutil, "which", lambda tool: None)
    assert cli.main(["--", "true"]) == 2
    assert "install util-linux" in capsys.readouterr().err


def test_placeholders_and_hostfile(tmp_path):
    values = {"node_rank": 1, "nnodes": 2, "master_addr": "10.200.0.1", "master_port": 29500, "hostfile": "/h",
              "ranks_per_node": 2}
    assert cli.fill(["--node_rank", "{node_rank}", "{master_addr}:{master_port}", "{'a': {nnodes}}", "{x}"],
                    values) == ["--node_rank", "1", "10.200.0.1:29500", "{'a': 2}", "{x}"]
    assert cli.write_hostfile(tmp_path, 2, 3).read_text() == "node0 slots=3\nnode1 slots=3\n"
