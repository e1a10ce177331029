"""``asynchzp-bench``: train one model under several ZeRO arms on local CPU ranks and compare them.

Each arm (stock ZeRO-3, ZeRO++ hpZ, AsyncHZP with its communication on background threads or synchronous) runs
the same model, data and seed in its own set of rank processes (`launch_local`, gloo, ``DS_ACCELERATOR=cpu``).
The ranks are grouped into simulated nodes of ``--node-size`` ranks, so the communication ledger can split every
collective's wire bytes into intra- and inter-node traffic. Results go to ``DIR/results.json`` and a table to
stdout and ``DIR/summary.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..measure.json_files import write_json_atomically
from ..layout import expert_members_per_node
from ..models.gpt import HOST_OVERHEAD_PRESET, MODEL_PRESETS
from ..models.mixtral import MOE_PRESETS, autoep_config
from ..planner.moe import UNSUPPORTED_ARMS as MOE_UNSUPPORTED_ARMS
from .aggregate import aggregate_arm, merge_repeats
from .arg_types import integer, non_negative_float, non_negative_int, positive_float, positive_int
from .arms import (ARM_SECTION_KEYS, ARMS, DEFAULT_ARMS, OVERRIDABLE_ARMS, ArmSpec, ArmSpecError, arm_dir_name,
                   arm_ds_config, arm_zero_keys, parse_arm_spec, parse_arm_specs, zeropp_keys)
from .environment import environment
from .launch import prepare_ops
from .offload import add_offload_figures
from .progress import StepProgress
from .table import format_table
from .zero3_knobs import DEFAULT_PRESET as DEFAULT_ZERO3_KNOBS
from .zero3_knobs import PRESETS as ZERO3_PRESETS
from .zero3_knobs import largest_block_parameters, zero3_knobs

WORKER_TARGET = "ds_asynchzp.bench.worker:run_arm"

WEIGHT_DECAY = 0.01
GRADIENT_CLIPPING = 1.0
FP16_INITIAL_SCALE_POWER = 8
# Larger than any run, so DeepSpeed never prints (or times) progress inside the measured steps.
STEPS_PER_PRINT = 10**9


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asynchzp-bench",
        description="Compare ZeRO-3, ZeRO++ hpZ and AsyncHZP on local CPU ranks: same model, data and seed; "
                    "reports loss agreement, intra/inter-node bytes, step time, exposed communication and memory.")
    parser.add_argument("--arms", default=DEFAULT_ARMS,
                        help=f"comma-separated arms to run, in order; known: {', '.join(ARMS)} (asynchzp-sync: the "
                             "asynchzp placement with async_comm false, an A/B of the background threads; "
                             "zero3-offload, asynchzp-offload: zero3 and asynchzp with offload_optimizer cpu). An "
                             "AsyncHZP arm may override keys of its ds_config's async_hzp section: "
                             "BASE:key=value[:key=value]..., e.g. asynchzp:param_shard_size=1:grad_shard_size=2 "
                             "(integers or \"auto\"); the whole spec names the arm in every output "
                             "(default: %(default)s)")
    parser.add_argument("--nproc", type=positive_int, default=4,
                        help="ranks (processes) to start (default: %(default)s)")
    parser.add_argument("--node-size", type=positive_int, default=2,
                        help="ranks per simulated node; must divide --nproc (default: %(default)s)")
    parser.add_argument("--model", default="small", choices=sorted(MODEL_PRESETS) + sorted(MOE_PRESETS),
                        help="model preset: a byte-level GPT, or moe (a small random transformers Mixtral whose "
                             "experts DeepSpeed's AutoEP spreads over --ep-size ranks; needs transformers) "
                             "(default: %(default)s)")
    parser.add_argument("--ep-size", type=positive_int, default=2,
                        help="with --model moe: AutoEP's expert-parallel size, a divisor of --nproc "
                             "(default: %(default)s)")
    parser.add_argument("--moe-experts", type=non_negative_int, default=0,
                        help="experts per block; 0 = dense MLP (default: %(default)s)")
    parser.add_argument("--steps", type=positive_int, default=6, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--grad-accum", type=positive_int, default=4,
                        help="micro-steps per optimizer step (default: %(default)s)")
    parser.add_argument("--micro-batch", type=positive_int, default=2,
                        help="sequences per rank per micro-step (default: %(default)s)")
    parser.add_argument("--seq-len", type=positive_int, default=64, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="training precision (default: %(default)s)")
    parser.add_argument("--seed", type=integer, default=1234, help="seed of weights and data (default: %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--gradient-clipping", type=non_negative_float, default=GRADIENT_CLIPPING,
                        help="the ds_config's gradient_clipping, every arm (0: off) (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=1,
                        help="first optimizer steps left out of steady-state averages; must be < --steps "
                             "(default: %(default)s)")
    parser.add_argument("--comm-delay-ms", type=non_negative_float, default=0.0,
                        help="sleep this many ms before and after each of the package's own collectives (the "
                             "AsyncHZP arms'; stock DeepSpeed's are not delayed), modelling link latency that "
                             "background communication can hide (default: %(default)s)")
    parser.add_argument("--zero3-knobs", default=DEFAULT_ZERO3_KNOBS, choices=ZERO3_PRESETS,
                        help="ZeRO-3 settings every arm shares: tuned (every parameter partitioned and released "
                             "after use, prefetch with a few blocks live, overlap_comm on: stock ZeRO-3's own "
                             "scheduling on), deepspeed (DeepSpeed's defaults), no-overlap (no prefetch, no live "
                             "cache, no overlap: earlier reports' settings) (default: %(default)s)")
    parser.add_argument("--out", default="bench_out", help="output directory (default: %(default)s)")
    parser.add_argument("--timeout", type=positive_float, default=900.0,
                        help="seconds allowed per arm before its ranks are killed (default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="runs of every arm, interleaved, for min/median timings (default: %(default)s)")
    network = parser.add_argument_group("network")
    network.add_argument("--network", default="auto", choices=["auto", "loopback", "emulated"],
                         help="loopback: all ranks on 127.0.0.1; emulated: one network namespace per node, nodes "
                              "joined by rate-limited links whose byte counters are recorded (needs root, iproute2); "
                              "auto: emulated where this machine can make it, else loopback, saying why "
                              "(default: %(default)s)")
    network.add_argument("--inter-node-bw", default="200mbit",
                         help="emulated inter-node link rate, e.g. 200mbit, 1gbit, unlimited; a comma-separated "
                              "list runs every arm at each rate (a sweep: OUT/bw-RATE/, OUT/sweep.md and a plot of "
                              "the speed-up over zero3 against the rate) (default: %(default)s)")
    network.add_argument("--inter-node-delay", default=None,
                         help="emulated one-way inter-node delay in ms (a userspace relay; default: none)")
    network.add_argument("--mtu", type=positive_int, default=9000,
                         help="emulated link MTU; 9000 keeps header overhead near 1 %% (default: %(default)s)")
    network.add_argument("--topology", default="shared", choices=["shared", "rails"],
                         help="emulated node links: shared, one per node for all its ranks (cloud instances with "
                              "one NIC); rails, one per rank, each rank bound to its own, bytes for a rank of "
                              "another local index routed over that index's rail (GPU nodes with one NIC per GPU) "
                              "(default: %(default)s)")
    parser.add_argument("--no-report", action="store_true", help="skip report.md and the plots")
    return parser


def cpu_supports_fp16() -> bool:
    """Whether DeepSpeed's CPU accelerator accepts fp16 here (it asks oneDNN, as this does), so that an
    unsupported --dtype fails before any rank starts instead of in every rank's engine construction."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def _check_arm_config(spec: ArmSpec, args: argparse.Namespace) -> None:
    """Run the engine's own config check on an arm that sets section keys (its overrides, asynchzp-sync's
    async_comm) or zero keys next to the section (asynchzp-offload's), so a bad value fails before any rank starts.

    With "auto" sizes the layout depends on the model's padded parameter count, which the engine computes; then
    only the section itself is validated here and the engine resolves the rest at start-up."""
    from ds_asynchzp.config import resolve_layout, section_from_ds_config
    from ds_asynchzp.errors import AsyncHZPConfigError

    config = ds_config_for(spec.name, args)
    try:
        if "auto" in spec.overrides.values():
            section_from_ds_config(config)
        else:
            resolve_layout(config, args.nproc, args.node_size)
    except AsyncHZPConfigError as exc:
        raise ArmSpecError(f"arm spec {spec.name!r}: {exc}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check the flags; every error exits through argparse before any rank starts."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        specs = parse_arm_specs(args.arms)
    except ArmSpecError as exc:
        parser.error(f"--arms: {exc}")
    args.arms = [s.name for s in specs]
    args.arm_specs = {s.name: s for s in specs}
    if args.nproc % args.node_size:
        parser.error(f"--nproc {args.nproc} is not a multiple of --node-size {args.node_size}")
    for spec in specs:
        if spec.overrides or ARM_SECTION_KEYS.get(spec.base) or (spec.base in OVERRIDABLE_ARMS
                                                                 and arm_zero_keys(spec.base)):
            try:
                _check_arm_config(spec, args)
            except ArmSpecError as exc:
                parser.error(f"--arms: {exc}")
    if args.dtype == "fp16" and not cpu_supports_fp16():
        parser.error("--dtype fp16: DeepSpeed's CPU accelerator refuses fp16 on this host (oneDNN has no fp16 "
                     "support for this CPU); use --dtype bf16 or fp32")
    if args.network == "loopback" and (args.inter_node_delay is not None):
        parser.error("--inter-node-delay needs --network emulated")
    if args.topology == "rails":
        if args.network == "loopback":
            parser.error("--topology rails needs --network emulated")
        if args.inter_node_delay is not None:
            from ds_asynchzp.netem.topology import RAILS_WITHOUT_DELAY

            parser.error(RAILS_WITHOUT_DELAY)
    if args.network in ("emulated", "auto"):
        from ds_asynchzp.netem import parse_delay_ms

        from .sweep import parse_rates

        try:
            args.inter_node_bws = parse_rates(args.inter_node_bw)
            if args.inter_node_delay is not None:
                parse_delay_ms(args.inter_node_delay)
        except ValueError as exc:
            parser.error(str(exc))
    elif "," in args.inter_node_bw:
        parser.error("--inter-node-bw with several rates (a sweep) needs --network emulated")
    if args.model in MOE_PRESETS:
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            parser.error(f"--model {args.model} builds a transformers Mixtral: pip install -e \".[moe]\" "
                         "(or transformers==5.18.0)")
        if args.nproc % args.ep_size:
            parser.error(f"--ep-size {args.ep_size} must divide --nproc {args.nproc}")
        if expert_members_per_node(args.nproc, args.node_size, args.ep_size) is None:
            parser.error(f"--ep-size {args.ep_size} must divide --node-size {args.node_size} or be at least it "
                         "(async_hzp needs the same number of an expert group's ranks on every node)")
    kept = kept_gathered_knobs(args)
    if kept:
        parser.error(f"--model {HOST_OVERHEAD_PRESET} measures the host work of fetching and releasing every parameter "
                     f"at each use, but --zero3-knobs {args.zero3_knobs} keeps parameters gathered ("
                     + ", ".join(kept) + "); use a preset with persistence thresholds and reuse distance 0")
    if args.warmup_steps >= args.steps:
        parser.error(f"--warmup-steps {args.warmup_steps} must be < --steps {args.steps}, "
                     "otherwise no steady-state step is left to average")
    return args


def _spec(arm: str, args: argparse.Namespace) -> ArmSpec:
    specs = getattr(args, "arm_specs", None) or {}
    return specs[arm] if arm in specs else parse_arm_spec(arm)


def arm_overrides(arm: str, args: argparse.Namespace) -> dict:
    """What the arm's ds_config adds to the shared one, as recorded in results.json (``config.arm_overrides``)."""
    spec = _spec(arm, args)
    if spec.base == "hpz":
        return {"zero_optimization.zero_hpz_partition_size": args.node_size}
    if spec.base == "zeropp":
        return {f"zero_optimization.{k}": v for k, v in zeropp_keys(args.node_size).items()}
    added = {f"zero_optimization.{k}": v for k, v in arm_zero_keys(spec.base).items()}
    if spec.base in OVERRIDABLE_ARMS:
        added["async_hzp"] = _async_hzp_section(spec, args)
    return added


def arm_unavailable(arm: str, args: argparse.Namespace | None = None) -> str | None:
    """Why an arm cannot run on this benchmark's ranks, or None. The ranks are CPU processes (gloo,
    DS_ACCELERATOR=cpu); DeepSpeed refuses hpZ together with AutoEP. Stock ZeRO++'s quantizers (CUDA kernels
    only in DeepSpeed) run on the package's CPU quantizer, which the worker installs for the zeropp arm; stock
    ZeRO++'s own Python asserts sizes that some models do not have at some world sizes."""
    base = parse_arm_spec(arm).base
    if args is not None and args.model in MOE_PRESETS and base in MOE_UNSUPPORTED_ARMS:
        return MOE_UNSUPPORTED_ARMS[base]
    if base == "zeropp" and args is not None:
        problems = getattr(args, "_zeropp_problems", None)
        if problems is None:
            from ..ops.zeropp import stock_zeropp_problems
            from ..models.presets import build_bench_model

            model = build_bench_model(args.model, args.moe_experts, args.seq_len, seed=0)
            problems = args._zeropp_problems = stock_zeropp_problems(model.named_parameters(), args.nproc)
        if problems:
            more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
            return (f"stock ZeRO++ cannot train --model {args.model} on {args.nproc} ranks: "
                    + "; ".join(problems[:2]) + more)
    return None


def _async_hzp_section(spec: ArmSpec, args: argparse.Namespace) -> dict:
    return arm_ds_config({"async_hzp": {"node_size": args.node_size}}, spec, args.node_size)["async_hzp"]


def ds_config_for(arm: str, args: argparse.Namespace) -> dict:
    """The full ds_config of one arm (a spec such as ``asynchzp:param_shard_size=1``): the knobs every arm shares,
    with the arm's own keys and the spec's overrides (`arms.arm_ds_config`, as asynchzp-ab does for a user's
    config)."""
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": WEIGHT_DECAY}},
        "gradient_clipping": getattr(args, "gradient_clipping", GRADIENT_CLIPPING),
        "zero_optimization": shared_zero3_knobs(args),
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    if args.model in MOE_PRESETS:
        config["expert_parallel"] = autoep_config(args.ep_size)
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif args.dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": FP16_INITIAL_SCALE_POWER}
    config["async_hzp"] = {"node_size": args.node_size}
    return arm_ds_config(config, _spec(arm, args), args.node_size)


# ZeRO-3 keys under which a parameter stays gathered between uses unless they are 0 (absent: DeepSpeed's default,
# which is not 0).
KEEP_GATHERED_KEYS = ("stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
                      "stage3_max_reuse_distance")


def kept_gathered_knobs(args: argparse.Namespace) -> list[str]:
    """On the host-overhead preset, the shared knobs that would keep parameters gathered (so no arm re-gathers every
    parameter at each use, which is what the preset measures); empty elsewhere."""
    if args.model != HOST_OVERHEAD_PRESET:
        return []
    knobs = shared_zero3_knobs(args)
    return [f"{key}={knobs.get(key, 'default')}" for key in KEEP_GATHERED_KEYS if knobs.get(key) != 0]


def shared_zero3_knobs(args: argparse.Namespace) -> dict:
    """The ``zero_optimization`` keys every arm shares, from the ``--zero3-knobs`` preset (the tuned preset's
    live-parameter cache is sized by the model's largest block, counted once per run)."""
    block = getattr(args, "_block_parameters", None)
    if block is None:
        from ..models.presets import build_bench_model

        block = largest_block_parameters(build_bench_model(args.model, args.moe_experts, args.seq_len, seed=0))
        args._block_parameters = block
    return zero3_knobs(getattr(args, "zero3_knobs", DEFAULT_ZERO3_KNOBS), block)


def tokens_per_optimizer_step(args: argparse.Namespace) -> int:
    return args.nproc * args.micro_batch * args.seq_len * args.grad_accum


def run_config(args: argparse.Namespace) -> dict:
    return {
        "arms": list(args.arms),
        "nproc": args.nproc,
        "node_size": args.node_size,
        "world_size": args.nproc,
        "num_nodes": args.nproc // args.node_size,
        "model": args.model,
        "moe_experts": args.moe_experts,
        "ep_size": args.ep_size if args.model in MOE_PRESETS else None,
        "steps": args.steps,
        "grad_accum": args.grad_accum,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "dtype": args.dtype,
        "seed": args.seed,
        "lr": args.lr,
        "weight_decay": WEIGHT_DECAY,
        "gradient_clipping": getattr(args, "gradient_clipping", GRADIENT_CLIPPING),
        "warmup_steps": args.warmup_steps,
        "out": str(args.out),
        "timeout_s": args.timeout,
        # Applies to the package's own collectives only (the AsyncHZP arms), before and after each one.
        "comm_delay_ms": args.comm_delay_ms,
        "zero3_knobs": getattr(args, "zero3_knobs", DEFAULT_ZERO3_KNOBS),
        "zero_optimization": shared_zero3_knobs(args),
        # Keyed by the arm's full spec; arms without overrides (zero3) are left out.
        "arm_overrides": {arm: arm_overrides(arm, args) for arm in args.arms if arm_overrides(arm, args)},
        "arm_specs": {arm: {"base": _spec(arm, args).base, "overrides": dict(_spec(arm, args).overrides)}
                      for arm in args.arms},
        "tokens_per_optimizer_step": tokens_per_optimizer_step(args),
        "model_parameters": _model_parameter_count(args),
        "repeats": args.repeats,
        "network": {"mode": args.network,
                    "inter_node_bw": args.inter_node_bw if args.network == "emulated" else None,
                    "inter_node_delay_ms": args.inter_node_delay if args.network == "emulated" else None,
                    "mtu": args.mtu if args.network == "emulated" else None,
                    "topology": args.topology if args.network == "emulated" else None},
    }


def _model_parameter_count(args: argparse.Namespace) -> int:
    from ..models.gpt import count_parameters
    from ..models.presets import build_bench_model

    return count_parameters(build_bench_model(args.model, args.moe_experts, args.seq_len, seed=0))["total"]


# ----------------------------------------------------------------------------------------------- driving
def _payload(arm: str, args: argparse.Namespace) -> dict:
    return {
        "arm": arm,
        "ds_config": ds_config_for(arm, args),
        "expected_optimizer": ARMS[_spec(arm, args).base][1],
        "model": args.model,
        "moe_experts": args.moe_experts,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "grad_accum": args.grad_accum,
        "micro_batch": args.micro_batch,
        "seed": args.seed,
        "node_size": args.node_size,
        "comm_delay_ms": args.comm_delay_ms,
        "warmup_steps": args.warmup_steps,
    }


def _run_arms(args: argparse.Namespace, results: dict, cluster=None) -> None:
    from ds_asynchzp.bench.launch import launch_local

    out = Path(args.out)
    entries = {arm: [] for arm in args.arms}
    launch_extra = {}
    if cluster is not None:
        launch_extra = {"rank_prefix_cmd": cluster.rank_prefix_cmd, "env": cluster.rank_env()}
    total = len(args.arms) * args.repeats
    index = 0
    # Repeats interleave the arms, so slow drift of the host (load, thermal) spreads over every arm alike.
    for repeat in range(args.repeats):
        for arm in args.arms:
            index += 1
            unavailable = arm_unavailable(arm, args)
            if unavailable is not None:
                if repeat == 0:
                    print(f"[{index}/{total}] {arm}: unavailable: {unavailable}", flush=True)
                    results.setdefault("unavailable_arms", {})[arm] = unavailable
                    write_json_atomically(out / "results.json", results)
                continue
            label = f"[{index}/{total}] {arm}" + (f" (repeat {repeat + 1})" if args.repeats > 1 else "")
            logs = arm_dir_name(arm)
            workdir = out / "logs" / (logs if args.repeats == 1 else f"{logs}-{repeat + 1}")
            print(f"{label}: {args.nproc} ranks ({args.nproc // args.node_size} nodes x {args.node_size})", flush=True)
            started = time.monotonic()
            payload = dict(_payload(arm, args), launched_at=time.time(), read_link_counter=cluster is not None,
                           link_topology=args.topology)
            with StepProgress(workdir / "rank0.log", args.steps, label):
                # Each run gets fresh processes: DeepSpeed keeps process-wide state such as the hpZ group.
                rank_results = launch_local(WORKER_TARGET, args.nproc, args.node_size, payload,
                                            timeout_s=args.timeout, workdir=str(workdir), **launch_extra)
            entry = aggregate_arm(rank_results, args.warmup_steps, tokens_per_optimizer_step(args))
            entry["wall_time_s"] = time.monotonic() - started
            entries[arm].append(entry)
            results["arms"][arm] = merge_repeats(entries[arm])
            add_offload_figures(results, arm)
            write_json_atomically(out / "results.json", results)
            exposed, busy = entry.get("exposed_comm_s_per_step"), entry.get("comm_busy_s_per_step")
            comm = "" if exposed is None or busy is None else f", exposed comm {exposed:.3f}s (busy {busy:.3f}s)"
            print(f"{label}: done in {entry['wall_time_s']:.1f}s, final loss {entry['losses'][-1]:.6f}, "
                  f"median step {entry['median_step_time_s']:.3f}s{comm}", flush=True)


def resolve_network(args: argparse.Namespace) -> str | None:
    """Settle ``--network auto``: emulated nodes where this machine can make them (root, iproute2, network
    namespaces and tbf: `netem.preflight`), else loopback. Returns the one line that says which and why, or None
    where the flag named the network."""
    if args.network != "auto":
        return None
    from ds_asynchzp.netem import EmulationUnavailable, preflight

    try:
        preflight(need_tun=args.inter_node_delay is not None)
    except EmulationUnavailable as exc:
        if getattr(args, "inter_node_bws", None) and len(args.inter_node_bws) > 1:
            raise NetworkUnavailable(f"--inter-node-bw {args.inter_node_bw} (a sweep) needs emulated nodes, which "
                                     f"this machine cannot make: {exc}") from None
        args.network = "loopback"
        return (f"network: loopback, every rank on 127.0.0.1, where bytes between the simulated nodes cost almost "
                f"nothing ({exc}); as root with iproute2, --network emulated joins two nodes by a "
                f"{args.inter_node_bw} link")
    args.network = "emulated"
    return (f"network: {args.nproc // args.node_size} emulated nodes (network namespaces) joined by "
            f"{args.inter_node_bw} links (--network loopback for none)")


class NetworkUnavailable(RuntimeError):
    pass


def run_benchmark(args: argparse.Namespace) -> dict:
    """Run every arm; results.json is rewritten after each run so a later failure keeps the rest."""
    note = resolve_network(args)
    if note:
        print(note, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prepare_ops()
    results = {"config": run_config(args), "env": environment(), "arms": {}}
    if args.network == "loopback":
        _run_arms(args, results)
        return results
    from ds_asynchzp.netem import Cluster

    num_nodes = args.nproc // args.node_size
    with Cluster(num_nodes, args.inter_node_bw, delay_ms=args.inter_node_delay, mtu=args.mtu,
                 ranks_per_node=args.node_size,
                 links_per_node=args.node_size if args.topology == "rails" else 1) as cluster:
        print(f"emulated cluster: {num_nodes} nodes, "
              + (f"{args.node_size} links per node, one per rank (rails)" if args.topology == "rails"
                 else "one link per node") + f", links {args.inter_node_bw}"
              + (f", {args.inter_node_delay} ms one way" if args.inter_node_delay else "") + f", MTU {args.mtu}",
              flush=True)
        _run_arms(args, results, cluster)
    return results


def run_and_report(args: argparse.Namespace) -> dict:
    """One complete benchmark: the arms, results.json, the table and (unless --no-report) the report."""
    results = run_benchmark(args)
    if not results["arms"]:
        raise NoArmRan("no arm could run here (see the reasons above)")
    table = format_table(results)
    out = Path(args.out)
    (out / "summary.md").write_text(table + "\n", encoding="utf-8")
    print()
    print(table)
    if not args.no_report:
        from .report import write_report

        print(f"report: {write_report(results, out)}", flush=True)
    return results


class NoArmRan(RuntimeError):
    pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ds_asynchzp.bench.launch import RankFailure
    from ds_asynchzp.netem import ClusterError

    started = time.monotonic()
    rates = getattr(args, "inter_node_bws", None) or [args.inter_node_bw]
    try:
        if len(rates) > 1:
            from .sweep import run_sweep

            run_sweep(args, run_and_report)
        else:
            run_and_report(args)
    except ClusterError as exc:
        # No rights, no namespaces, or leftovers of an earlier run (the message names the cleanup command).
        print(f"asynchzp-bench: cannot emulate the cluster: {exc}", file=sys.stderr, flush=True)
        return 2
    except (RankFailure, TimeoutError) as exc:
        print(f"asynchzp-bench: an arm failed; results of finished arms are in {Path(args.out)}\n"
              f"{exc}", file=sys.stderr, flush=True)
        return 1
    except NoArmRan as exc:
        print(f"asynchzp-bench: {exc}", file=sys.stderr, flush=True)
        return 1
    except NetworkUnavailable as exc:
        print(f"asynchzp-bench: {exc}", file=sys.stderr, flush=True)
        return 2
    out = Path(args.out)
    produced = f"sweep: {out / 'sweep.md'}" if len(rates) > 1 else \
        f"results: {out / 'results.json'}, table: {out / 'summary.md'}"
    print(f"\ntotal wall time {time.monotonic() - started:.1f}s; {produced}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
