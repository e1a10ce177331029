"""Checkpoints: DeepSpeed's tools read ours, a run resumes at another world size and layout, a killed save leaves
the previous checkpoint loadable, and broken or foreign checkpoints fail with a clear error.

Three launches in all (rank-side code in tests/_checkpoint_workers.py): 8 ranks (2 nodes of 4) train and save
several layouts, with and without optimizer offload (and resume the offloaded one at that size); 4 ranks are
killed in the middle of a save; 4 ranks (2 nodes of 2) resume every checkpoint under other layouts and compare
with the 8-rank run, which trained on after saving (the uninterrupted reference).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from ds_asynchzp.bench.launch import RankFailure, launch_local  # noqa: E402
from ds_asynchzp.errors import CheckpointError  # noqa: E402
from tests.dist_harness import LAUNCH_TIMEOUT_S, REPO_ROOT  # noqa: E402

ENV = {"PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
SAVE_AT, STEPS_AFTER = 2, 3
TAG = f"step{SAVE_AT}"
LOSS_RTOL = 1e-5  # fp32: only the order of the gradient sums differs between world sizes


def hzp(node, d_p, d_g, d_o) -> dict:
    return {"node_size": node, "param_shard_size": d_p, "grad_shard_size": d_g, "optimizer_shard_size": d_o}


# World 8 = 2 nodes x 4 ranks, global batch 16 = 8 ranks x 1 sample x 2 micro-steps (2 samples x 1 for ZeRO-3).
SAVED = {
    "p4_g4_o8": {"micro_batch": 1, "gas": 2, "async_hzp": hzp(4, 4, 4, 8), "save_16bit": True},
    # d_o < N: two optimizer replicas, of which only the first writes files.
    "p2_g4_o4": {"micro_batch": 1, "gas": 2, "async_hzp": hzp(4, 2, 4, 4), "knobs": "defaults"},
    "zero3": {"micro_batch": 2, "gas": 1},
    # A tiny random Mixtral under AutoEP (ep 2): experts laid out inside their expert-data-parallel group.
    "moe": {"micro_batch": 1, "gas": 2, "autoep_size": 2, "async_hzp": hzp(4, 4, 4, 8), "save_16bit": True},
    # Optimizer states on the host (DeepSpeedCPUAdam), ours and stock's; ours is also resumed at this size.
    "offload": {"micro_batch": 1, "gas": 2, "async_hzp": hzp(4, 2, 4, 8), "knobs": "defaults", "offload": True,
                "save_16bit": True, "resume_same_size": True},
    "zero3_offload": {"micro_batch": 2, "gas": 1, "offload": True},
}
# World 4 = 2 nodes x 2 ranks, the same global batch of 16: (saved case, how it loads, the resumed layout).
RESUMED = {
    "p4_g4_o8_to_p2_g2_o4": ("p4_g4_o8", {"micro_batch": 1, "gas": 4, "async_hzp": hzp(2, 2, 2, 4),
                                          "knobs": "defaults", "clobber_frozen": True}),
    "p2_g4_o4_to_p1_g2_o2": ("p2_g4_o4", {"micro_batch": 2, "gas": 2, "async_hzp": hzp(2, 1, 2, 2)}),
    "zero3_to_p2_g2_o2": ("zero3", {"micro_batch": 1, "gas": 4, "async_hzp": hzp(2, 2, 2, 2)}),
    "p4_g4_o8_to_zero3": ("p4_g4_o8", {"micro_batch": 4, "gas": 1}),
    "moe_p4_g4_o8_to_p1_g2_o4": ("moe", {"micro_batch": 2, "gas": 2, "autoep_size": 2, "async_hzp": hzp(2, 1, 2, 4)}),
    # Optimizer offload on either side of the resume: the host optimizer's states go through the same universal
    # files as the device optimizer's (the frozen parameter is restored by the AsyncHZP engines only).
    "offload_to_p2_g2_o4": ("offload", {"micro_batch": 1, "gas": 4, "async_hzp": hzp(2, 2, 2, 4),
                                        "clobber_frozen": True}),
    "p4_g4_o8_to_offload_p1_g2_o2": ("p4_g4_o8", {"micro_batch": 2, "gas": 2, "async_hzp": hzp(2, 1, 2, 2),
                                                  "offload": True, "clobber_frozen": True}),
    "offload_to_offload_p2_g2_o4": ("offload", {"micro_batch": 1, "gas": 4, "async_hzp": hzp(2, 2, 2, 4),
                                                "offload": True, "clobber_frozen": True}),
    "zero3_offload_to_offload_p1_g2_o4": ("zero3_offload", {"micro_batch": 2, "gas": 2, "async_hzp": hzp(2, 1, 2, 4),
                                                            "offload": True, "clobber_frozen": True}),
    "offload_to_zero3_offload": ("offload", {"micro_batch": 4, "gas": 1, "offload": True}),
}
DENSE_SAVED = [name for name, case in SAVED.items() if not case.get("autoep_size")]


def _launch(target: str, nproc: int, node_size: int, payload: dict) -> list:
    return launch_local(f"tests._checkpoint_workers:{target}", nproc, node_size, payload, timeout_s=LAUNCH_TIMEOUT_S,
                        env=ENV)


def to_universal(directory: Path, tag: str) -> Path:
    """DeepSpeed's conversion (`python -m deepspeed.checkpoint.ds_to_universal`), in-process."""
    from deepspeed.checkpoint import ds_to_universal

    output = directory / f"{tag}_universal"
    ds_to_universal.main(argparse.Namespace(input_folder=str(directory / tag), output_folder=str(output),
                                            num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                            strict=True, inject_missing_state=False))
    return output


