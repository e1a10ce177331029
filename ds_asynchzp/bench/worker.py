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

import dataclasses
import resource
import time

# Payload keys the parent must provide (see `ds_asynchzp.bench.cli`).
PAYLOAD_KEYS = ("arm", "ds_config", "expected_optimizer", "model", "moe_experts", "seq_len", "steps",
                "grad_accum", "micro_batch", "seed", "node_size")


def _model_config(preset: str, moe_experts: int, seq_len: int):
    from .model import MODEL_PRESETS

    cfg = MODEL_PRESETS[preset]
    changes = {}
    if moe_experts:
        changes["moe_experts"] = moe_experts
    # The position tables are sized by the config; only grow them when the requested sequence would not fit,
    # so a shorter --seq-len trains the preset's exact architecture.
    if seq_len > cfg.seq_len:
        changes["seq_len"] = seq_len
    return dataclasses.replace(cfg, **changes) if changes else cfg


def build_bench_model(preset: str, moe_experts: int, seq_len: int, seed: int):
    """The benchmark's model: a byte-level GPT preset (`model.py`), or the AutoEP Mixtral (`moe_model.py`)."""
    from .moe_model import MOE_PRESETS, build_moe_model

    if preset in MOE_PRESETS:
        return build_moe_model(preset, seq_len, seed=seed)
    from .model import build_model
    return build_model(_model_config(preset, moe_experts, seq_len), seed=seed)


def _families(engine) -> dict | None:
    """Per AsyncHZP family (dense, AutoEP experts): the layout it resolved to."""
    layouts = getattr(engine.optimizer, "hzp_family_layouts", None)
    if layouts is None:
        return None
    return {name: {"world": l.world, "node_size": l.node_size, "param_shard_size": l.param_shard_size,
                   "grad_shard_size": l.grad_shard_size, "optimizer_shard_size": l.optimizer_shard_size}
            for name, l in layouts().items()}


def _check_optimizer(engine, expected: str) -> str:
    name = type(engine.optimizer).__name__
    if expected not in name:
        raise RuntimeError(f"arm expects an optimizer whose class name contains {expected!r}, but the engine "
                           f"built {type(engine.optimizer).__module__}.{name}; the arm would not measure what "
                           "it claims to")
    return name


ZEROPP_QUANTIZER_KEYS = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")


def _uses_zeropp_quantizer(ds_config: dict) -> bool:
    """Whether stock ZeRO++ will load DeepSpeed's quantizer (qwZ or qgZ is on)."""
    zero = ds_config.get("zero_optimization") or {}
    return any(zero.get(key) for key in ZEROPP_QUANTIZER_KEYS)


def _stock_scale_ops(ds_config: dict) -> tuple:
    """The ops whose floating-point collectives carry stock ZeRO++'s scales: qwZ gathers INT8 weights and
    their scales; qgZ's all-to-alls send INT4 gradients and their scales."""
    zero = ds_config.get("zero_optimization") or {}
    return tuple(op for key, op in (("zero_quantized_weights", "all_gather"),
                                    ("zero_quantized_gradients", "all_to_all")) if zero.get(key))


def _fp32_grad_bytes(engine) -> int:
    """Bytes of the fp32 gradients the optimizer reads, the ``.grad`` of its fp32 master partitions (each storage
    once): under offload, the host buffers the gradients are copied into."""
    from ds_asynchzp.platform.deepspeed_internals import stage3_model_state_tensors

    seen, total = set(), 0
    for master in stage3_model_state_tensors(engine.optimizer, engine.module)["master"]:
        grad = master.grad
        if grad is None or grad.untyped_storage().data_ptr() in seen:
            continue
        seen.add(grad.untyped_storage().data_ptr())
        total += grad.untyped_storage().nbytes()
    return total


def _check_host_optimizer(engine, ds_config: dict) -> str:
    """The optimizer that steps the master weights; an offload arm must get DeepSpeed's host Adam."""
    from .offload import offload_section

    name = type(getattr(engine.optimizer, "optimizer", None)).__name__
    if offload_section(ds_config) is not None and "CPUAdam" not in name:
        raise RuntimeError(f"the arm offloads the optimizer, but the engine steps with {name}, not "
                           "DeepSpeedCPUAdam; the arm would not measure what it claims to")
    return name


