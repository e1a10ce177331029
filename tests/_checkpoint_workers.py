"""Rank-side code of the checkpoint tests (run by ds_asynchzp.bench.launch in fresh processes).

Three launches: `save_run` trains several layouts at one world size and saves each (and, where a case asks,
resumes it at that size in a fresh engine); `kill_run` dies in the middle of a save; `resume_run` loads at
another world size and layout and keeps training. Every launch runs its cases one after another on the same
ranks, since process start-up dominates the cost on a small machine.

Runs at different world sizes see the same samples: sample `j` of step `s` is window `s * GLOBAL_BATCH + j` of
the corpus, and rank `r` takes samples `(a * world + r) * micro_batch + i` at micro-step `a`. With the same
global batch (world x micro_batch x gradient accumulation) both runs average the gradient of the same samples,
and the logged loss is the mean over the whole global batch.
"""

from __future__ import annotations

import dataclasses
import os

import deepspeed
import torch

import ds_asynchzp
from ds_asynchzp.bench.zero3_knobs import NO_OVERLAP as ZERO3_KNOBS
from ds_asynchzp.bench.data import batch_for
from ds_asynchzp.models.gpt import MODEL_PRESETS, build_model
from ds_asynchzp.errors import CheckpointError
from ds_asynchzp.runtime.checkpoint import FAULT_RANK_ENV

GLOBAL_BATCH = 16
SEQ_LEN = 32
DATA_SEED = 11
# DeepSpeed's defaults keep every parameter of the tiny model gathered between steps (persistent parameters);
# the benchmark's knobs keep none. Cases use both: checkpoints partition and regather persistent parameters.
KNOBS = {"bench": dict(ZERO3_KNOBS, reduce_bucket_size=20000), "defaults": {"stage": 3, "reduce_bucket_size": 20000}}


def ds_config(case: dict) -> dict:
    zero = dict(KNOBS[case.get("knobs", "bench")], stage3_gather_16bit_weights_on_model_save=True)
    config = {
        "train_micro_batch_size_per_gpu": case["micro_batch"],
        "gradient_accumulation_steps": case["gas"],
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        # The learning rate changes at every step around the save: a resume that lost the scheduler drifts.
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 4}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if case.get("offload"):
        # Optimizer states on the host, stepped by DeepSpeedCPUAdam (stock ZeRO-3's offload path too).
        zero["offload_optimizer"] = {"device": "cpu"}
    if case.get("async_hzp") is not None:
        config["async_hzp"] = dict(case["async_hzp"], log_layout=False)
    if case.get("universal"):
        config["checkpoint"] = {"load_universal": True}
    if case.get("autoep_size"):
        from ds_asynchzp.models.mixtral import autoep_config
        config["expert_parallel"] = autoep_config(case["autoep_size"])
    return config


def build_engine(case: dict, seed: int = 7):
    if case.get("autoep_size"):
        from ds_asynchzp.models.mixtral import build_moe_model
        model = build_moe_model("moe", SEQ_LEN, seed=seed)
    else:
        model = build_model(dataclasses.replace(MODEL_PRESETS["tiny"], **case.get("model", {})), seed=seed)
    init = ds_asynchzp.initialize if case.get("async_hzp") is not None else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                      config=ds_config(case))
    expected = "HierarchicalZeroOptimizer" if case.get("async_hzp") is not None else "DeepSpeedZeroOptimizer_Stage3"
    assert type(engine.optimizer).__name__ == expected, type(engine.optimizer).__name__
    return engine


def micro_batch(step: int, micro: int, rank: int, world: int, size: int):
    first = (micro * world + rank) * size
    pairs = [batch_for(step * GLOBAL_BATCH + first + i, 0, 0, 1, 1, SEQ_LEN, seed=DATA_SEED) for i in range(size)]
    return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])


def train(engine, case: dict, first_step: int, steps: int) -> list:
    """Mean loss over the global batch of each step."""
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    assert world * case["micro_batch"] * case["gas"] == GLOBAL_BATCH
    losses = []
    for step in range(first_step, first_step + steps):
        total = torch.zeros(1, dtype=torch.float64)
        for micro in range(case["gas"]):
            x, y = micro_batch(step, micro, rank, world, case["micro_batch"])
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()
        deepspeed.comm.all_reduce(total)
        losses.append(float(total) / (world * case["gas"]))
    return losses


def consolidated(engine) -> dict:
    """Every parameter in full, on every rank: the fp32 master weights (trainable) or the gathered value."""
    out = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            out[name] = deepspeed.utils.safe_get_full_fp32_param(param).detach().float().clone().view(param.ds_shape)
        else:
            with deepspeed.zero.GatheredParameters([param]):
                out[name] = param.data.detach().float().clone()
    return out


def max_diff(params: dict, reference: dict) -> float:
    assert set(params) == set(reference), sorted(set(params) ^ set(reference))
    return max(float((params[name] - reference[name]).abs().max()) for name in reference)


def _clobber_frozen(engine) -> None:
    """Zero the frozen parameter, so that only a load that restores frozen parameters brings it back."""
    frozen = engine.module.frozen_pos
    with deepspeed.zero.GatheredParameters([frozen], modifier_rank=0):
        frozen.data.zero_()


def _scheduler_state(engine) -> dict:
    return {key: value for key, value in engine.lr_scheduler.state_dict().items() if isinstance(value, (int, float))}


