"""The Hugging Face Trainer example on 2 emulated nodes, launched as docs/multinode.md says (one `deepspeed`
launcher per node through `asynchzp-cluster`): it trains to the end with AsyncHZP's optimizer, and the layout
it resolves has 2 nodes of 2 ranks, not the 4 nodes of 1 rank that Accelerate's own LOCAL_WORLD_SIZE would give.
Skipped, with the reason printed, where namespaces cannot be made. About 25 s on 2 idle cores.
"""

from __future__ import annotations

import json
import re

from tests.cluster_harness import (DOC_DEEPSPEED, REPO_ROOT, RUN_TIMEOUT_S, Run, doc_text, namespaces, needs_netns,
                                   with_options)

# The documented command, with the HF Trainer script in place of examples/train.py (docs/multinode.md shows it).
DOC_HF_TRAINER = DOC_DEEPSPEED.replace("examples/train.py --deepspeed_config examples/ds_config_asynchzp.json",
                                       "examples/hf_trainer.py")
STEPS = 4


@needs_netns
def test_hf_trainer_trains_on_two_nodes_with_asynchzp(deepspeed_cpu_ops, tmp_path):
    bytes_out = tmp_path / "bytes.json"
    run = Run(with_options(DOC_HF_TRAINER, ["--timeout", str(RUN_TIMEOUT_S), "--bytes-out", str(bytes_out)],
                           train_args=["--steps", str(STEPS), "--log-every", "1",
                                       "--output-dir", str(tmp_path / "out")]))
    code = run.finish()
    out = run.output
    assert code == 0, f"exit code {code}:\n{out[-6000:]}"
    match = re.search(r"^\[node 0\] RESULT optimizer=(\w+) engine=(\w+) first_loss=(\S+) last_loss=(\S+) "
                      r"logged=\d+ steps=(\d+)$", out, re.M)
    assert match, out[-4000:]
    assert match.group(1) == "HierarchicalZeroOptimizer" and match.group(2) == "AsyncHZPEngine", match.group(0)
    assert int(match.group(5)) == STEPS and float(match.group(4)) < float(match.group(3)), match.group(0)
    assert "[node 0] [ds_asynchzp] async_hzp layout: world=4 (2 node(s) x 2 ranks)" in out, out[-4000:]
    assert "was lost" not in out, out[-4000:]
    # The ranks of both nodes took part: the gradients and parameters crossed the node link both ways.
    links = json.loads(bytes_out.read_text())["links"]
    assert min(links["0"]["tx"], links["1"]["tx"]) > 100_000, links
    assert namespaces(run.prefix) == []


def test_the_docs_show_the_hf_trainer_command():
    assert DOC_HF_TRAINER in doc_text(REPO_ROOT / "docs" / "multinode.md")
