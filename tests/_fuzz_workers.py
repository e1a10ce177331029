"""Rank-side code of the differential fuzzer: each case trains stock ZeRO-3, then AsyncHZP, on the same ranks,
model, data and seed, and compares them by the verdict of tests/fuzz_verdict.py (tests/fuzz_models.py draws the
cases): losses, consolidated parameters and GatheredParameters reads bit for bit; where the gradients are summed
in another order than stock's, each step's reduced gradients (recorded in the stock run) within their rounding
bound, with stock's then taken in their place (teacher forcing).

A planted defect (a case's `plant`) is applied to AsyncHZP only, for that case, to show the comparison catches it.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import time
import traceback

import deepspeed
import torch

import ds_asynchzp
from tests import fuzz_models, fuzz_verdict

WORLD_TIMEOUT_S = 240


def ds_config(spec: dict, hierarchical: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": spec["model"]["micro_batch"],
        "gradient_accumulation_steps": spec["gas"],
        "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"], "weight_decay": spec["weight_decay"]}},
        "gradient_clipping": spec["clip"],
        "zero_optimization": dict({"stage": 3}, **spec["zero"]),
        "steps_per_print": 10**9,
    }
    if spec.get("offload"):
        # Both arms: DeepSpeed then steps with DeepSpeedCPUAdam on host master weights (stock's offload path is
        # the reference).
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if spec.get("bf16"):
        config["bf16"] = {"enabled": True}
    if hierarchical:
        config["async_hzp"] = dict(spec["layout"], node_size=spec["node_size"], async_comm=spec["async_comm"],
                                   log_layout=False, **{k: spec[k] for k in ("offload_pipeline", "boundary_bucket_size")
                                                        if k in spec})
        if spec.get("offload") and fuzz_verdict.step_partitions_differ(spec):
            # The teacher forcing of each Adam update (d_o < N) rewrites the master weights after Stage 3's host
            # step of a sub-group; the pipelined step has copied its pieces back and begun their refresh by then,
            # so these cases step whole (tests/test_offload_pipeline.py shows the two give the same bits).
            config["async_hzp"]["offload_pipeline"] = False
    return config


def _gathered_param(model):
    """The parameter the training loop reads (and may edit) outside forward: a branch's if there is one."""
    branch = model.branch_parameters()
    return branch[0] if branch else next(model.parameters())


