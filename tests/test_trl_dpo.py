"""TRL's DPOTrainer with a reference model, ZeRO-3 and `ds_asynchzp.register()`, on 4 CPU ranks as 2 nodes of 2
(two torchrun processes on this machine, one per node): it trains, and its losses equal those of the same run
without the "async_hzp" section.

Both models are loaded by `from_pretrained` under ZeRO-3, so zero.Init partitions them over the world as they are
built. TRL builds the reference model's engine from a copy of the trainer's ds_config without its optimizer, so
that engine is DeepSpeed's parameter-only one, its parameters given hpZ's copies over d_p = 2 inside each node
when it is built; the policy gets the hierarchical optimizer. Every micro-step's loss is compared, unrounded, within 1e-6 relative: the
gradients are summed inside the node then across nodes, not over the world at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from ds_asynchzp.bench.launch import free_port

from .dist_harness import REPO_ROOT

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMEOUT_S = 420
REL = 1e-6


def _two_nodes_of_two(tmp_path, name: str, *args: str) -> dict:
    out = tmp_path / name / "result.json"
    out.parent.mkdir()
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([*TORCHRUN, "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2",
                               "--master_addr", "127.0.0.1", "--master_port", str(port),
                               "examples/trl_dpo.py", "--out", str(out), *args],
                              cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
             for node in (0, 1)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{name}: the DPO run did not finish in {TIMEOUT_S} s")
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, f"{name}: exit code {proc.returncode}; output tail:\n{output[-4000:]}"
    return json.loads(out.read_text())


def test_dpo_with_a_reference_model_trains_as_without_the_section(tmp_path):
    stock = _two_nodes_of_two(tmp_path, "stock")
    hzp = _two_nodes_of_two(tmp_path, "asynchzp", "--asynchzp")
    assert stock["world"] == hzp["world"] == 4 and stock["steps"] == hzp["steps"] == 4
    assert stock["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    assert hzp["optimizer"] == "HierarchicalZeroOptimizer"
    assert stock["reference_optimizer"] == hzp["reference_optimizer"] == "DeepSpeedZeRoOffload"
    assert stock["reference_hpz"] == 1 and hzp["reference_hpz"] == 2, "the reference's gathers stay in the node"
    # Loaded by from_pretrained under ZeRO-3 (partitioned over the world by zero.Init), the reference got its
    # copies over the node when its engine was built: no forward of it gathers across nodes.
    assert not stock["reference_copies"] and hzp["reference_copies"]
    assert len(hzp["losses"]) == len(stock["losses"]) == 8
    for step, (ours, theirs) in enumerate(zip(hzp["losses"], stock["losses"])):
        assert abs(ours - theirs) <= REL * abs(theirs), (step, hzp["losses"], stock["losses"])
    assert len(set(stock["losses"])) > 1, "the policy trained (its DPO loss moved)"
