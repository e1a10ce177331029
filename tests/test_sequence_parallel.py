"""Ulysses sequence parallelism (ALST) under AsyncHZP against stock ZeRO-3 with ALST, on the same data in the same
processes: a tiny random Llama (no downloads) with `UlyssesSPAttentionHF`, sp 2, on 4 CPU ranks as 2 nodes of 2
(tests/_sp_workers.py). Then a resume without SP from a universal checkpoint saved with it, and the SP states and
meshes that are refused (a Megatron-style mpu: tests/test_config.py)."""

from __future__ import annotations

import os
import types

import pytest

from ds_asynchzp import AsyncHZPConfigError, resolve_for_initialize
from ds_asynchzp.bench.launch import launch_local

from .dist_harness import LAUNCH_TIMEOUT_S, REPO_ROOT
from .test_checkpoints import to_universal

ENV = {"PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
SP, WORLD, NODE = 2, 4, 2
LAYOUT_A = {"param_shard_size": 2, "grad_shard_size": 2}                              # d_p = d_g = node, d_o 4
LAYOUT_B = {"param_shard_size": 1, "grad_shard_size": 2, "optimizer_shard_size": 4}   # d_p 1 < d_g < d_o
GAS, STEPS, STEPS_AFTER = 2, 2, 2

# Stock ZeRO-3 with ALST is the reference of every case. The planted case must differ from it: it is last, as its
# plant stays in place for the rest of the launch.
CASES = [
    {"name": "A_async", "section": dict(LAYOUT_A, async_comm=True), "default_knobs": True, "gas": GAS,
     "steps": STEPS, "steps_after": STEPS_AFTER},
    {"name": "B_sync_tiled", "section": dict(LAYOUT_B, async_comm=False), "tiled_mlp": True, "gas": GAS,
     "steps": STEPS},
    {"name": "A_async_tiled_allreduce", "section": dict(LAYOUT_A, async_comm=True), "tiled_mlp": True,
     "reduce_scatter": False, "gas": 1, "steps": 3},
    {"name": "planted_world_divisor", "section": dict(LAYOUT_B, async_comm=True), "reduce_scatter": False,
     "plant": "world_divisor", "gas": 1, "steps": 3},
]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp")
    cases = [dict(c, save_dir=str(root / c["name"])) if "steps_after" in c else c for c in CASES]
    results = launch_local("tests._sp_workers:run_arms", WORLD, NODE, {"sp": SP, "cases": cases},
                           timeout_s=LAUNCH_TIMEOUT_S, env=ENV)
    return root, results


@pytest.mark.parametrize("case", [c["name"] for c in CASES if "plant" not in c])
def test_losses_equal_stock_zero3_with_alst(trained, case):
    """fp32, every micro-step, every rank: AsyncHZP's losses equal stock's. Both divide each gradient by the same
    number before summing the same values; the sums run in another order (inside the node, then across nodes),
    which is where any difference comes from: it stays below 1e-6 relative."""
    _, results = trained
    for rank, result in enumerate(results):
        stock, hzp = result[f"{case}/stock"], result[f"{case}/hzp"]
        assert hzp["optimizer"] == "HierarchicalZeroOptimizer" and stock["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
        assert len(hzp["losses"]) == len(stock["losses"]) > 1
        worst = max(_rel(h, s) for h, s in zip(hzp["losses"], stock["losses"]))
        assert worst <= 1e-6, (case, rank, hzp["losses"], stock["losses"])
    # The ranks of one SP group train on one sequence: they see the same loss; the two groups see different ones.
    assert results[0][f"{case}/hzp"]["losses"] == results[1][f"{case}/hzp"]["losses"]
    assert results[0][f"{case}/hzp"]["losses"] != results[2][f"{case}/hzp"]["losses"]


def test_the_comparison_catches_a_planted_gradient_scale(trained):
    """The all-reduce path dividing by the world (the reduce-scatter path's divisor) instead of stock's world / sp:
    the buckets within reduce_bucket_size get gradients sp times too small, the larger ones (the embedding) not;
    with gradient clipping that changes the step. Caught at ten times the parity tests' tolerance."""
    _, results = trained
    stock, hzp = results[0]["planted_world_divisor/stock"], results[0]["planted_world_divisor/hzp"]
    assert hzp["losses"][0] == stock["losses"][0]            # before any step: same weights
    assert max(_rel(h, s) for h, s in zip(hzp["losses"], stock["losses"])) > 1e-5


def test_resume_without_sp_from_a_universal_checkpoint(trained):
    """Saved with sp 2 on 4 ranks, converted with ds_to_universal, resumed with sp 1 on 2 ranks (each rank
    trains on the whole sequence its SP group trained on): the losses go on as in the run that was not stopped.
    Attention then sees the sequence whole on one rank and gradients are summed over 2 ranks, not 4: another
    summation order, so equal within 1e-6 relative, not bit for bit."""
    root, results = trained
    case = next(c for c in CASES if "steps_after" in c)
    cases = []
    for arm in ("stock", "hzp"):
        to_universal(root / case["name"] / arm, "saved")
        section = {"param_shard_size": 1, "grad_shard_size": 1}
        cases.append(dict(case, name=arm, arm=arm, section=section, load_dir=str(root / case["name"] / arm),
                          first_micro=STEPS * GAS))
    resumed = launch_local("tests._sp_workers:resume_run", WORLD // SP, 1, {"cases": cases},
                           timeout_s=LAUNCH_TIMEOUT_S, env=ENV)
    for arm in ("stock", "hzp"):
        for rank, result in enumerate(resumed):
            expected = results[rank * SP][f"{case['name']}/{arm}"]["losses_after"]
            got = result[arm]["losses"]
            assert len(got) == len(expected) > 0, (arm, rank, got, expected)   # a shorter resume does not pass
            assert max(_rel(g, e) for g, e in zip(got, expected)) <= 1e-6, (arm, rank, got, expected)
    assert resumed[0]["hzp"]["optimizer"] == "HierarchicalZeroOptimizer"


# ------------------------------------------------------------------------------------------------ refusals
def _net():
    import torch

    return torch.nn.Linear(4, 4)


CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "async_hzp": {"node_size": 2}}


def _sp_state(sp: int, sdp: int):
    return types.SimpleNamespace(initialize_sequence_parallel=lambda *a: None,
                                 get_sequence_parallel_world_size=lambda: sp,
                                 get_sequence_data_parallel_world_size=lambda: sdp)


def test_an_sp_state_accepted_and_one_not_spanning_the_world_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    layout = resolve_for_initialize(model=_net(), config=CONFIG, mpu=_sp_state(2, 4))
    assert layout.sequence_parallel_size == 2 and layout.sizes.world_size == 4
    assert "sp=2: its all-to-alls run inside a node" in layout.describe()
    with pytest.raises(AsyncHZPConfigError, match="not the world"):
        resolve_for_initialize(model=_net(), config=CONFIG, mpu=_sp_state(2, 2))


def test_deepspeeds_device_mesh_sequence_parallelism_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(AsyncHZPConfigError, match="mesh_param"):
        resolve_for_initialize(model=_net(), config=CONFIG, mesh_param=(2, 2))
    mesh_config = dict(CONFIG, data_parallel_size=2, sequence_parallel_size=2)
    with pytest.raises(AsyncHZPConfigError, match="sequence_parallel_size"):
        resolve_for_initialize(model=_net(), config=mesh_config)
