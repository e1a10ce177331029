"""Rank-side code of the multi-rank tests (run by ds_asynchzp.bench.launch in fresh processes).

One launch trains several cases one after another on the same ranks (process start-up dominates the cost on a
small machine), and compares each case with its stock ZeRO-3 baseline in-process.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import shutil
import tempfile
import time

import deepspeed
import torch

import ds_asynchzp
from ds_asynchzp.platform import ledger
from ds_asynchzp.comm import delay_injection
from ds_asynchzp.bench.zero3_knobs import NO_OVERLAP as BENCH_ZERO3_KNOBS
from ds_asynchzp.bench.data import batch_for
from ds_asynchzp.models.gpt import MODEL_PRESETS, build_model
from ds_asynchzp.measure.memory import model_state_bytes
from ds_asynchzp.formulas.sizing import padded_num_params
from ds_asynchzp.platform.deepspeed_internals import autoep_groups

# The benchmark's no-overlap ZeRO-3 knobs (every arm the same; nothing stays gathered between passes), with small
# gradient buckets so several bucket flushes happen per backward. They turn DeepSpeed's prefetch off, which
# turns AsyncHZP's replay off by default; the cases ask for the replay (`REPLAY_DEPTH`) so that it is exercised.
ZERO3_KNOBS = dict(BENCH_ZERO3_KNOBS, reduce_bucket_size=20000)
REPLAY_DEPTH = 2
# What users run: DeepSpeed's own defaults for persistence threshold, prefetch bucket, max live parameters,
# reuse distance and overlap_comm (only the bucket is small, for several flushes per backward).
DEFAULT_KNOBS = {"stage": 3, "reduce_bucket_size": 20000}
BUCKET_ELEMENTS = 20000
# Steps 0 and 1 carry DeepSpeed's trace-order checks and the prefetch's first recording.
FIRST_STEADY_STEP = 2
WORLD_TIMEOUT_S = 240
# Collectives of the tests' own inspections (check_shards), left out of the measured bytes.
CHECK_TAG = "test.check_shards"
INSPECTION_TAGS = (CHECK_TAG, "asynchzp.inspect", "asynchzp.expert.inspect")


def ds_config(case: dict) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": case.get("micro_batch", 2),
        "gradient_accumulation_steps": case["gas"],
        "optimizer": {"type": "AdamW", "params": {"lr": case.get("lr", 3e-3), "weight_decay": 0.01}},
        "gradient_clipping": case.get("clip", 1.0),
        "zero_optimization": dict(DEFAULT_KNOBS if case.get("default_knobs") else ZERO3_KNOBS, **case.get("zero", {})),
        "steps_per_print": 10**9,
    }
    if case.get("dtype") == "bf16":
        config["bf16"] = {"enabled": True}
    if case.get("dtype") == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if case.get("async_hzp") is not None:
        # Under the no-prefetch knobs the replay is asked for, so that it stays exercised; with DeepSpeed's
        # default knobs the depth resolves by itself.
        replay = {} if case.get("default_knobs") else {"prefetch_depth": REPLAY_DEPTH}
        config["async_hzp"] = dict(replay, **case["async_hzp"])
    config.update(case.get("ds_extra", {}))
    if case.get("autoep_size"):
        from ds_asynchzp.models.mixtral import autoep_config
        config["expert_parallel"] = autoep_config(case["autoep_size"])
    return config


def _padded(numel: int, world: int) -> int:
    return padded_num_params([numel], world)


def _element_counts(model, world: int, which=lambda param: True) -> dict:
    """P_g, P_r, P_t of ds_asynchzp.traffic (padded element counts), of the parameters `which` selects."""
    counts = {"gathered": 0, "reduced": 0, "trainable": 0, "all": 0}
    # ZeRO-3 fetches a module's own parameters when the module runs: a tied weight is gathered once per module.
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if which(param):
                counts["gathered"] += _padded(getattr(param, "ds_numel", param.numel()), world)
    for name, param in model.named_parameters():
        if not which(param):
            continue
        numel = _padded(getattr(param, "ds_numel", param.numel()), world)
        counts["all"] += numel
        if param.requires_grad:
            counts["trainable"] += numel
            if name != "unused":
                counts["reduced"] += numel
    return counts


def _families(engine):
    """Per AsyncHZP family: its layout and its element counts, padded to its optimizer group."""
    if not hasattr(engine.optimizer, "hzp_family_layouts"):
        return None
    owners = {p.family.name: p.owns for p in engine.optimizer.hzp_placements}
    return {name: {"layout": {"world": l.world, "node_size": l.node_size, "d_p": l.param_shard_size,
                              "d_g": l.grad_shard_size, "d_o": l.optimizer_shard_size},
                   "elements": _element_counts(engine.module, l.optimizer_shard_size, owners[name])}
            for name, l in engine.optimizer.hzp_family_layouts().items()}


def _full_params(engine) -> dict:
    out = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            out[name] = param.detach().float().clone()
    return out


def _build_engine(case: dict):
    torch.manual_seed(case.get("seed", 7))
    if case.get("model") == "moe":
        from ds_asynchzp.models.mixtral import build_moe_model
        model = build_moe_model("moe", case.get("seq_len", 32), seed=case.get("seed", 7))
        engine, *_ = ds_asynchzp.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                           if p.requires_grad],
                                            config=ds_config(case))
        return engine
    model_config = dataclasses.replace(MODEL_PRESETS[case.get("model", "tiny")], moe_experts=case.get("moe_experts", 0))
    if case.get("foreign_partition_group"):
        # One extra (unused) layer partitioned over half of the world: a group async_hzp does not lay out.
        world = deepspeed.comm.get_world_size()
        halves = [deepspeed.comm.new_group(list(range(h, h + world // 2))) for h in (0, world // 2)]
        mine = halves[deepspeed.comm.get_rank() // (world // 2)]
        with deepspeed.zero.Init(data_parallel_group=mine, config_dict_or_path=ds_config(case)):
            extra = torch.nn.Linear(8, 8)
        model = build_model(model_config, seed=case.get("seed", 7))
        model.extra = extra
        engine, *_ = ds_asynchzp.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                           if p.requires_grad],
                                            config=ds_config(case))
        return engine
    if case.get("zero_init"):
        with deepspeed.zero.Init(config_dict_or_path=ds_config(case)):
            model = build_model(model_config, seed=case.get("seed", 7))
    else:
        model = build_model(model_config, seed=case.get("seed", 7))
    init = deepspeed.initialize if case.get("plain_deepspeed_initialize") else ds_asynchzp.initialize
    engine, *_ = init(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                      config=ds_config(case))
    return engine


def _shared_dir(case: dict) -> str:
    """A checkpoint directory every rank agrees on (rank 0 picks it, the others receive its name)."""
    holder = [tempfile.mkdtemp(prefix="ahzp-ckpt-") if deepspeed.comm.get_rank() == 0 else None]
    deepspeed.comm.broadcast_object_list(holder, src=0)
    return holder[0]


def _shards_vs_consolidated(engine) -> float:
    """Max relative difference between what a fetch would build from AsyncHZP's parameter shards (and, for
    persistent parameters, the data they keep) and the consolidated parameters: the fp32 master weights
    all-gathered over the optimizer group (fp32 runs: the values the step wrote), or for frozen parameters
    DeepSpeed's own gather of its partitions. Neither reference changes what the next step fetches."""
    optimizer, worst = engine.optimizer, 0.0

    def diff(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    for param in sorted(engine.module.parameters(), key=lambda p: p.ds_id):
        from_shards = optimizer.hzp_gather.full_value(param).float()
        kept = param.data.detach().float() if param.ds_status.name == "AVAILABLE" else None
        if param.requires_grad:
            ref = deepspeed.utils.safe_get_full_fp32_param(param).view(param.ds_shape).float()
        elif kept is not None:
            ref = kept
        else:
            with deepspeed.zero.GatheredParameters([param]):
                ref = param.data.detach().float().clone()
        worst = max(worst, diff(from_shards, ref), diff(kept, ref) if kept is not None else 0.0)
    return worst


def _error_feedback_norm(engine):
    feedback = getattr(engine.optimizer, "hzp_error_feedback", None)
    return None if feedback is None else float(feedback.residual.double().norm())


def _nonzero_padding(engine) -> int:
    """Elements past a parameter's end, in any row of any parameter shard, that are not zero (quantization reads
    whole blocks, padding included)."""
    nonzero = 0
    for placement in engine.optimizer.hzp_placements:
        nonzero += _nonzero_padding_of(placement.shards)
    return nonzero


def _nonzero_padding_of(shards) -> int:
    layout = shards.layout
    j = shards.shard_index
    nonzero = 0
    for buffer in shards.buffers:
        for param in buffer.params:
            atoms = buffer.atoms(param)
            for t in range(buffer.rows):
                start = (j + t * layout.param_shard_size) * atoms.shape[1]
                valid = max(0, min(atoms.shape[1], param.ds_numel - start))
                nonzero += int(atoms[t, valid:].count_nonzero())
    return nonzero


class _LargestAllocation(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor storage created by any op run under it (views and in-place ops create none)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _record_hzp_allocations(engine, recorder) -> None:
    """Run AsyncHZP's per-bucket gradient path, boundary reduction and refresh under `recorder`."""
    optimizer = engine.optimizer
    for name in ("_hzp_reduce_bucket", "partition_grads", "hzp_finish_window", "_post_step"):
        original = getattr(optimizer, name)

        def recorded(*args, _original=original, **kwargs):
            with recorder:
                return _original(*args, **kwargs)

        setattr(optimizer, name, recorded)
    from ds_asynchzp.platform.deepspeed_internals import STAGE3_AVG_SCATTER_GRADS
    setattr(optimizer, STAGE3_AVG_SCATTER_GRADS, optimizer._hzp_reduce_bucket)


def _step_record(mark: int) -> dict:
    summary = ledger.summary(mark, skip_tags=INSPECTION_TAGS)
    records = ledger.get().since(mark)
    summary["tags"] = {}
    for record in records:
        summary["tags"][record.tag] = summary["tags"].get(record.tag, 0) + 1
    return summary


def _sequences_by_communicator(mark: int) -> dict:
    """What NCCL matches collectives by: the order of (op, size) on each communicator. A communicator is one
    issuing thread's group (threads never share one), so records are keyed by thread and group ranks. Over a
    whole case, not per step: a job submitted in one step may run in the next, at a different time per rank."""
    by_group = {}
    for r in ledger.get().since(mark):
        by_group.setdefault(f"{r.thread}|{list(r.group_ranks)}", []).append((r.op, r.buffer_bytes))
    return by_group


def edit_a_weight(engine, rank: int) -> None:
    """A user edits a weight in place on rank 0 (stock semantics: the partitions follow the broadcast)."""
    weight = engine.module.blocks[0].mlp.fc.weight
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
        if rank == 0:
            weight.data.mul_(0.5)


def train_step(engine, case: dict, step: int, rank: int, world: int) -> float:
    """One optimizer step of `case` (its `gas` micro-steps on the seeded data); the mean micro-step loss."""
    total = 0.0
    for micro in range(case["gas"]):
        x, y = batch_for(step, micro, rank, world, case.get("micro_batch", 2), case.get("seq_len", 32), seed=11)
        loss = engine(x, y)
        engine.backward(loss)
        if case.get("extra_backward") and micro == case["gas"] - 1:
            # Another backward after the window's last: the window reopens and is summed across nodes again.
            engine.backward(engine(x, y) * 0.5)
        engine.step()
        total += loss.item()
    return total / case["gas"]


def train_case(case: dict) -> dict:
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    engine = _build_engine(case)
    ledger.get().set_expert_groups(*autoep_groups())
    optimizer_class = type(engine.optimizer).__name__
    losses, steps, shard_diffs, safe_grads = [], [], [], []
    resumed_feedback = None
    recorder = None
    if case.get("record_allocations"):
        recorder = _LargestAllocation()
        _record_hzp_allocations(engine, recorder)
    case_mark = ledger.mark()
    for step in range(case["steps"]):
        if step == case.get("modify_at"):
            edit_a_weight(engine, rank)
        if step == case.get("discard_backward_at"):
            # A backward whose gradients the user throws away: nothing of it may reach the next step.
            x, y = batch_for(step + 1000, 0, rank, world, case.get("micro_batch", 2), case.get("seq_len", 32), seed=11)
            engine.backward(engine(x, y) * 3.0)
            engine.optimizer.zero_grad()
        if step == case.get("resume_at"):
            # Save, throw the engine away, and continue from the checkpoint in a fresh one.
            directory = _shared_dir(case)
            engine.save_checkpoint(directory, tag="resume")
            saved_feedback = _error_feedback_norm(engine)
            engine.destroy()
            engine = _build_engine(dict(case, seed=case.get("seed", 7) + 1))  # different init: must be overwritten
            engine.load_checkpoint(directory, tag="resume")
            deepspeed.comm.barrier()  # every rank has read it
            if rank == 0:
                shutil.rmtree(directory, ignore_errors=True)
            if case.get("forget_error_feedback"):
                # The negative control: as if the checkpoint had not kept the error-feedback residual.
                engine.optimizer.hzp_error_feedback.reset()
            resumed_feedback = (saved_feedback, _error_feedback_norm(engine))
        if step == FIRST_STEADY_STEP:
            # Bytes are compared over whole steady steps: a refresh submitted at the end of one step runs into
            # the next, so per-step windows split it by timing; from a quiet point to the end they do not.
            if hasattr(engine.optimizer, "hzp_quiesce_params"):
                engine.optimizer.hzp_quiesce_params()
            steady_mark = ledger.mark()
        mark, total, step_started = ledger.mark(), 0.0, time.perf_counter()
        for micro in range(case["gas"]):
            x, y = batch_for(step, micro, rank, world, case.get("micro_batch", 2), case.get("seq_len", 32), seed=11)
            loss = engine(x, y)
            engine.backward(loss)
            if case.get("safe_grad") and micro == case["gas"] - 1:
                # Between the last backward and step(): the full gradient of the accumulation window.
                grad = deepspeed.utils.safe_get_full_grad(engine.module.blocks[0].mlp.fc.weight)
                safe_grads.append(float(grad.double().norm()))
            engine.step()
            total += loss.item()
        losses.append(total / case["gas"])
        steps.append(_step_record(mark))
        step_ended = time.perf_counter()
        steps[-1]["exposed_comm_s"] = ledger.get().exposed_seconds(step_started, step_ended)
        steps[-1]["comm_busy_s"] = ledger.get().busy_seconds(step_started, step_ended, mark)
        waits = {}
        for start, end, what in ledger.get().waits_between(step_started, step_ended):
            waits[what] = waits.get(what, 0.0) + min(end, step_ended) - max(start, step_started)
        steps[-1]["exposed_by_kind"] = waits
        steps[-1]["seconds"] = step_ended - step_started
        if hasattr(engine.optimizer, "hzp_gather"):
            steps[-1]["prefetch"] = dict(engine.optimizer.hzp_gather.stats)
        if hasattr(engine.optimizer, "hzp_buffer_allocations"):
            steps[-1]["buffer_allocations"] = sum(engine.optimizer.hzp_buffer_allocations().values())
            # The gather pool after the step's trim: what it owns, and the bound that trim stated.
            pool = engine.optimizer.hzp_pool
            steps[-1]["pool_owned_bytes"], steps[-1]["pool_bound_bytes"] = pool.owned_bytes, pool.bound_bytes
        if case.get("check_shards"):
            # Its gathers are an inspection, not training traffic: tagged, and left out of the step's bytes.
            with ledger.tagged(CHECK_TAG):
                shard_diffs.append(_shards_vs_consolidated(engine))
        if case.get("check_padding"):
            steps[-1]["nonzero_padding"] = _nonzero_padding(engine)
    if hasattr(engine.optimizer, "hzp_quiesce_params"):
        engine.optimizer.hzp_quiesce_params()     # the last refresh is in the sequence too
    sequences = _sequences_by_communicator(case_mark)
    steady = ledger.summary(steady_mark, skip_tags=INSPECTION_TAGS)
    steady_steps = case["steps"] - FIRST_STEADY_STEP
    by_tag = {}
    for record in ledger.get().since(steady_mark):
        if record.tag in INSPECTION_TAGS:
            continue
        part = by_tag.setdefault(record.tag or record.op, {"intra_node": 0.0, "inter_node": 0.0})
        part["inter_node" if record.inter_node else "intra_node"] += record.wire_bytes / steady_steps
    steady_per_step = {"intra_node": steady["intra_node"] / steady_steps,
                       "inter_node": steady["inter_node"] / steady_steps,
                       "by_op": {op: {k: v / steady_steps for k, v in per_op.items()}
                                 for op, per_op in steady["by_op"].items()},
                       "by_family": {name: {k: v / steady_steps for k, v in part.items()}
                                     for name, part in steady["by_family"].items()},
                       "by_tag": by_tag}
    if case.get("then_stock_steps"):
        # A second engine on the same module, after destroy(): it must start from the trained weights.
        engine.destroy()
        module = engine.module
        stock_config = ds_config({k: v for k, v in case.items() if k != "async_hzp"})
        engine, *_ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters()
                                                                          if p.requires_grad], config=stock_config)
        for step in range(case["steps"], case["steps"] + case["then_stock_steps"]):
            losses.append(train_step(engine, case, step, rank, world))
    result = {
        "largest_param_elements": max(_padded(p.ds_numel, world) for p in engine.module.parameters()),
        "losses": losses,
        "ledger_steps": steps,
        "optimizer_class": optimizer_class,
        "model_state_bytes": model_state_bytes(engine),
        "elements": _element_counts(engine.module, world),
        # AsyncHZP pads each parameter to a multiple of its optimizer group, not of the world.
        "elements_by_optimizer_group": _element_counts(
            engine.module, engine.optimizer.hzp_layout.sizes.optimizer_shard_size)
        if hasattr(engine.optimizer, "hzp_layout") else None,
        "families": _families(engine),
        "grad_norm": float(engine.get_global_grad_norm()),
        "shard_diffs": shard_diffs,
        "safe_grads": safe_grads,
        "largest_allocation": recorder.largest if recorder else None,
        "sequences": sequences,
        "steady_per_step": steady_per_step,
        "comm_delay": case.get("comm_delay", ""),
        "hazard_case": bool(case.get("hazard_case")),
        "layout": (engine.optimizer.hzp_layout.as_dict() if hasattr(engine.optimizer, "hzp_layout") else None),
        "error_feedback_norm": _error_feedback_norm(engine),
        "resumed_error_feedback": resumed_feedback,
    }
    result["final_params"] = _full_params(engine)
    engine.destroy()
    logger = deepspeed.comm.comms_logger
    if logger.enabled:
        # What DeepSpeed's comms logger recorded; it is process-wide, so it is turned off for the next case.
        result["comms_logged_ops"] = sorted(logger.get_operation_names())
        logger.enabled = False
        logger.reset_data()
    return result


