"""The shipped examples: their ds_configs are valid, and examples/train.py trains under the deepspeed launcher."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from ds_asynchzp.config import resolve_layout, section_from_ds_config
from ds_asynchzp.resolved_layout import LayoutSizes
from tests.cluster_harness import launch_deepspeed

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "examples"
CONFIGS = ["ds_config_zero3.json", "ds_config_hpz.json", "ds_config_asynchzp.json", "ds_config_moe.json"]
# The launcher is installed next to the interpreter running the tests.
TIMEOUT_S = 240


@pytest.mark.parametrize("name", CONFIGS)
def test_config_is_minimal_valid_zero3(name):
    cfg = json.loads((EXAMPLES / name).read_text())
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["gradient_clipping"] == 1.0
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3
    # Zero thresholds: every parameter is partitioned and re-gathered, nothing stays resident.
    for key in ("stage3_param_persistence_threshold", "stage3_max_live_parameters",
                "stage3_max_reuse_distance", "stage3_prefetch_bucket_size"):
        assert zero[key] == 0, key
    # fp32: no mixed-precision section, as CPU ranks train in full precision.
    assert not any(cfg.get(k, {}).get("enabled") for k in ("fp16", "bf16"))


def test_only_the_asynchzp_config_enables_asynchzp():
    assert section_from_ds_config(EXAMPLES / "ds_config_zero3.json") is None
    assert section_from_ds_config(EXAMPLES / "ds_config_hpz.json") is None
    hpz = json.loads((EXAMPLES / "ds_config_hpz.json").read_text())
    assert hpz["zero_optimization"]["zero_hpz_partition_size"] == 2


def test_asynchzp_config_resolves_two_ranks_per_param_shard():
    layout = resolve_layout(EXAMPLES / "ds_config_asynchzp.json", world_size=4, local_world_size=4)
    assert layout.sizes.node_size == 4 and layout.sizes.num_nodes == 1
    assert layout.sizes == LayoutSizes(world_size=4, node_size=4, param_shard_size=2, grad_shard_size=2,
                                       optimizer_shard_size=4)


@pytest.fixture(scope="module")
def launcher_env(deepspeed_cpu_ops):
    # conftest put the venv's bin first on PATH, as activating it would: the launcher and its ranks then use
    # the venv's deepspeed and ninja.
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _launch_train(env: dict, *extra: str, config: str = "ds_config_asynchzp.json", steps: int = 2) -> str:
    """Run examples/train.py on 4 CPU ranks under the real deepspeed launcher; return its output."""
    return _launch(env, "examples/train.py", "--deepspeed_config", f"examples/{config}", "--steps", str(steps),
                   "--log-every", "1", *extra)


def _launch(env: dict, script: str, *args: str) -> str:
    """Run an example script on 4 CPU ranks under the real deepspeed launcher; return its output."""
    return launch_deepspeed(env, 4, script, *args, timeout=TIMEOUT_S)


def _assert_trained_with_asynchzp(out: str) -> tuple:
    match = re.search(r"final_loss=(\S+) optimizer=(\w+) first_loss=(\S+)", out)
    assert match, f"no final_loss line; output tail:\n{out[-4000:]}"
    assert match.group(2) == "HierarchicalZeroOptimizer"
    assert math.isfinite(float(match.group(1)))
    return float(match.group(3)), float(match.group(1))


def test_train_example_under_deepspeed_launcher(launcher_env):
    """examples/README.md's first command: examples/train.py with ds_config_asynchzp.json on 4 CPU ranks."""
    first, final = _assert_trained_with_asynchzp(_launch_train(launcher_env, steps=3))
    assert final < first, (first, final)


def test_moe_example_trains_autoep_experts_with_asynchzp(launcher_env):
    # train.py through ds_asynchzp.initialize under the real launcher (register() is the HF Trainer test's).
    out = _launch_train(launcher_env, "--model", "moe", config="ds_config_moe.json", steps=6)
    first, final = _assert_trained_with_asynchzp(out)
    assert final < first - 0.5, (first, final)
    # The experts got their own layout, inside their expert-data-parallel group.
    assert "[ds_asynchzp] expert:ep_size_2: d_p=2, d_g=2, d_o=2 over 2 ranks" in out, out[-4000:]


def test_long_context_example_trains_with_ulysses_sp_and_asynchzp(launcher_env):
    """examples/long_context_sp.py: ALST (Ulysses attention, its data-loader adapter, TiledMLP) with AsyncHZP through
    the DeepSpeed API, sp 2 on 4 CPU ranks under the real launcher: the loss falls and the layout names the SP."""
    out = _launch(launcher_env, "examples/long_context_sp.py", "--deepspeed_config", "examples/ds_config_sp.json",
                  "--sp", "2", "--seq-len", "128", "--steps", "8", "--tiled-mlp", "2")
    first, final = _assert_trained_with_asynchzp(out)
    assert final < first - 0.5, (first, final)
    assert "Ulysses sequence parallelism sp=2: its all-to-alls run inside a node" in out, out[-4000:]


def test_hf_trainer_example_trains_with_the_hierarchical_optimizer(launcher_env):
    """HF Trainer (through Accelerate) calls plain deepspeed.initialize; ds_asynchzp.register() routes it."""
    out = _launch(launcher_env, "examples/hf_trainer.py", "--steps", "10")
    match = re.search(r"RESULT optimizer=(\w+) engine=(\w+) first_loss=(\S+) last_loss=(\S+)", out)
    assert match, f"no RESULT line; output tail:\n{out[-4000:]}"
    assert match.group(1) == "HierarchicalZeroOptimizer" and match.group(2) == "AsyncHZPEngine"
    assert float(match.group(4)) < float(match.group(3)) - 0.5, match.group(0)
    # One node of 4 ranks (the launcher's), not 4 nodes of 1 (what Accelerate writes into LOCAL_WORLD_SIZE).
    assert "world=4 (1 node(s) x 4 ranks)" in out, out[-4000:]


def test_hf_trainer_config_leaves_batch_and_optimizer_values_to_the_trainer():
    cfg = json.loads((EXAMPLES / "ds_config_hf_trainer.json").read_text())
    assert cfg["train_micro_batch_size_per_gpu"] == "auto" and cfg["optimizer"]["params"]["lr"] == "auto"
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["async_hzp"] == {}
