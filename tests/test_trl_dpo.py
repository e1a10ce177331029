"""TRL's DPOTrainer with a reference model, ZeRO-3 and `ds_asynchzp.register()` (`examples/trl_dpo.py`), through
`asynchzp-ab` on 4 CPU ranks as 2 nodes of 2 (two torchrun processes on this machine, one per node): the zero3 and
asynchzp arms train to the same losses, and the reference model's forwards, which the recorder tells apart from
the policy's, cross nodes on every step under stock and on none after the first under AsyncHZP.

Both models are loaded by `from_pretrained` under ZeRO-3, so zero.Init partitions them over the world as they are
built. TRL builds the reference model's engine from a copy of the trainer's ds_config without its optimizer: under
the section its parameters get hpZ's copies over d_p = 2 inside each node when it is built; the policy gets the
hierarchical optimizer. Losses are compared within 1e-6 relative: the policy's gradients are summed inside the node
then across nodes, not over the world at once. In the first step TRL's fused forward reads `lm_head.weight` from
outside the module's forward, which DeepSpeed gathers over the world once and then fetches with the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ds_asynchzp.bench.launch import free_port

from .dist_harness import REPO_ROOT

AB = [sys.executable, "-m", "ds_asynchzp.bench.ab"]
TIMEOUT_S = 600
REL = 1e-6
STEPS = 4


def test_dpo_through_asynchzp_ab_trains_as_stock_with_a_node_local_reference(tmp_path):
    out = tmp_path / "ab"
    port = free_port()
    script = f"examples/trl_dpo.py --deepspeed_config {{config}} --output_dir {out}/{{arm}}/dpo_out --steps 100"
    torchrun = (f"{sys.executable} -m torch.distributed.run --nnodes 2 --nproc_per_node 2 --master_addr 127.0.0.1 "
                f"--master_port {port}")
    # One command for both nodes: a torchrun per node, as two hosts would run them.
    command = f"{torchrun} --node_rank 0 {script} & {torchrun} --node_rank 1 {script} & wait -n && wait -n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([*AB, "--arms", "zero3,asynchzp", "--steps", str(STEPS), "--node-size", "2",
                           "--config", "examples/ds_config_trl_dpo.json", "--out", str(out), "--no-report",
                           "--timeout", "400", "--", "bash", "-c", command],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    arms = json.loads((out / "results.json").read_text())["arms"]
    stock, hzp = arms["zero3"], arms["asynchzp"]
    assert stock["optimizer_class"] == "DeepSpeedZeroOptimizer_Stage3"
    assert hzp["optimizer_class"] == "HierarchicalZeroOptimizer"
    assert len(stock["losses"]) == len(hzp["losses"]) == STEPS
    for step, (ours, theirs) in enumerate(zip(hzp["losses"], stock["losses"])):
        assert abs(ours - theirs) <= REL * abs(theirs), (step, hzp["losses"], stock["losses"])
    assert len(set(stock["losses"])) > 1, "the policy trained (its DPO loss moved)"
    # The reference engine is not taken for the arm; its forwards are labelled and counted apart.
    theirs = [s["inter_node"] for s in stock["bytes_by_model_by_step"]["reference"]]
    ours = hzp["bytes_by_model_by_step"]["reference"]
    assert all(b > 0 for b in theirs), theirs
    assert [s["inter_node"] for s in ours[1:]] == [0.0] * (STEPS - 1), ours
    assert all(s["intra_node"] > 0 for s in ours), "the reference's gathers run inside the node"
    assert hzp["bytes_per_step_by_model"]["reference"]["inter_node"] == 0.0
