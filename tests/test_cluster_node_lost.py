"""A whole node dies mid-training: the ranks left end by themselves, saying what was lost, and the run resumes from
its last checkpoint on the node that is left, through the commands of docs/multinode.md ("When a whole node dies",
"Resume on fewer nodes").

One run of examples/train.py on 2 emulated nodes x 2 ranks (fp32, the documented `deepspeed` launcher command)
saves a checkpoint every SAVE_EVERY steps, trains on, and then loses node 1: every process in its namespaces is
SIGKILLed at once, as when a machine goes down. The checkpoint of step SAVE_EVERY is converted with
`ds_to_universal` and resumed on 1 node x 2 ranks with the same global batch; its losses must match those the
2-node run logged after that step, since it trained on uninterrupted. Skipped, with the reason printed, where
namespaces cannot be made. About 40 s on 2 idle cores: one 2-node run, one conversion, one 2-rank run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from ds_asynchzp.netem import tracking
from tests.cluster_harness import (DOC_DEEPSPEED, REPO_ROOT, RUN_TIMEOUT_S, Run, doc_text, env, launch_deepspeed,
                                   losses, namespaces, needs_netns, with_options)

CONFIG = REPO_ROOT / "examples" / "ds_config_asynchzp.json"
SAVE_EVERY = 3
RESUME_TO = 2 * SAVE_EVERY       # the resumed run trains steps SAVE_EVERY .. RESUME_TO - 1
LOST_WITHIN_S = 60
LOSS_RTOL = 1e-5                 # fp32: only the order of the gradient sums differs between world sizes


@pytest.fixture(scope="module")
def node_lost(deepspeed_cpu_ops, tmp_path_factory):
    """The 2 x 2 run, killed on node 1 once node 0 has logged step RESUME_TO (the save after step RESUME_TO is
    complete then, so the kill falls in a training step)."""
    ckpt = tmp_path_factory.mktemp("node_lost") / "ckpt"
    # --grace: asynchzp-cluster leaves node 0 alone for as long as its ranks have to end by themselves.
    run = Run(with_options(DOC_DEEPSPEED, ["--timeout", str(RUN_TIMEOUT_S), "--grace", str(LOST_WITHIN_S)],
                           train_args=["--steps", "500", "--log-every", "1", "--print-losses", "--save-dir", str(ckpt),
                                       "--save-every", str(SAVE_EVERY)]))
    try:
        run.wait_for(rf"^\[node 0\] step +{RESUME_TO} ", RUN_TIMEOUT_S)
        node1 = f"{run.prefix}n1"
        processes = tracking.namespace_pids(node1)
        tracking.kill_namespace_processes(node1)  # the launcher, its ranks, the node's init: all of it at once
        killed_at = time.monotonic()
        ended_at = run.wait_for(r"node 0 (ended|was stopped):", LOST_WITHIN_S + 15)
        gone = not any(map(tracking.pid_alive, processes))
    finally:
        code = run.finish()
    return {"out": run.output, "code": code, "ckpt": ckpt, "processes": processes, "gone": gone,
            "seconds": ended_at - killed_at, "prefix": run.prefix}


def _logged_losses(out: str) -> dict[int, float]:
    """Node 0's step lines with --print-losses: `step    N  loss X.XXXX  exact <repr>`."""
    return {int(step): float(exact) for step, exact in
            re.findall(r"^\[node 0\] step +(\d+)  loss \S+  exact (\S+)$", out, re.M)}


# ----- the node dies ---------------------------------------------------------------------------------------------