# ----------------------------------------------------------------------------------------------------- save
def save_run(payload: dict) -> dict:
    """Train each case `save_at` steps, save, record the consolidated weights, then train on (the reference)."""
    deepspeed.init_distributed(dist_backend="gloo")
    rank = deepspeed.comm.get_rank()
    results = {"rank": rank}
    for case in payload["cases"]:
        engine = build_engine(case)
        before = train(engine, case, 0, payload["save_at"])
        directory = os.path.join(payload["root"], case["name"])
        reference = consolidated(engine)
        scheduler_at_save = _scheduler_state(engine)
        engine.save_checkpoint(directory, tag=f"step{payload['save_at']}")
        refused_16bit = None
        if case.get("save_16bit"):
            try:
                assert engine.save_16bit_model(os.path.join(directory, "16bit"))
            except NotImplementedError as error:  # DeepSpeed's refusal, on every rank before any collective
                refused_16bit = str(error)
        if rank == 0:
            torch.save(reference, os.path.join(directory, "reference.pt"))
        if case.get("autoep_size"):
            # Each rank holds its own experts: the reference of a resumed rank is that of the saved rank with the
            # same experts (ranks r and r + k * ep_size hold the same ones).
            torch.save(reference, os.path.join(directory, f"reference_rank{rank}.pt"))
        # Saving must not change the run: the uninterrupted reference continues from here.
        assert max_diff(consolidated(engine), reference) == 0.0
        after = train(engine, case, payload["save_at"], payload["steps_after"])
        results[case["name"]] = {"losses_before": before, "losses_after": after, "scheduler_at_save": scheduler_at_save,
                                 "files": sorted(os.listdir(directory)), "refused_16bit": refused_16bit,
                                 "host_optimizer": type(engine.optimizer.optimizer).__name__}
        engine.destroy()
        if case.get("resume_same_size"):
            results[case["name"]]["resumed"] = _resume_same_size(case, directory, f"step{payload['save_at']}",
                                                                 reference, payload["save_at"], payload["steps_after"])
    return results


def _resume_same_size(case: dict, directory: str, tag: str, reference: dict, save_at: int, steps: int) -> dict:
    """A fresh engine (another initialisation, the frozen parameter zeroed) loads the tag directly, at the world
    and layout it was saved at, and trains the steps the uninterrupted run trained after the save."""
    engine = build_engine(case, seed=8)
    _clobber_frozen(engine)
    engine.load_checkpoint(directory, tag=tag)
    result = {"global_steps": engine.global_steps, "scheduler_after_load": _scheduler_state(engine),
              "max_param_diff": max_diff(consolidated(engine), reference),
              "host_optimizer": type(engine.optimizer.optimizer).__name__}
    result["losses_after"] = train(engine, case, save_at, steps)
    engine.destroy()
    return result


# ----------------------------------------------------------------------------------------------------- kill
def kill_run(payload: dict) -> dict:
    """Save a tag, train on, and save the same tag again while one rank SIGKILLs itself in the middle."""
    deepspeed.init_distributed(dist_backend="gloo")
    case = payload["case"]
    engine = build_engine(case)
    train(engine, case, 0, 1)
    engine.save_checkpoint(payload["dir"], tag="ckpt")
    reference = consolidated(engine)
    if deepspeed.comm.get_rank() == 0:
        torch.save(reference, os.path.join(payload["dir"], "reference_ckpt.pt"))
    train(engine, case, 1, 1)
    deepspeed.comm.barrier()  # reference written before anyone dies
    os.environ[FAULT_RANK_ENV] = str(payload["fault_rank"])
    engine.save_checkpoint(payload["dir"], tag="ckpt")
    raise AssertionError("the save with a fault hook returned")


# --------------------------------------------------------------------------------------------------- resume
def _load(engine, case: dict):
    kwargs = {k: case[k] for k in ("load_module_only", "load_optimizer_states") if k in case}
    return engine.load_checkpoint(case["load_dir"], tag=case.get("tag"), **kwargs)


def resume_case(case: dict) -> dict:
    rank = deepspeed.comm.get_rank()
    engine = build_engine(case, seed=8)  # a different initialisation, which the load must overwrite
    result = {}
    if case.get("clobber_frozen"):
        _clobber_frozen(engine)
    if case.get("errors"):
        # Each load below must fail before any collective, on every rank alike; the engine stays usable.
        result["errors"] = {}
        for label, load_dir in case["errors"].items():
            try:
                engine.load_checkpoint(load_dir, **case.get("error_kwargs", {}).get(label, {}))
                result["errors"][label] = None
            except CheckpointError as error:
                result["errors"][label] = str(error)
        result["losses_after"] = train(engine, case, 0, 1)  # still in step on every rank
        engine.destroy()
        return result
    path, client_state = _load(engine, case)
    result["load_path"] = path
    result["host_optimizer"] = type(engine.optimizer.optimizer).__name__
    result["global_steps"] = engine.global_steps
    result["scheduler_after_load"] = _scheduler_state(engine)
    if case.get("reference"):
        reference = torch.load(case["reference"].format(rank=rank), weights_only=True)
        result["max_param_diff"] = max_diff(consolidated(engine), reference)
    if case.get("steps_after"):
        result["losses_after"] = train(engine, case, case["first_step"], case["steps_after"])
    if case.get("save_again"):
        train(engine, case, engine.global_steps, 1)
        engine.save_checkpoint(case["load_dir"], tag="ckpt")
        result["global_steps_saved_again"] = engine.global_steps
    engine.destroy()
    result["rank"] = rank
    return result


def resume_run(payload: dict) -> dict:
    deepspeed.init_distributed(dist_backend="gloo")
    results = {"rank": deepspeed.comm.get_rank()}
    for case in payload["cases"]:
        results[case["name"]] = resume_case(case)
    return results
