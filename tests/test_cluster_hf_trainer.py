"""The Hugging Face Trainer example's multi-node command, as docs/multinode.md shows it. The run itself (one
`deepspeed` launcher per emulated node through `asynchzp-cluster`; AsyncHZP's optimizer through register(); the
layout of 2 nodes of 2 ranks, not the 4 nodes of 1 rank that Accelerate's own LOCAL_WORLD_SIZE would give; bytes
on both node links) is `tests/test_ab.py::test_hf_trainer_example_through_register_on_two_emulated_nodes`, which
runs it under every arm.
"""

from __future__ import annotations

from tests.cluster_harness import DOC_DEEPSPEED, REPO_ROOT, doc_text

# The documented command, with the HF Trainer script in place of examples/train.py (docs/multinode.md shows it).
DOC_HF_TRAINER = DOC_DEEPSPEED.replace("examples/train.py --deepspeed_config examples/ds_config_asynchzp.json",
                                       "examples/hf_trainer.py")


def test_the_docs_show_the_hf_trainer_command():
    assert DOC_HF_TRAINER in doc_text(REPO_ROOT / "docs" / "multinode.md")