@needs_netns
def test_every_rank_of_node_0_ends_within_a_minute_saying_what_was_lost(node_lost, capsys):
    out = node_lost["out"]
    with capsys.disabled():
        print(f"\nnode 1 killed ({len(node_lost['processes'])} processes); node 0 ended {node_lost['seconds']:.1f} s "
              "later")
    # unshare, the node's init shell, the deepspeed runner, launch.py and 2 ranks; all dead once node 0 has ended.
    assert len(node_lost["processes"]) >= 6 and node_lost["gone"], node_lost["processes"]
    assert "[asynchzp-cluster] node 1 ended: exit code 137 (killed by SIGKILL)" in out, out[-4000:]
    # Node 0 ended by itself (not stopped by asynchzp-cluster): its launcher, and with it both its ranks, within
    # the minute. Ending the node's PID namespace would have killed any rank still running.
    assert "[asynchzp-cluster] node 0 ended: exit code 1" in out, out[-4000:]
    assert node_lost["seconds"] < LOST_WITHIN_S, out[-4000:]
    # What the user reads on node 0: the collective that failed, with gloo's error naming node 1's address (the
    # connections to a dead node's ranks are reset), and AsyncHZP's diagnosis of it naming the ranks and host.
    lines = [line for line in out.splitlines() if line.startswith("[node 0]")]
    gloo = [line for line in lines if re.search(r"\[10\.200\.0\.2\]:\d+.*by peer|by peer \[10\.200\.0\.2\]", line)]
    assert gloo, "\n".join(lines[-60:])
    diagnosis = [line for line in lines if re.search(
        r"failed on a communication thread .*no heartbeat for \S+ s from rank\(s\) 2, 3 on node1: stopped "
        r"\(SIGSTOP, a debugger\), hung, or ended \(a node that went down silences all its ranks\)", line)]
    assert diagnosis, "\n".join(line[:600] for line in lines[-60:])
    assert node_lost["code"] != 0
    assert namespaces(node_lost["prefix"]) == []


# ----- resume on the node that is left ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def resumed(node_lost, tmp_path_factory):
    ckpt = node_lost["ckpt"]
    tag = f"global_step{SAVE_EVERY}"
    convert = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                              str(ckpt / tag), "--output_folder", str(ckpt / f"{tag}_universal")],
                             cwd=REPO_ROOT, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert convert.returncode == 0, (convert.stdout + convert.stderr)[-4000:]
    # Half the ranks: twice the gradient accumulation keeps the global batch (2 x 2 x 4 = 4 x 2 x 2 = 16).
    config = json.loads(CONFIG.read_text())
    config["gradient_accumulation_steps"] *= 2
    config["checkpoint"] = {"load_universal": True}
    resume_config = tmp_path_factory.mktemp("resume") / "ds_config_resume.json"
    resume_config.write_text(json.dumps(config, indent=2))
    return launch_deepspeed(env(), 2, "examples/train.py", "--deepspeed_config", str(resume_config), "--load-dir",
                            str(ckpt), "--steps", str(RESUME_TO), "--log-every", "1", "--print-losses")


@needs_netns
def test_resumed_on_one_node_it_trains_on_as_the_two_nodes_did(node_lost, resumed, capsys):
    assert (node_lost["ckpt"] / "latest_universal").read_text() == f"global_step{SAVE_EVERY}_universal"
    assert re.search(rf"^resumed from \S+global_step{SAVE_EVERY}_universal at step {SAVE_EVERY}$", resumed, re.M), \
        resumed[-4000:]
    assert "async_hzp layout: world=2 (1 node(s) x 2 ranks)" in resumed, resumed[-4000:]
    assert re.search(r"^final_loss=\S+ optimizer=HierarchicalZeroOptimizer ", resumed, re.M), resumed[-4000:]
    got = losses(resumed, node_prefix="")
    logged = _logged_losses(node_lost["out"])
    reference = [logged[step] for step in range(SAVE_EVERY, RESUME_TO)]
    assert len(got) == len(reference) == RESUME_TO - SAVE_EVERY, (got, reference)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, reference))
    with capsys.disabled():
        print(f"\nresumed on 1 node x 2 ranks: max relative loss difference {worst:.2e} over {len(got)} steps")
    assert worst <= LOSS_RTOL, (got, reference)


def test_the_docs_show_the_resume_procedure():
    text = doc_text(REPO_ROOT / "docs" / "multinode.md")
    # The commands above, as a user types them (paths and step numbers aside).
    for shown in ("examples/train.py --deepspeed_config examples/ds_config_asynchzp.json --save-dir ckpt "
                  "--save-every 100",
                  "python -m deepspeed.checkpoint.ds_to_universal --input_folder ckpt/global_step300 "
                  "--output_folder ckpt/global_step300_universal",
                  '"gradient_accumulation_steps": 4,', '"checkpoint": {"load_universal": true}',
                  "deepspeed --num_gpus 2 examples/train.py --deepspeed_config ds_config_resume.json --load-dir ckpt "
                  "--steps 1000"):
        assert shown in text, shown
    assert json.loads(CONFIG.read_text())["gradient_accumulation_steps"] * 2 == 4  # the doc's "4 instead of 2"