def _sequence_parallel_state(sp: int):
    """ALST's SP state (the mpu) with degree `sp`, set up anew when the degree changes; None for sp 1. DeepSpeed
    keeps the mpu of the last engine built with one in `groups.mpu`: cleared, so a later case without SP is not
    read as one."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups

    groups.mpu = None
    if sp == 1:
        return None
    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None:
        if parallel_state_sp.get_sequence_parallel_world_size() == sp:
            return parallel_state_sp
        parallel_state_sp._release_sequence_parallel_groups()
    parallel_state_sp.initialize_sequence_parallel(sp)
    return parallel_state_sp


def _sp_batch(spec: dict, step: int, micro: int, rank: int, sp: int):
    """The sequence of this rank's SP group (consecutive ranks) and this rank's slice of it."""
    x, y = fuzz_models.batch(spec["model"], step, micro, rank // sp, spec["seed"])
    part = slice(rank % sp * x.shape[1] // sp, (rank % sp + 1) * x.shape[1] // sp)
    return x[:, part], y[:, part]


def _train(spec: dict, hierarchical: bool, gradients=None) -> dict:
    """One arm. `gradients`: a `fuzz_verdict.StockRecord` (stock) or `Forcing` (AsyncHZP), which reads each
    step's reduced gradients between the window's last backward and the step, and what the step left after it."""
    rank = deepspeed.comm.get_rank()
    sp = spec.get("sp", 1)
    mpu = _sequence_parallel_state(sp)
    model = fuzz_models.build(spec["model"], seed=spec["seed"])
    group = None if mpu is None else mpu.get_sequence_parallel_group()
    if group is not None:
        model.use_sequence_parallel_group(group)
    engine, *_ = ds_asynchzp.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                       if p.requires_grad],
                                        config=ds_config(spec, hierarchical), mpu=mpu)
    if gradients is not None:
        gradients.attach(engine, model)
    toggled = model.toggled_parameters()
    losses, outside_reads, norms = [], [], []
    for step in range(spec["steps"]):
        for param in toggled:
            param.requires_grad_(step % 2 == 0)
        if step == spec.get("modify_at"):
            with deepspeed.zero.GatheredParameters([_gathered_param(model)], modifier_rank=0):
                if rank == 0:
                    _gathered_param(model).data.mul_(0.75)
        total = 0.0
        for micro in range(spec["gas"]):
            if group is None:
                x, y = fuzz_models.batch(spec["model"], step, micro, rank, spec["seed"])
                loss = engine(x, y, step, micro, rank)
            else:  # ALST's recipe: the sequence's token-weighted loss over its SP group
                x, y = _sp_batch(spec, step, micro, rank, sp)
                loss = ds_asynchzp.sequence_parallel_loss(engine(x, y, step, micro, rank) * y.numel(), y.numel(),
                                                          group)
            engine.backward(loss)
            boundary = gradients is not None and micro == spec["gas"] - 1
            if boundary:
                gradients.boundary()
            engine.step()
            if boundary:
                gradients.after_step()
            total += loss.item()
        losses.append(total / spec["gas"])
        norms.append(float(engine.get_global_grad_norm()))   # what the step clipped with
        if step == spec.get("gathered_read_at"):
            with deepspeed.zero.GatheredParameters([_gathered_param(model)]):
                outside_reads.append(float(_gathered_param(model).data.double().norm()))
    for param in toggled:
        param.requires_grad_(True)
    final = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            final[name] = param.detach().double().clone()
    optimizer = type(engine.optimizer).__name__
    host_optimizer = type(engine.optimizer.optimizer).__name__
    engine.destroy()
    _sequence_parallel_state(1)
    return {"losses": losses, "final": final, "outside_reads": outside_reads, "optimizer": optimizer,
            "host_optimizer": host_optimizer, "grad_norms": norms}


def _compare(stock: dict, ours: dict, forcing=None) -> dict:
    """The verdict of tests/fuzz_verdict.py, the same on every rank (a collective): losses (every rank's, every
    step), consolidated parameters and GatheredParameters reads bit for bit; in a case whose summation order
    differs (`forcing`: the teacher forcing), each step's reduced gradients, and where d_o < N the clipping norm and
    each Adam update, within their bounds (`bound_ratios`: the largest |difference| / bound of each, over every
    rank). The relative differences are reported for a failure's diagnosis."""
    loss_diff = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(ours["losses"], stock["losses"]))
    delta = sum(float((ours["final"][n] - t).pow(2).sum()) for n, t in stock["final"].items())
    norm = sum(float(t.pow(2).sum()) for t in stock["final"].values())
    reads = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(ours["outside_reads"], stock["outside_reads"])]
    params_equal = ours["final"].keys() == stock["final"].keys() and all(
        torch.equal(ours["final"][n], t) for n, t in stock["final"].items())
    local = [ours["losses"] != stock["losses"], not params_equal, ours["outside_reads"] != stock["outside_reads"]]
    kinds = sorted(forcing.verdict.ratio) if forcing is not None else []
    if forcing is not None:
        local += [bool(forcing.problems)] + [forcing.verdict.ratio[k] for k in kinds]
    worst = torch.tensor([float(x) for x in local], dtype=torch.float64)
    deepspeed.comm.all_reduce(worst, op=deepspeed.comm.ReduceOp.MAX)
    worst = worst.tolist()
    mismatches = [what for what, differs in zip(("losses", "parameters", "GatheredParameters reads"), worst)
                  if differs]
    result = {"exact_mismatches": mismatches, "forced": forcing is not None,
              "max_loss_rel_diff": loss_diff, "param_rel_l2_diff": math.sqrt(delta / max(norm, 1e-300)),
              "outside_read_rel_diff": max(reads, default=0.0),
              "losses": ours["losses"], "stock_losses": stock["losses"], "optimizer": ours["optimizer"],
              "host_optimizer": ours["host_optimizer"], "stock_host_optimizer": stock["host_optimizer"],
              "stock_grad_norms": stock["grad_norms"]}
    if forcing is not None:
        verdict = forcing.verdict
        result.update(forcing_problem_on_some_rank=bool(worst[3]), forcing_problems=forcing.problems,
                      bound_ratios=dict(zip(kinds, worst[4:])), local_bound_ratios=dict(verdict.ratio),
                      local_worst=dict(verdict.worst), local_max_abs_diff=dict(verdict.max_abs_diff),
                      local_elements_differing=dict(verdict.elements_differing))
    return result


