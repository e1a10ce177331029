"""One rank of one benchmark arm: train the benchmark model and report what was measured.

Run by `ds_asynchzp.bench.launch.launch_local` as ``ds_asynchzp.bench.worker:run_arm`` in a fresh process per
rank and per arm: DeepSpeed keeps process-wide state (the hpZ group, the comm backend, the ledger's
wrappers), so arms never share an interpreter.

Every arm gets the same model weights (seeded build), the same batches (`batch_for` is a pure function of
step, micro-step, rank and seed) and the same ZeRO-3 knobs; only the arm-specific part of the ds_config
differs. Nothing here issues a collective inside the measured steps, so the ledger sees only the engine's own
traffic; the parent averages the per-rank losses.
"""

from __future__ import annotations

import time

# Payload keys the parent must provide (see `ds_asynchzp.bench.cli`).
PAYLOAD_KEYS = ("arm", "ds_config", "expected_optimizer", "model", "moe_experts", "seq_len", "steps",
                "grad_accum", "micro_batch", "seed", "node_size")

PROGRESS_MARK = "asynchzp-bench-step"


def run_arm(payload: dict) -> dict:
    """Train `steps` optimizer steps under one arm on this rank; return per-step loss, time and bytes."""
    missing = [k for k in PAYLOAD_KEYS if k not in payload]
    if missing:
        raise ValueError(f"benchmark payload lacks {missing}")

    # Start-up is timed apart from training, in phases: on a loaded host (or while DeepSpeed JIT-builds an
    # op) it can dwarf the measured steps, and the phase shows where.
    phases, phase_start = {}, time.perf_counter()
    if "launched_at" in payload:
        # Interpreter start plus importing this package (and with it torch and deepspeed) before we ran.
        phases["spawn_s"] = max(0.0, time.time() - payload["launched_at"])

    def phase_done(name: str) -> None:
        nonlocal phase_start
        now = time.perf_counter()
        phases[name] = now - phase_start
        phase_start = now

    import os

    if "comm_delay_ms" in payload:
        # A fixed delay before and after every collective of the package (latency the threads can hide). Set even
        # when 0, so a value inherited from the caller's shell cannot delay an arm that results.json says was not.
        os.environ["DS_ASYNCHZP_COMM_DELAY_MS"] = str(float(payload["comm_delay_ms"]))

    import deepspeed
    import torch

    import ds_asynchzp
    from ds_asynchzp.platform import ledger
    from ds_asynchzp.measure.recording import check_engine, prepare_rank
    from ds_asynchzp.measure.step_recorder import StepRecorder

    from ..models.presets import build_bench_model
    from .data import batch_for
    from .offload import host_state_bytes

    deepspeed.init_distributed(dist_backend="gloo")
    # The ledger; stock qwZ / qgZ (the zeropp arm) on the package's CPU quantizer (DeepSpeed's is CUDA-only).
    prepare_rank(payload["ds_config"], payload["node_size"])
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    phase_done("init_distributed_s")

    seed = payload["seed"]
    torch.manual_seed(seed)
    model = build_bench_model(payload["model"], payload["moe_experts"], payload["seq_len"], seed)
    engine, *_ = ds_asynchzp.initialize(model=model,
                                        model_parameters=[p for p in model.parameters() if p.requires_grad],
                                        config=payload["ds_config"])
    check_engine(engine, payload["ds_config"], payload["expected_optimizer"], payload["arm"])
    phase_done("initialize_s")

    grad_accum, micro_batch, seq_len = payload["grad_accum"], payload["micro_batch"], payload["seq_len"]
    recorder = StepRecorder(engine, steps=payload["steps"], warmup_steps=int(payload.get("warmup_steps", 0)),
                            node_size=payload["node_size"], rank=rank, world=world,
                            read_link_counter=bool(payload.get("read_link_counter")), barrier=deepspeed.comm.barrier,
                            link_topology=payload.get("link_topology") or "shared")
    for step in range(payload["steps"]):
        recorder.begin_step()
        loss_sum = 0.0
        for micro in range(grad_accum):
            x, y = batch_for(step, micro, rank, world, micro_batch, seq_len, seed)
            with ledger.phase("forward"):
                loss = engine(x, y)
            with ledger.phase("backward"):
                engine.backward(loss)
            if micro == grad_accum - 1:
                recorder.before_last_step()
                recorder.boundary_begins()
            with ledger.phase("step"):
                engine.step()
            if micro == grad_accum - 1:
                recorder.boundary_ends()
            # .item() only syncs this rank's own computation; it is not a collective.
            loss_sum += loss.item()
        recorder.end_step(loss_sum / grad_accum)
        if rank == 0:
            # Progress for the launcher's progress bar (it follows rank 0's log).
            print(f"{PROGRESS_MARK} {step + 1}/{payload['steps']}", flush=True)

    result = recorder.finish(payload["ds_config"])
    result.update({
        "arm": payload["arm"],
        "startup_s": phases,
        # Under optimizer offload: the model states on the host, by role (None without offload).
        "host_state_bytes": host_state_bytes(result, payload["ds_config"]),
    })
    # Joins the communication threads and tells the peer monitors that this rank ends cleanly, before any rank
    # exits: a rank that is done must not look lost to one still finishing.
    engine.destroy()
    return result