def _peak_rss_bytes() -> int:
    # Linux reports ru_maxrss in KiB.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


LAYOUT_KEYS = ("world_size", "node_size", "num_nodes", "param_shard_size", "grad_shard_size", "optimizer_shard_size",
               "auto_reason")


def stock_layout(ds_config: dict, world: int, node_size: int) -> tuple[dict, str]:
    """The layout dict (keys `LAYOUT_KEYS`) and a one-line description of a stock ZeRO-3 arm.

    Stock ZeRO-3 shards parameters, gradients and optimizer states over the whole world; ZeRO++ hpZ adds a
    secondary parameter partition over ``zero_hpz_partition_size`` ranks, from which the micro-steps gather, so
    that is its parameter shard size (the primary partition stays over the world, as do grads and optimizer)."""
    hpz = int((ds_config.get("zero_optimization") or {}).get("zero_hpz_partition_size") or 1)
    param = hpz if hpz > 1 else world
    layout = {"world_size": world, "node_size": node_size, "num_nodes": world // node_size,
              "param_shard_size": param, "grad_shard_size": world, "optimizer_shard_size": world, "auto_reason": None}
    where = f"world={world} ({world // node_size} node(s) x {node_size} ranks)"
    if hpz > 1:
        text = (f"ZeRO++ hpZ layout: {where}; params: primary partition over {world}, secondary over {hpz} "
                f"({world // hpz} replicas); grads and optimizer states over {world}")
    else:
        text = f"ZeRO-3 layout: {where}; params, grads and optimizer states sharded over {world} (1 replica)"
    return layout, text


def _layout_of(engine, ds_config: dict, world: int, node_size: int) -> tuple[dict, str]:
    """The resolved layout this rank trains with: AsyncHZP's own, else the stock arm's."""
    hzp = getattr(engine.optimizer, "hzp_layout", None)
    if hzp is None:
        return stock_layout(ds_config, world, node_size)
    if hasattr(hzp, "as_dict"):
        layout = dict(hzp.as_dict())
    else:  # a layout object without as_dict(): its dataclass fields
        layout = {k: v for k, v in dataclasses.asdict(hzp).items() if k in LAYOUT_KEYS}
    layout.setdefault("auto_reason", None)
    return layout, hzp.describe()


PROGRESS_MARK = "asynchzp-bench-step"
LINK_DEVICE = "eth0"


def _node_link_counter() -> str:
    return f"/sys/class/net/{LINK_DEVICE}/statistics/tx_bytes"


def _read_int(path: str) -> int:
    with open(path, encoding="ascii") as f:
        return int(f.read())