def load_reference(path: Path):
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def saved(deepspeed_cpu_ops, tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    cases = [dict(case, name=name) for name, case in SAVED.items()]
    results = _launch("save_run", 8, 4, {"root": str(root), "cases": cases, "save_at": SAVE_AT,
                                         "steps_after": STEPS_AFTER})
    for name in SAVED:
        to_universal(root / name, TAG)
    return root, results


@pytest.fixture(scope="module")
def killed(deepspeed_cpu_ops, tmp_path_factory):
    directory = tmp_path_factory.mktemp("killed")
    case = {"micro_batch": 1, "gas": 4, "async_hzp": hzp(2, 1, 2, 2)}
    with pytest.raises(RankFailure) as failure:
        _launch("kill_run", 4, 2, {"dir": str(directory), "case": case, "fault_rank": 1})
    assert failure.value.rank == 1 and failure.value.returncode == -9, str(failure.value)[-2000:]
    # What the killed save left, before anything else touches the directory.
    listing = {str(p.relative_to(directory)) for p in directory.rglob("*")}
    return directory, case, listing


def _error_fixtures(root: Path, saved_root: Path) -> dict:
    """Checkpoint directories that must be refused, each with a `latest` file naming its tag."""
    truncated = root / "truncated"
    shutil.copytree(saved_root / "p4_g4_o8" / TAG, truncated / TAG)
    victim = truncated / TAG / "zero_pp_rank_3_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    (truncated / "latest").write_text(TAG)
    foreign = root / "foreign"
    shutil.copytree(saved_root / "p4_g4_o8" / "16bit", foreign / "model")
    (foreign / "latest").write_text("model")
    return {"truncated": (truncated, victim), "foreign": (foreign, foreign / "model")}


@pytest.fixture(scope="module")
def resumed(saved, killed, tmp_path_factory):
    saved_root, _ = saved
    errors = _error_fixtures(tmp_path_factory.mktemp("broken"), saved_root)
    cases = []
    for name, (source, case) in RESUMED.items():
        # With AutoEP each rank holds its own experts: rank r holds those of saved rank r (ep rank r mod 2, at
        # both sizes), whose consolidated weights are its reference.
        reference = "reference_rank{rank}.pt" if case.get("autoep_size") else "reference.pt"
        cases.append(dict(case, name=name, universal=True, load_dir=str(saved_root / source), first_step=SAVE_AT,
                          steps_after=STEPS_AFTER, reference=str(saved_root / source / reference)))
    base = {"micro_batch": 1, "gas": 4, "async_hzp": hzp(2, 1, 2, 4)}
    cases += [
        dict(base, name="errors", errors={"truncated": str(errors["truncated"][0]),
                                          "foreign": str(errors["foreign"][0]),
                                          "other_world": str(saved_root / "p4_g4_o8")}),
        dict(base, name="other_model", model={"d_model": 32}, errors={"other_model": str(saved_root / "p4_g4_o8")}),
        # Weights alone, straight from the 8-rank checkpoints (no conversion), and from a universal one.
        dict(base, name="module_only", load_dir=str(saved_root / "p4_g4_o8"), load_module_only=True,
             reference=str(saved_root / "p4_g4_o8" / "reference.pt")),
        dict(base, name="no_optimizer_states", load_dir=str(saved_root / "p2_g4_o4"), load_optimizer_states=False,
             reference=str(saved_root / "p2_g4_o4" / "reference.pt")),
        # The offloaded checkpoint's weights into an engine that offloads: the host master weights follow them.
        dict(base, name="offload_no_optimizer_states", offload=True, load_dir=str(saved_root / "offload"),
             load_optimizer_states=False, clobber_frozen=True, reference=str(saved_root / "offload" / "reference.pt")),
        dict(base, name="universal_module_only", universal=True, load_dir=str(saved_root / "p4_g4_o8"),
             load_module_only=True, clobber_frozen=True, reference=str(saved_root / "p4_g4_o8" / "reference.pt")),
        # The killed save's directory: `latest` still names the complete previous save. Same world and d_o, so
        # the full states load directly, under another d_p (parameter shards are rebuilt from the loaded atoms).
        dict(killed[1], name="after_kill", async_hzp=hzp(2, 2, 2, 2), load_dir=str(killed[0]),
             reference=str(killed[0] / "reference_ckpt.pt"), save_again=True),
    ]
    results = _launch("resume_run", 4, 2, {"cases": cases})
    return results, errors


# --------------------------------------------------------------------------------------- DeepSpeed's tools
@pytest.mark.parametrize("name", DENSE_SAVED)
def test_zero_to_fp32_gives_the_consolidated_weights(saved, name):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root, _ = saved
    reference = load_reference(root / name / "reference.pt")
    state = get_fp32_state_dict_from_zero_checkpoint(str(root / name), tag=TAG)
    assert set(state) == set(reference) | {"lm_head.weight"}  # the tied head under its own name too
    assert (state["lm_head.weight"] == state["wte.weight"]).all()
    for key, value in reference.items():
        assert state[key].dtype == value.dtype and (state[key] == value).all(), key


def test_first_optimizer_replica_writes_each_file_once(saved):
    root, results = saved
    # d_o = 4 of 8 ranks: one model-state and one optimizer-state file per optimizer partition, each listed
    # (with its size) in the manifest; before, both replicas wrote the same model-state file at once.
    files = sorted(os.listdir(root / "p2_g4_o4" / TAG))
    assert files == ["asynchzp_manifest.json"] + [f"zero_pp_rank_{q}_mp_rank_00_{kind}_states.pt"
                                                  for q in range(4) for kind in ("model", "optim")]
    manifest = json.loads((root / "p2_g4_o4" / TAG / "asynchzp_manifest.json").read_text())
    assert manifest["partition_count"] == 4 and manifest["world_size"] == 8 and manifest["global_steps"] == SAVE_AT
    assert manifest["layout"]["optimizer_shard_size"] == 4
    assert {f: (root / "p2_g4_o4" / TAG / f).stat().st_size for f in files[1:]} == manifest["files"]
    # A committed save leaves no staging directory; stock ZeRO-3's save is DeepSpeed's own (no manifest).
    for name in SAVED:
        assert not [f for f in results[0][name]["files"] if f.startswith(".")], results[0][name]["files"]
    assert not (root / "zero3" / TAG / "asynchzp_manifest.json").exists()


@pytest.mark.parametrize("name", [n for n in DENSE_SAVED if SAVED[n].get("save_16bit")])
def test_save_16bit_model_gives_the_consolidated_weights(saved, name):
    root, _ = saved
    reference = load_reference(root / name / "reference.pt")
    weights = load_reference(root / name / "16bit" / "pytorch_model.bin")
    assert os.listdir(root / name / "16bit") == ["pytorch_model.bin"]  # the temporary name is gone
    assert set(weights) == set(reference) | {"lm_head.weight"}
    for key, value in reference.items():
        assert (weights[key].float() == value).all(), key


def _universal_fp32(directory: Path, name: str):
    state = load_reference(directory / "zero" / name / "fp32.pt")
    return state["param"] if isinstance(state, dict) else state


def test_moe_checkpoint_converts_to_the_consolidated_weights(saved):
    """With AutoEP, DeepSpeed's zero_to_fp32 and save_16bit_model refuse expert-partitioned checkpoints (stock
    ZeRO-3's alike) and point to ds_to_universal: the universal checkpoint holds every parameter in full, the
    experts of all expert-parallel ranks stacked, equal to the engine's consolidated weights."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root, results = saved
    with pytest.raises(NotImplementedError, match="ds_to_universal"):
        get_fp32_state_dict_from_zero_checkpoint(str(root / "moe"), tag=TAG)
    # save_16bit_model alike, on every rank.
    assert all("ds_to_universal" in (r["moe"]["refused_16bit"] or "") for r in results), results[0]["moe"]
    assert not (root / "moe" / "16bit").exists()
    by_ep_rank = [load_reference(root / "moe" / f"reference_rank{r}.pt") for r in range(2)]
    universal = root / "moe" / f"{TAG}_universal"
    for key, value in by_ep_rank[0].items():
        expected = torch.cat([ref[key] for ref in by_ep_rank]) if ".experts." in key else value
        got = _universal_fp32(universal, key)  # dense parameters flat, experts in their stacked shape
        assert got.numel() == expected.numel() and (got.view(expected.shape) == expected).all(), key


# ------------------------------------------------------------------------------------- another world size
@pytest.mark.parametrize("name", list(RESUMED))
def test_resume_at_another_size_and_layout(saved, resumed, name):
    _, saved_results = saved
    results, _ = resumed
    source, case = RESUMED[name]
    reference = saved_results[0][source]["losses_after"]
    # Each side stepped with the optimizer its config asks for: DeepSpeedCPUAdam exactly where it offloads.
    assert (saved_results[0][source]["host_optimizer"] == "DeepSpeedCPUAdam") == bool(SAVED[source].get("offload"))
    for rank_result in results:
        got = rank_result[name]
        assert (got["host_optimizer"] == "DeepSpeedCPUAdam") == bool(case.get("offload")), got["host_optimizer"]
        assert got["global_steps"] == SAVE_AT
        assert got["scheduler_after_load"] == saved_results[0][source]["scheduler_at_save"]
        # The fp32 master weights and (where clobbered before the load) the frozen parameter: exactly as saved.
        assert got["max_param_diff"] == 0.0
        worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses_after"], reference))
        if rank_result["rank"] == 0:
            print(f"{name}: max relative loss difference {worst:.2e} over {STEPS_AFTER} steps")
        assert len(got["losses_after"]) == STEPS_AFTER and worst <= LOSS_RTOL, (got["losses_after"], reference)


def test_offloaded_run_resumes_at_the_same_size(saved):
    """Saved with optimizer offload, loaded directly by a fresh engine at the same world and layout: the host
    master weights, Adam moments and step come back exactly. The losses after it agree with the run that never
    stopped to a relative 1e-6, not bit for bit, as under stock ZeRO-3 with offload: DeepSpeedCPUAdam keeps
    beta^t between steps by multiplying, and a fresh one handed the loaded step computes it with pow(), which
    differs in the last bit (measured 1.6e-7 relative by the second step after the resume)."""
    _, saved_results = saved
    for rank_result in saved_results:
        uninterrupted, got = rank_result["offload"], rank_result["offload"]["resumed"]
        assert got["host_optimizer"] == uninterrupted["host_optimizer"] == "DeepSpeedCPUAdam"
        assert got["global_steps"] == SAVE_AT
        assert got["scheduler_after_load"] == uninterrupted["scheduler_at_save"]
        assert got["max_param_diff"] == 0.0  # the frozen parameter (zeroed before the load) included
        assert got["losses_after"][0] == uninterrupted["losses_after"][0], "the first step after it is exact"
        assert got["losses_after"] == pytest.approx(uninterrupted["losses_after"], rel=1e-6)


def test_weights_only_loads_at_another_size(saved, resumed):
    _, saved_results = saved
    results, _ = resumed
    for rank_result in results:
        # Module only: weights (frozen one included) as saved, nothing else: the run starts at step 0.
        for name in ("module_only", "universal_module_only"):
            assert rank_result[name]["max_param_diff"] == 0.0, name
            assert rank_result[name]["global_steps"] == 0, name
        # Without optimizer states: weights as saved, and the step counter and scheduler come back.
        for name, source in (("no_optimizer_states", "p2_g4_o4"), ("offload_no_optimizer_states", "offload")):
            got = rank_result[name]
            assert got["max_param_diff"] == 0.0, name  # the host master weights included, where offloaded
            assert got["global_steps"] == SAVE_AT, name
            assert got["scheduler_after_load"] == saved_results[0][source]["scheduler_at_save"], name


# ------------------------------------------------------------------------------------------------- atomicity
def test_killed_save_leaves_the_previous_tag_loadable(killed, resumed):
    directory, _, listing = killed
    # The kill really happened in the middle of the second save: its staging directory holds the dead rank's
    # model-state file but not its optimizer-state file; `latest` and the tag are the first save's.
    staged = [p for p in listing if p.startswith(".asynchzp-staging-") and p.endswith("_model_states.pt")]
    assert any("zero_pp_rank_1_mp_rank_00_model_states.pt" in p for p in staged), sorted(listing)
    assert not any(p.endswith("zero_pp_rank_1_mp_rank_00_optim_states.pt") and p.startswith(".") for p in listing)
    assert "latest" in listing and "ckpt/asynchzp_manifest.json" in listing
    results, _ = resumed
    for rank_result in results:
        got = rank_result["after_kill"]
        assert got["global_steps"] == 1 and got["max_param_diff"] == 0.0
        assert got["global_steps_saved_again"] == 2
    # The next save replaced the tag in place and removed what the killed one left.
    assert (directory / "latest").read_text() == "ckpt"
    assert json.loads((directory / "ckpt" / "asynchzp_manifest.json").read_text())["global_steps"] == 2
    assert not [p for p in os.listdir(directory) if p.startswith(".")]


def test_a_save_killed_between_its_renames_keeps_the_old_tag(tmp_path):
    from ds_asynchzp.runtime import checkpoint

    # The old tag moved aside, the new one not yet in place: loading finds the old one, the next save restores it.
    retired = tmp_path / f"{checkpoint.RETIRED_PREFIX}abc" / "ckpt"
    retired.mkdir(parents=True)
    (retired / "marker").write_text("old")
    assert checkpoint.resolve_tag(str(tmp_path), "ckpt") == str(retired.parent)
    checkpoint._repair(str(tmp_path))
    assert (tmp_path / "ckpt" / "marker").read_text() == "old" and not retired.parent.exists()
    assert checkpoint.resolve_tag(str(tmp_path), "ckpt") == str(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint tag.*'ckpt'"):
        checkpoint.resolve_tag(str(tmp_path), "other")


# ---------------------------------------------------------------------------------------------------- errors
def test_broken_and_foreign_checkpoints_fail_on_every_rank(resumed):
    results, errors = resumed
    messages = [rank_result["errors"]["errors"] for rank_result in results]
    assert all(m == messages[0] for m in messages)  # every rank alike: nobody waits in a collective
    first = messages[0]
    assert first["truncated"] and str(errors["truncated"][1]) in first["truncated"], first
    assert "truncated" in first["truncated"]
    assert first["foreign"] and str(errors["foreign"][1]) in first["foreign"], first
    assert "not a DeepSpeed ZeRO-3 checkpoint" in first["foreign"]
    assert first["other_world"] and "world 8" in first["other_world"] and "ds_to_universal" in first["other_world"]
    other = results[0]["other_model"]["errors"]["other_model"]
    assert other and "saved from another model" in other
    assert "wte.weight: saved [256, 64], this model [256, 32]" in other
    for rank_result in results:  # and the ranks stayed in step: they trained on after the refused loads
        assert len(rank_result["errors"]["losses_after"]) == 1
        assert len(rank_result["other_model"]["losses_after"]) == 1


def test_inspection_names_the_file_and_the_problem(saved, tmp_path):
    from ds_asynchzp.runtime import checkpoint

    root, _ = saved
    # A stock ZeRO-3 checkpoint (no manifest): the torch file itself is found incomplete.
    stock = tmp_path / "stock"
    shutil.copytree(root / "zero3" / TAG, stock)
    victim = stock / "zero_pp_rank_5_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{victim}: not a complete torch.save file"):
        checkpoint.inspect_checkpoint(str(stock))
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{stock}: the optimizer-state file of partition 5 is missing"):
        checkpoint.inspect_checkpoint(str(stock))
    shutil.copy(root / "zero3" / TAG / victim.name, victim)
    (stock / "zero_pp_rank_7_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="8 model-state files but 7 optimizer-state files"):
        checkpoint.inspect_checkpoint(str(stock))
    # Both files of the last partition gone: the optimizer states still say how many partitions there were.
    (stock / "zero_pp_rank_7_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="saved by one of 8 partitions, but .* holds 7 optimizer-state files"):
        checkpoint.inspect_checkpoint(str(stock))
    # Ours: the manifest records every size.
    ours = tmp_path / "ours"
    shutil.copytree(root / "p2_g4_o4" / TAG, ours)
    victim = ours / "zero_pp_rank_2_mp_rank_00_model_states.pt"
    size = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=f"{victim}: {size - 1} bytes, the save wrote {size}"):
        checkpoint.inspect_checkpoint(str(ours))
    # Another model: the first differences by name.
    info = checkpoint.inspect_checkpoint(str(root / "p2_g4_o4" / TAG))
    model = checkpoint.ModelShapes([[(n, s) for n, s in g] for g in info.param_shapes], dict(info.frozen_param_shapes))
    checkpoint.check_model(info, model, strict=True, rigid=True)
    model.trainable[0][0] = (model.trainable[0][0][0], (7,))
    model.frozen["extra.weight"] = (3, 3)
    with pytest.raises(CheckpointError, match=r"saved from another model: prime_logit_bias: saved \[191\], this model "
                                              r"\[7\]; extra.weight: not in the checkpoint"):
        checkpoint.check_model(info, model, strict=True, rigid=True)
    # An empty file, and a directory of something else.
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty.pt: empty"):
        checkpoint.check_torch_file(str(tmp_path / "empty.pt"))
    with pytest.raises(CheckpointError, match="not a DeepSpeed ZeRO-3 checkpoint"):
        checkpoint.inspect_checkpoint(str(root / "p4_g4_o8" / "16bit"))
    # A universal checkpoint loaded as a plain one, and the reverse.
    with pytest.raises(CheckpointError, match='a universal checkpoint; load it with "checkpoint"'):
        checkpoint.inspect_checkpoint(str(root / "p4_g4_o8" / f"{TAG}_universal"))
    with pytest.raises(CheckpointError, match="not a universal checkpoint"):
        checkpoint.inspect_checkpoint(str(root / "p4_g4_o8" / TAG), universal=True)


# ------------------------------------------------------------------------------------------------ torch.load
def test_every_torch_load_in_the_package_is_weights_only():
    """torch.load(weights_only=False) runs arbitrary pickled code; the package never asks for it."""
    offenders, calls = [], 0
    for path in sorted((REPO_ROOT / "ds_asynchzp").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                calls += 1
                flag = [k for k in node.keywords if k.arg == "weights_only"]
                if not flag or not (isinstance(flag[0].value, ast.Constant) and flag[0].value.value is True):
                    offenders.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    assert calls >= 2  # the checkpoint module's own reads are found
    assert not offenders, offenders