@contextlib.contextmanager
def planted(name: str):
    """A defect the fuzzer must catch, applied to AsyncHZP's classes for one case (and removed after it)."""
    from ds_asynchzp.comm import grad_reduce
    from ds_asynchzp.state import grad_shards
    if name == "zero_stale_gradient":
        # Forget the last window's gradient at the end of every step (the behaviour before the fix: stock keeps it
        # for parameters that get no gradient in the next window's first backward).
        owner, attribute = grad_shards.GradShards, "end_step"
        original = owner.end_step

        def replacement(self):
            original(self)
            self.buffer.own.zero_()
    elif name == "first_adds":
        # The window's first backward adds to the kept gradient instead of replacing it (a missed copy).
        owner, attribute = grad_reduce.GradReduce, "reduce_bucket"
        original = owner.reduce_bucket

        def replacement(self, params, comm_dtype, first=False, divisor=None):
            return original(self, params, comm_dtype, first=False, divisor=divisor)
    elif name == "sp_world_divisor":
        # Under Ulysses SP, Stage 3's all-reduce path divides by the world, as its reduce-scatter path does, instead
        # of stock's world / sp.
        from ds_asynchzp.runtime import optimizer
        owner, attribute = optimizer.HierarchicalZeroOptimizer, "_hzp_reduce_bucket"
        original = owner._hzp_reduce_bucket

        def replacement(self, params, comm_dtype, sp_divides=False):
            return original(self, params, comm_dtype, sp_divides=False)
    elif name == "one_gradient_element":
        # One element of one step's summed gradient off by 1e-3 relative: after each window's cross-node sum, the
        # largest element of rank 0's first chunk of own atoms.
        from ds_asynchzp.comm import step_boundary
        owner, attribute = step_boundary.StepBoundary, "_reduce_chunk"
        original = owner._reduce_chunk

        def replacement(self, buffer, start, end, comm_dtype, segments):
            original(self, buffer, start, end, comm_dtype, segments)
            if start == 0 and deepspeed.comm.get_rank() == 0:
                own = buffer.data[buffer.own_row, start:end]
                own[int(own.abs().argmax())] *= 1 + 1e-3
    elif name == "offload_every_param":
        # Every reduced parameter's summed gradient goes to the host at the boundary, as without offload, instead of
        # those stock's offload copies (the ones reduced in the window's last backward).
        from ds_asynchzp.runtime import host_offload
        owner, attribute = host_offload.HostOffload, "reduced"
        original = owner.reduced

        def replacement(self, params, at_boundary):
            original(self, params, True)
    elif name in ("offload_zero_unreduced", "offload_unreduced_in_norm"):
        # At the boundary, for every parameter the window did not reduce at all: its host gradient is zeroed, or
        # counted in the norm that clipping reads. Stock's offload neither writes nor counts it: such a parameter
        # steps with the host gradient of the last window that reduced it, as that step's clipping left it.
        from ds_asynchzp.platform import deepspeed_internals as internals
        from ds_asynchzp.runtime import host_offload
        owner, attribute = host_offload.HostOffload, "finish_window"
        original = owner.finish_window

        def replacement(self, on_side_stream=False, copies_may_run=False):
            reduced = internals.offload_reduced_since_step(self.optimizer)
            unreduced = [p for group in internals.stage3_sub_groups(self.optimizer) for p in group
                         if p.ds_id not in reduced] if self.pending else []
            original(self, on_side_stream, copies_may_run)
            for param in unreduced:
                host = internals.offload_host_grad(self.optimizer, param)
                if name == "offload_zero_unreduced":
                    host.zero_()
                else:
                    internals.offload_grad_norm(self.optimizer, param, host)
    elif name:
        raise ValueError(f"unknown planted defect {name!r}")
    else:
        yield
        return
    setattr(owner, attribute, replacement)
    try:
        yield
    finally:
        setattr(owner, attribute, original)


def run_fuzz_cases(payload: dict) -> dict:
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=WORLD_TIMEOUT_S))
    results = {}
    for spec in payload["cases"]:
        started = time.perf_counter()
        key = str(spec.get("key", spec["seed"]))
        if not spec.get("stock", True):
            # A spec stock ZeRO-3 cannot train (it aborts the process): AsyncHZP alone, which must raise.
            try:
                _train(spec, hierarchical=True)
                results[key] = {"error": None}
            except Exception as error:
                results[key] = {"error": f"{type(error).__name__}: {error}",
                                "cause": f"{type(error.__cause__).__name__}: {error.__cause__}"}
            print(f"fuzz case {key}: AsyncHZP alone: {str(results[key]['error'])[:100]}", flush=True)
            continue
        # Where AsyncHZP sums in another order than stock: stock's reduced gradients, their terms' magnitudes and
        # counts (and where d_o < N, its steps), step by step, for the comparison and the teacher forcing.
        stock_record = (fuzz_verdict.StockRecord(step=fuzz_verdict.step_partitions_differ(spec))
                           if fuzz_verdict.summation_order_differs(spec) else None)
        try:
            with stock_record.hooks() if stock_record is not None else contextlib.nullcontext():
                stock = _train(spec, hierarchical=False, gradients=stock_record)
        except Exception as error:  # the spec is outside what stock ZeRO-3 trains: nothing to compare with
            results[key] = {"stock_error": f"{type(error).__name__}: {error}"}
            print(f"fuzz case {key}: stock ZeRO-3 raised {type(error).__name__}", flush=True)
            continue
        forcing = fuzz_verdict.Forcing(stock_record) if stock_record is not None else None
        try:
            with planted(spec.get("plant", "")):
                ours = _train(spec, hierarchical=True, gradients=forcing)
        except Exception as error:
            results[key] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
            print(f"fuzz case {key}: AsyncHZP raised {type(error).__name__}: {error}", flush=True)
            continue
        results[key] = verdict = _compare(stock, ours, forcing)
        verdict["seconds"] = time.perf_counter() - started
        ratios = ", ".join(f"{kind} {ratio:.3g}" for kind, ratio in verdict.get("bound_ratios", {}).items())
        print(f"fuzz case {key}: {time.perf_counter() - started:.1f} s, exact mismatches "
              f"{verdict['exact_mismatches']}" + (f", |difference| / bound: {ratios}" if forcing else ""), flush=True)
    results["rank"] = int(os.environ["RANK"])
    deepspeed.comm.barrier()
    return results