def _timeline(comm_ledger, mark: int, start: float, end: float) -> dict:
    """One step's communication as intervals relative to its start: every collective by issuing thread (with
    its tag), and the training thread's waits on communication. Enough to draw compute against each thread."""
    collectives = [{"thread": r.thread, "op": r.op, "tag": r.tag or r.op, "start": r.started - start,
                    "end": (r.ended or end) - start, "inter_node": r.inter_node}
                   for r in comm_ledger.since(mark) if r.started < end]
    waits = [{"start": max(s, start) - start, "end": min(e, end) - start, "what": what}
             for s, e, what in comm_ledger.waits_between(start, end)]
    return {"duration_s": end - start, "collectives": collectives, "waits": waits}


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
    from ds_asynchzp.accounting import ledger
    from ds_asynchzp.accounting.memory import model_state_bytes

    from ds_asynchzp.platform.deepspeed_internals import autoep_groups, install_cpu_zeropp_quantizer

    from .data import batch_for
    from .offload import measured_host_bytes, offload_section

    deepspeed.init_distributed(dist_backend="gloo")
    ledger.install(payload["node_size"])
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    phase_done("init_distributed_s")

    seed = payload["seed"]
    if _uses_zeropp_quantizer(payload["ds_config"]):
        # Stock qwZ / qgZ (the zeropp arm): DeepSpeed's quantizer is CUDA-only, ours stands in on CPU ranks.
        install_cpu_zeropp_quantizer()
    scale_ops = _stock_scale_ops(payload["ds_config"])
    if scale_ops:
        ledger.get().count_floating_as_scales(scale_ops)
    torch.manual_seed(seed)
    model = build_bench_model(payload["model"], payload["moe_experts"], payload["seq_len"], seed)
    engine, *_ = ds_asynchzp.initialize(model=model,
                                        model_parameters=[p for p in model.parameters() if p.requires_grad],
                                        config=payload["ds_config"])
    # AutoEP's groups, so the ledger can tell expert and token traffic from dense traffic.
    ledger.get().set_expert_groups(*autoep_groups())
    optimizer_class = _check_optimizer(engine, payload["expected_optimizer"])
    host_optimizer_class = _check_host_optimizer(engine, payload["ds_config"])
    layout, layout_text = _layout_of(engine, payload["ds_config"], world, payload["node_size"])
    phase_done("initialize_s")

    grad_accum, micro_batch, seq_len = payload["grad_accum"], payload["micro_batch"], payload["seq_len"]
    # On an emulated cluster, local rank 0 of each node reads its node link's transmit counter (visible inside
    # the node's namespace): what really crossed between nodes, headers included.
    link_counter = _node_link_counter() if payload.get("read_link_counter") and rank % payload["node_size"] == 0 else None
    steps = []
    # The step drawn in the report's timeline: a steady one, before the last (which also measures memory).
    timeline_step = max(0, payload["steps"] - 2)
    timeline = None

    def align_ranks() -> None:
        # The counter of a node sums what all its ranks sent; a rank still finishing the previous step when local
        # rank 0 reads it would move bytes between steps. A barrier, outside the timed and ledger windows, aligns
        # every rank on the read (its own few hundred bytes are far below the figures compared).
        if payload.get("read_link_counter"):
            deepspeed.comm.barrier()

    quiesce = getattr(engine.optimizer, "_hzp_quiesce_params", None)
    steady_from = min(int(payload.get("warmup_steps", 0)), payload["steps"] - 1)
    for step in range(payload["steps"]):
        if step == steady_from and quiesce is not None:
            # Bytes are totalled over the steady steps as a whole: a parameter refresh submitted at the end of
            # a step crosses the link during the next one, so per-step windows split it by timing. Start the
            # total from a quiet point (outside any timed step), and end it at one (after the loop).
            quiesce()
        align_ranks()
        mark = ledger.mark()
        tx_before = _read_int(link_counter) if link_counter else None
        if step == steady_from:
            steady_mark, steady_tx = mark, tx_before
        start = time.perf_counter()
        # CPU time of this rank's process (every thread of it): what the step cost the host, unlike wall time
        # barely moved by other load on a shared machine.
        cpu_start = time.process_time()
        loss_sum = 0.0
        for micro in range(grad_accum):
            x, y = batch_for(step, micro, rank, world, micro_batch, seq_len, seed)
            with ledger.phase("forward"):
                loss = engine(x, y)
            with ledger.phase("backward"):
                engine.backward(loss)
            if step == payload["steps"] - 1 and micro == grad_accum - 1:
                # Measured before the last optimizer step: stock hpZ drops its secondary shards in the step,
                # so afterwards its working memory would be under-counted.
                model_states = model_state_bytes(engine)
                fp32_grad_bytes = _fp32_grad_bytes(engine)
            with ledger.phase("step"):
                engine.step()
            # .item() only syncs this rank's own computation; it is not a collective.
            loss_sum += loss.item()
        end = time.perf_counter()
        elapsed = end - start
        cpu_elapsed = time.process_time() - cpu_start
        comm = ledger.summary(mark)
        comm_ledger = ledger.get()
        if step == timeline_step:
            timeline = _timeline(comm_ledger, mark, start, end)
        align_ranks()
        tx_after = _read_int(link_counter) if link_counter else None
        if rank == 0:
            # Progress for the launcher's progress bar (it follows rank 0's log).
            print(f"{PROGRESS_MARK} {step + 1}/{payload['steps']}", flush=True)
        steps.append({
            "link_bytes": comm["link_bytes"],
            "comm_s": comm["seconds"],
            # Time the training thread was blocked on communication, and time any collective was in flight.
            "exposed_comm_s": comm_ledger.exposed_seconds(start, end),
            "comm_busy_s": comm_ledger.busy_seconds(start, end, mark),
            "node_tx_bytes": tx_after - tx_before if link_counter else None,
            "loss": loss_sum / grad_accum,
            "time_s": elapsed,
            "cpu_s": cpu_elapsed,
            "intra_node": comm["intra_node"],
            "inter_node": comm["inter_node"],
            "calls": comm["calls"],
            "by_op": {op: {"intra_node": v["intra_node"], "inter_node": v["inter_node"], "calls": v["calls"]}
                      for op, v in comm["by_op"].items()},
            "by_family": {name: {"intra_node": v["intra_node"], "inter_node": v["inter_node"]}
                          for name, v in comm["by_family"].items()},
        })

    if quiesce is not None:
        quiesce()
    align_ranks()
    # The package's own buffers beyond model states, as the measured steps left them (the pool's peak covers
    # every step); stock arms have none of them.
    buffers = staging = None
    if hasattr(engine.optimizer, "hzp_buffer_bytes"):
        from ds_asynchzp.runtime.buffer_bytes import staging_rings

        buffers, staging = engine.optimizer.hzp_buffer_bytes(), staging_rings(engine.optimizer)
    steady_steps = payload["steps"] - steady_from
    totals = ledger.summary(steady_mark)
    steady = {"steps": steady_steps,
              "intra_node": totals["intra_node"] / steady_steps, "inter_node": totals["inter_node"] / steady_steps,
              "link_bytes": totals["link_bytes"] / steady_steps,
              "node_tx_bytes": (_read_int(link_counter) - steady_tx) / steady_steps if link_counter else None,
              "by_op": {op: {"intra_node": v["intra_node"] / steady_steps, "inter_node": v["inter_node"] / steady_steps}
                        for op, v in totals["by_op"].items()},
              "by_family": {name: {"intra_node": v["intra_node"] / steady_steps,
                                   "inter_node": v["inter_node"] / steady_steps}
                            for name, v in totals["by_family"].items()},
              # Copies between device and host memory that AsyncHZP's offload notes (stock's are not noted).
              "host_device": {d: v / steady_steps for d, v in totals["host_device"].items()},
              "by_flow": {name: {key: v[key] / steady_steps for key in
                                 ("intra_node", "inter_node", "intra_node_scales", "inter_node_scales")}
                          for name, v in totals["by_flow"].items()}}

    result = {
        "rank": rank,
        "world_size": world,
        # Bytes per steady optimizer step, totalled over all steady steps (see above).
        "steady_bytes_per_step": steady,
        "arm": payload["arm"],
        "optimizer_class": optimizer_class,
        "steps": steps,
        "startup_s": phases,
        "model_state_bytes": model_states,
        # Under optimizer offload: the model states on the host, by role (None without offload).
        "host_state_bytes": (measured_host_bytes(model_states, fp32_grad_bytes)
                             if offload_section(payload["ds_config"]) is not None else None),
        "host_optimizer_class": host_optimizer_class,
        "layout": layout,
        "layout_text": layout_text,
        "families": _families(engine),
        "peak_rss_bytes": _peak_rss_bytes(),
        # Parameter tensors of the module (a tied one once): the divisor of host overhead per parameter.
        "parameter_tensors": sum(1 for _ in model.parameters()),
        "timeline": timeline,
        "timeline_step": timeline_step,
        "buffer_allocations": (engine.optimizer.hzp_buffer_allocations()
                               if hasattr(engine.optimizer, "hzp_buffer_allocations") else None),
        "package_buffer_bytes": buffers,
        "staging_rings": staging,
    }
    # Joins the communication threads and tells the peer monitors that this rank ends cleanly, before any rank
    # exits: a rank that is done must not look lost to one still finishing.
    engine.destroy()
    return result