def run_cases(payload: dict) -> dict:
    """Train each case; a case with "compare_to" reports max relative differences against that case."""
    # A collective of the world group that cannot complete fails within minutes, naming itself, instead of
    # waiting for gloo's 30-minute default (the launch's own timeout would stop it with less to say).
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=WORLD_TIMEOUT_S))
    ledger.install()
    if payload.get("register"):
        ds_asynchzp.register()
    results = {}
    for case in payload["cases"]:
        started = time.perf_counter()
        # Test-only delays around every collective of the package (see ds_asynchzp.comm.delay_injection).
        os.environ["DS_ASYNCHZP_COMM_DELAY_MS"] = case.get("comm_delay", "")
        delay_injection.reset()
        if case.get("expect_error"):
            try:
                train_case(case)
                result = {"error": None}
            except Exception as error:  # the case checks which error, and that nothing hangs after it
                result = {"error": f"{type(error).__name__}: {error}"}
            print(f"case {case['name']}: {(result['error'] or 'no error').splitlines()[0][:120]}", flush=True)
            results[case["name"]] = result
            continue
        result = train_case(case)
        # Progress in the rank log: tells a slow launch from a stuck one when a launch times out.
        print(f"case {case['name']}: {case['steps']} steps in {time.perf_counter() - started:.1f} s", flush=True)
        baseline = results.get(case.get("compare_to"))
        if baseline is not None:
            result["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], baseline["losses"]))
            if result["safe_grads"] and baseline["safe_grads"]:
                result["max_safe_grad_rel_diff"] = max(abs(a - b) / abs(b) for a, b in
                                                       zip(result["safe_grads"], baseline["safe_grads"]))
            result["bit_identical_losses"] = result["losses"] == baseline["losses"]
            result["param_rel_diff"] = {
                n: float((result["final_params"][n] - t).abs().max() / t.abs().max().clamp_min(1e-30))
                for n, t in baseline["final_params"].items()}
            delta = sum(float((result["final_params"][n] - t).pow(2).sum()) for n, t in baseline["final_params"].items())
            norm = sum(float(t.pow(2).sum()) for t in baseline["final_params"].values())
            result["param_rel_l2_diff"] = math.sqrt(delta / norm)
        results[case["name"]] = result
    for result in results.values():
        result.pop("final_params", None)
    results["rank"] = int(os.environ["RANK"])
    # No rank leaves while another may still be inside a collective with it (a peer gone mid-collective is a
    # failure of its own, not the one under test).
    deepspeed.comm.barrier()
    return results


def train_until_killed(payload: dict) -> dict:
    """Train; the victim rank sends itself `payload["signal"]` (SIGKILL by default) in the middle of a step
    (after a forward, with gathers and reductions in flight on the communication threads), having written the
    time to `kill_time_file`. The others must end on their own, naming it."""
    import signal

    deepspeed.init_distributed(dist_backend="gloo")
    hzp = {"node_size": payload["node_size"], **payload.get("async_hzp", {})}
    case = {"name": "killed", "gas": 2, "steps": 50, "async_hzp": hzp}
    engine = _build_engine(case)
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    for step in range(case["steps"]):
        for micro in range(case["gas"]):
            x, y = batch_for(step, micro, rank, world, 2, 32, seed=11)
            loss = engine(x, y)
            if step == 2 and micro == 1 and rank == payload["victim"]:
                with open(payload["kill_time_file"], "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), getattr(signal, payload.get("signal", "SIGKILL")))
            engine.backward(loss)
            engine.step()
    return {"rank": rank, "survived": True}


def finish_unevenly(payload: dict) -> dict:
    """Train a step, then one rank returns at once while the others take a few more seconds: the early rank ends
    normally (its process exits), which must not look like a lost rank to the others' peer monitors."""
    deepspeed.init_distributed(dist_backend="gloo")
    case = {"name": "uneven", "gas": 1, "steps": 1, "async_hzp": {"node_size": payload["node_size"]}}
    engine = _build_engine(case)
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    x, y = batch_for(0, 0, rank, world, 2, 32, seed=11)
    engine.backward(engine(x, y))
    engine.step()
    deepspeed.comm.barrier()
    if rank != payload["early"]:
        time.sleep(payload["linger_s"])  # several polls of the monitor after the early rank has gone
    return {"rank": rank}
