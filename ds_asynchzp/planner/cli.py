"""``asynchzp-plan``: memory, bytes and communication time per optimizer step for a cluster, before training.

    asynchzp-plan --params 70B --world 1024 --node-size 16 --intra-bw 400GB/s --inter-bw 200Gbit \\
                  --grad-accum 8 --device-memory 64GB
    asynchzp-plan --params 70B --world 16 --node-size 8 --device-memory 80GB --grad-accum 8 --offload-optimizer
    asynchzp-plan --params 8B --world 16 --node-size 8 --sp 8 --seq-len 131072 --layers 32 --hidden 4096 \\
                  --kv-hidden 1024                  # Ulysses sequence parallelism (ALST)
    asynchzp-plan --check bench_out/results.json     # formulas against an asynchzp-bench run

The numbers come from :mod:`ds_asynchzp.planner.cluster_plan` (which uses the same traffic formulas, memory model
and ``"auto"`` rule as the engine, and prints which layout ``"auto"`` would choose and why); ``--check`` from
:mod:`ds_asynchzp.bench.plan_check`, which reads the benchmark's records (a command sits above the tooling it
drives). ``--json`` prints the same content machine-readably. Bandwidths left out are the ``async_hzp`` defaults
that ``"auto"`` uses (800 and 200 Gbit/s). Exit status: 0, 1 when ``--check`` finds a difference above 5 %, 2 for
bad arguments or an unreadable results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..bench import plan_check
from ..bench.records import read_results
from ..formulas.sizing import BYTES_PER_GB
from . import offload as offload_plan
from . import sequence_parallel as sp_plan
from .arm_formulas import DTYPE_BYTES
from .cluster_plan import DEFAULT_INTER_BW, DEFAULT_INTRA_BW, plan
from .inputs import params_from_model_spec, parse_bandwidth, parse_count, parse_memory
from .moe import MoeInputs

GB = 1e9  # traffic is shown in decimal gigabytes, memory in GiB (BYTES_PER_GB), as the legend says


def _argtype(parse):
    # argparse shows ArgumentTypeError messages verbatim, so the parser's own explanation reaches the user.
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = parse.__name__
    return convert


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None
    if value < least:
        raise ValueError(f"must be >= {least}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _shard_size(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asynchzp-plan",
        description="Model-state memory per rank, bytes per NIC and per rank's NVLink and communication time per "
                    "optimizer step for zero3, hpz, zeropp, asynchzp and asynchzp-q on a given cluster; or --check the "
                    "formulas against an asynchzp-bench results.json.")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--params", type=_argtype(parse_count),
                       help="parameter count, e.g. 7e9, 70B, 1.3M (B = 10^9)")
    model.add_argument("--model-json", metavar="FILE",
                       help='JSON {"layers", "hidden", "vocab", "ffn_hidden"?, "tied"?}; '
                            "params = L*(4h^2 + 2*h*ffn) + vocab*h*(1 if tied else 2), ffn default 4h")
    parser.add_argument("--world", type=_argtype(_positive_int), help="data-parallel ranks")
    parser.add_argument("--node-size", type=_argtype(_positive_int), help="ranks per node; divides --world")
    parser.add_argument("--intra-bw", type=_argtype(parse_bandwidth),
                        help="NVLink (intra-node) bandwidth per rank, each direction, e.g. 400GB/s (B = bytes, "
                             "b/bit = bits, G = 10^9); default: async_hzp.intra_node_bandwidth_gbps's, 800 Gbit/s")
    parser.add_argument("--inter-bw", type=_argtype(parse_bandwidth),
                        help="bandwidth of one NIC, e.g. 400Gbit or 50GB/s; default: "
                             "async_hzp.inter_node_bandwidth_gbps's, 200 Gbit/s")
    parser.add_argument("--nics-per-node", type=_argtype(_positive_int), default=None,
                        help="NICs per node carrying inter-node traffic, 1 to --node-size (async_hzp.nics_per_node; "
                             "default: one per rank, as on rail-optimised GPU nodes)")
    parser.add_argument("--allreduce", choices=("ring", "tree"), default="ring",
                        help="NCCL's algorithm for all-reduces that span nodes (default: %(default)s)")
    parser.add_argument("--grad-accum", type=_argtype(_positive_int), default=1,
                        help="micro-steps per optimizer step (default: %(default)s)")
    parser.add_argument("--device-memory", type=_argtype(parse_memory),
                        help='memory per device, e.g. 80GB (GB = GiB here); "auto" budgets half of it')
    parser.add_argument("--memory-budget", type=_argtype(parse_memory),
                        help="model-state budget per rank for \"auto\" (like async_hzp.memory_budget_gb); "
                             "default: half of --device-memory, else detected on this machine")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES),
                        help="parameter and gradient-communication dtype (default: %(default)s)")
    parser.add_argument("--grad-accum-dtype", default=None, choices=sorted(DTYPE_BYTES),
                        help="gradient accumulation dtype, data_types.grad_accum_dtype (default: --dtype)")
    parser.add_argument("--param-shard-size", type=_argtype(_shard_size), default="auto",
                        help='d_p: "auto" or a divisor of --node-size (default: %(default)s)')
    parser.add_argument("--grad-shard-size", type=_argtype(_shard_size), default=None,
                        help="d_g: \"auto\" or an integer (default: follows --param-shard-size)")
    parser.add_argument("--optimizer-shard-size", type=_argtype(_shard_size), default="auto",
                        help='d_o: "auto" or a divisor of --world that is a multiple of d_g; "auto" sizes are '
                             "chosen together, integer sizes constrain them (default: %(default)s)")
    parser.add_argument("--reference-models", type=_argtype(_non_negative_int), default=0,
                        help="models of the same size without an optimizer, one forward per micro-step (a DPO "
                             "reference model: 1; async_hzp.reference_models); counted in memory, bytes and "
                             "\"auto\" (default: %(default)s)")
    parser.add_argument("--offload-optimizer", action="store_true",
                        help='plan with zero_optimization.offload_optimizer.device "cpu": "auto" budgets device '
                             "bytes only; every arm shows device and host memory per rank with and without "
                             "offload, and host<->device bytes per step")
    moe = parser.add_argument_group("mixture of experts (AutoEP)")
    moe.add_argument("--expert-params", type=_argtype(parse_count),
                     help="routed-expert parameters of the whole model (all experts), part of --params; plans "
                          "them over their expert-data-parallel groups, apart from the dense ones")
    moe.add_argument("--ep-size", type=_argtype(_positive_int), default=None,
                     help="AutoEP's expert-parallel size (needed with --expert-params)")
    moe.add_argument("--tokens", type=_argtype(_positive_int), default=0,
                     help="tokens per rank per micro-step, for the token all-to-all (default: 0, left out)")
    moe.add_argument("--hidden", type=_argtype(_positive_int), default=0, help="hidden size, for the token all-to-all and the SP all-to-alls")
    moe.add_argument("--top-k", type=_argtype(_positive_int), default=2,
                     help="experts per token (default: %(default)s)")
    sp = parser.add_argument_group("Ulysses sequence parallelism (ALST)")
    sp.add_argument("--sp", type=_argtype(_positive_int), default=1,
                    help="sequence-parallel degree (consecutive ranks share a sequence); needs --seq-len, and "
                         "--layers and --hidden unless --model-json gives them")
    sp.add_argument("--seq-len", type=_argtype(_positive_int), default=0, help="tokens per sequence")
    sp.add_argument("--layers", type=_argtype(_positive_int), default=0, help="attention layers")
    sp.add_argument("--kv-hidden", type=_argtype(_positive_int), default=0,
                    help="key/value values per token (grouped-query attention; default: --hidden)")
    sp.add_argument("--sp-comm-dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                    help="seq_parallel_communication_data_type: the gradients' dtype under SP (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--check", metavar="RESULTS_JSON",
                        help="compare the formulas with the bytes measured by asynchzp-bench (its results.json; exit 1 above 5 %%), "
                             "or a bandwidth sweep's sweep.json: every rate's bytes, and each arm's step time with "
                             "the time model's (exit 1 above 20 %%)")
    return parser


# ------------------------------------------------------------------------------------------- the plan
def _num_params(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.params is not None:
        return args.params
    try:
        spec = json.loads(Path(args.model_json).read_text(encoding="utf-8"))
        if not isinstance(spec, dict):
            raise ValueError("it must hold a JSON object")
        return params_from_model_spec(spec)
    except (OSError, ValueError) as exc:
        parser.error(f"--model-json {args.model_json}: {exc}")


def _sp_inputs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> sp_plan.SpInputs:
    spec = json.loads(Path(args.model_json).read_text(encoding="utf-8")) if args.model_json else {}
    layers, hidden = args.layers or spec.get("layers", 0), args.hidden or spec.get("hidden", 0)
    missing = [flag for flag, value in (("--seq-len", args.seq_len), ("--layers", layers), ("--hidden", hidden))
               if not value]
    if missing:
        parser.error(f"--sp needs {', '.join(missing)}")
    return sp_plan.SpInputs(args.sp, args.seq_len, hidden, layers, args.kv_hidden,
                            grad_comm_bytes=DTYPE_BYTES[args.sp_comm_dtype])


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / GB:g} GB/s ({bytes_per_s * 8 / GB:g} Gbit/s)"


def _gib(n: float) -> str:
    return f"{n / BYTES_PER_GB:.2f} GiB"


def _params(n: int) -> str:
    for scale, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _offload_row(arm: str, entry: dict) -> list[str]:
    """The offload table's row: memory with offload (and the device's without), every flow, the times."""
    off, load, times = entry["offload_optimizer"], entry["links"], entry["comm_time_s"]
    copies, fits = off["host_device_bytes_per_step"]["total"], off["fits_device_memory"]
    return [arm, _gib(off["device_bytes"]["total"]), _gib(off["host_bytes"]["total"]),
            _gib(off["without_offload"]["device_bytes"]["total"]), "?" if fits is None else ("yes" if fits else "NO"),
            f"{load['nic_busiest'] / GB:,.1f}", f"{load['fabric_busiest'] / GB:,.1f}", f"{copies / GB:,.1f}",
            f"{times['total']:.2f}", f"{off['host_device_s']:.2f}", f"{off['comm_time_s']:.2f}"]


OFFLOAD_HEADER = ["arm", "device/rank", "host/rank", "device w/o offload", "fits", "GB/NIC", "NVLink GB/rank",
                  "h<->d GB/step", "network s", "h<->d s", "comm s/step"]


def format_plan(result: dict) -> str:
    inp, auto, layout = result["inputs"], result["auto"], result["layout"]
    offload = inp.get("offload_optimizer", False)
    lines = [
        f"model: {_params(inp['params'])} params ({inp['padded_params']:,} padded to a multiple of the world), "
        f"{inp['dtype']}; grad accumulation {inp['grad_accum']}",
        f"cluster: world {inp['world']} = {inp['nodes']} nodes x {inp['node_size']} ranks, "
        + (f"one NIC per rank (the default; --nics-per-node for fewer)" if inp["nics_per_node"] == inp["node_size"]
           else f"{inp['nics_per_node']} NIC{'s' if inp['nics_per_node'] > 1 else ''} per node")
        + f"; NVLink {_rate(inp['intra_bw_bytes_per_s'])} per rank, each NIC {_rate(inp['inter_bw_bytes_per_s'])}"
        + (" (async_hzp's defaults where not given)" if inp.get("default_bandwidths") else "")
        + (f"; device memory {_gib(inp['device_memory_bytes'])}" if inp["device_memory_bytes"] else ""),
    ]
    if offload:
        lines.append(f"optimizer offload (offload_optimizer.device \"cpu\"): master weights, Adam moments and fp32 "
                     f"gradients on the host; host<->device copies at {inp['host_device_bw_bytes_per_s'] / GB:g} "
                     "GB/s per rank; the budget bounds device memory")
    if inp.get("reference_models"):
        lines.append(f"{inp['reference_models']} reference model(s) of the same size without an optimizer, one "
                     "forward per micro-step (async_hzp.reference_models): in every arm's memory and bytes below, "
                     "and in \"auto\"")
    budget = f"budget {_gib(auto['budget_bytes'])}, {auto['budget_source']}"
    if auto["error"] is None:
        lines.append(f'"auto" would choose d_p={auto["d_p"]} d_g={auto["d_g"]} d_o={auto["d_o"]} ({budget}):')
        lines.append(f"  {auto['reason']}")
    else:
        lines.append(f'"auto" finds no layout ({budget}): {auto["error"]}')
    plain = result.get("auto_without_offload")
    if plain is not None:
        lines.append(f'"auto" without offload finds no layout: {plain["error"]}' if plain["error"] else
                     f'"auto" without offload would choose d_p={plain["d_p"]} d_g={plain["d_g"]} d_o={plain["d_o"]}')
    lines.append(f"asynchzp arms use d_p={layout['d_p']} d_g={layout['d_g']} d_o={layout['d_o']} "
                 f"({layout['source']})")
    if layout.get("reason") and layout["reason"] != auto.get("reason"):
        lines.append(f"  {layout['reason']}")

    if result.get("sequence_parallel") is not None:
        sp = result["sequence_parallel"]
        moved = sp["all_to_all_bytes_per_step"]
        lines.append(f"{sp['description']}; per rank and step {moved['intra_node'] / GB:,.1f} GB intra and "
                     f"{moved['inter_node'] / GB:,.1f} GB inter node of all-to-alls, in every arm's bytes below")
    moe = result.get("moe")
    if moe is not None:
        group = moe["expert_group"]
        lines.append(f"experts: {_params(moe['expert_params'])} routed-expert params over ep {moe['ep_size']}; each "
                     f"rank's experts live on an expert-data-parallel group of {group['members']} ranks, "
                     f"{group['per_node']} per node; the layout is chosen for the dense parameters (--params minus "
                     "--expert-params) with d_o = the world; the experts' states come on top of its budget")
    header = (OFFLOAD_HEADER if offload else
              ["arm", "model states/rank", "fits", "GB/NIC", "NVLink GB/rank", "NIC s", "NVLink s",
               "comm s/step", "sent GB/rank"])
    if moe is not None:
        header += [f"{f} GB/NIC" for f in ("dense", "expert", "tokens")]
    rows, not_planned = [header], []
    for arm, entry in result["arms"].items():
        if entry.get("unavailable"):
            not_planned.append(f"{arm}: not planned: {entry['unavailable']}")
            continue
        if offload:
            rows.append(_offload_row(arm, entry))
            continue
        fits = entry["fits_device_memory"]
        moved, load, times = entry["bytes_per_step"], entry["links"], entry["comm_time_s"]
        row = [arm, _gib(entry["model_state_bytes"]["total"]), "?" if fits is None else ("yes" if fits else "NO"),
               f"{load['nic_busiest'] / GB:,.2f}", f"{load['fabric_busiest'] / GB:,.1f}",
               f"{times['nic']:.2f}", f"{times['fabric']:.2f}", f"{times['total']:.2f}",
               f"{(moved['intra_node'] + moved['inter_node']) / GB:,.1f}"]
        if moe is not None:
            row += [f"{entry['links_by_family'][f]['nic_busiest'] / GB:,.2f}" for f in ("dense", "expert", "tokens")]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    table = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    table += [f"  {line}" for line in not_planned]
    if offload:
        table += ["", offload_plan.summary(result)]
    legend = [f"  {arm}: {entry['description']}" for arm, entry in result["arms"].items()]
    legend += [f"  - {a}" for a in result["assumptions"]]
    columns = ("  GB/NIC: bytes leaving the busiest NIC per optimizer step (modelled; each NIC receives as much); "
               "NVLink GB/rank: bytes the busiest rank sends to others of its node; comm s/step: each collective "
               "at its busiest link's pace, one after another; sent GB/rank: every byte a rank sends, wherever it goes")
    return "\n".join(lines + [""] + table + ["", "Arms and assumptions (GB = 10^9 bytes, GiB = 2^30):", columns]
                     + legend)


# ------------------------------------------------------------------------------------------ the check
def format_check(report: dict, path: str) -> str:
    inp, el = report["inputs"], report["elements"]
    lines = [f"check {path}: world {inp['world']}, node size {inp['node_size']}, grad accumulation "
             f"{inp['grad_accum']}, {inp['dtype']}; padded elements P_g={el['gathered']:,} P_r={el['reduced']:,} "
             f"P_t={el['trainable']:,}; emulated links: "
             + ("one per rank (rails)" if inp.get("topology") == "rails" else "one per node")]
    for arm, lay in report["asynchzp_layouts"].items():
        lines.append(f"  {arm}: d_p={lay['d_p']} d_g={lay['d_g']} d_o={lay['d_o']}")
    rows = [["arm", "bytes/step", "predicted", "measured", "diff", ""]]
    for r in report["rows"]:
        diff = "-" if r["rel_diff"] is None else f"{r['rel_diff']:+.2%}"
        rows.append([r["arm"], r["quantity"], f"{r['predicted']:,.0f}", f"{r['measured']:,.0f}", diff,
                     "ok" if r["ok"] else "MISMATCH"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += [""] + ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in rows]
    lines += [f"note: {n}" for n in report["notes"]]
    if any(r["quantity"] == "inter_node_wire" for r in report["rows"]):
        if report.get("frames_counted"):
            lines.append(f"inter_node_wire and links: counted bytes less {report['frame_header_bytes']} B of headers "
                         "per counted frame (acknowledgements included)")
        else:
            lines.append(f"inter_node_wire and links: measured link counters / {report['wire_overhead_factor']:.4f} "
                         "(full frames and acknowledgements at the run's MTU; the run counted no frames)")
        if report.get("control_counted"):
            lines.append("inter_node_wire and links predicted: the model's payload plus gloo's control bytes per "
                         "message the ledger counted between nodes (bench/plan_check.py GLOO_CONTROL_BYTES)")
    tolerance = (f"within {plan_check.CHECK_RTOL:.0%} of the prediction (below "
                 f"{plan_check.ZERO_PREDICTION_SLACK_BYTES} B where 0 is predicted, {plan_check.IDLE_LINK_SLACK_BYTES} B "
                 "on a link predicted idle)")
    lines.append(f"PASS: every figure {tolerance}" if report["ok"] else f"FAIL: not every figure {tolerance}")
    return "\n".join(lines)


def format_time_check(report: dict, path: str) -> str:
    lines = [f"check {path}: step time against the planner's time model (within {plan_check.TIME_RTOL:.0%})", ""]
    rows = [["rate", "arm", "unshaped s", "link s", "bounds s", "predicted s", "measured s", "diff", ""]]
    for r in report["rows"]:
        rows.append([r["rate"], r["arm"], f"{r['unshaped_s']:.3f}", f"{r['link_s']:.3f}",
                     f"{r['low']:.3f}-{r['high']:.3f}", f"{r['predicted']:.3f}",
                     f"{r['measured']:.3f}", f"{r['rel_diff']:+.1%}", "ok" if r["ok"] else "MISMATCH"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in rows]
    lines += [f"note: {n}" for n in report["notes"]]
    lines.append("bounds: the transfer entirely under the host's work, and none of it; predicted: their midpoint "
                 "on the training thread, the low bound on AsyncHZP's threads (planner/time_model.py)")
    lines.append("PASS: every step time within the tolerance" if report["ok"] else
                 "FAIL: not every step time within the tolerance")
    return "\n".join(lines)


def run_sweep_check(path: str, as_json: bool) -> int:
    """A bandwidth sweep's sweep.json: the bytes of every rate's run, then the step times."""
    try:
        sweep = plan_check.load_sweep(Path(path))
        byte_reports = {rate: plan_check.check_results(res) for rate, res in sweep["results"].items()}
        time_report = plan_check.check_sweep(sweep)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        print(f"asynchzp-plan: cannot check {path}: {what}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps({"bytes": byte_reports, "time": time_report}, indent=2))
    else:
        for rate, report in byte_reports.items():
            print(format_check(report, f"{path} [{rate}]") + "\n")
        print(format_time_check(time_report, path))
    ok = time_report["ok"] and all(r["ok"] for r in byte_reports.values())
    return 0 if ok else 1


def run_check(path: str, as_json: bool) -> int:
    try:
        results = read_results(path)
        if isinstance(results, dict) and "runs" in results and "rates" in results:
            return run_sweep_check(path, as_json)
        report = plan_check.check_results(results)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # A missing key means the file is not an asynchzp-bench results.json (or a much older one).
        what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        print(f"asynchzp-plan: cannot check {path}: {what}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if as_json else format_check(report, path))
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.check:
        return run_check(args.check, args.json)

    missing = [flag for flag, value in (("--params or --model-json", args.params or args.model_json),
                                        ("--world", args.world), ("--node-size", args.node_size))
               if value is None]
    if missing:
        parser.error(f"planning needs {', '.join(missing)}")
    moe = None
    if args.expert_params is not None:
        if args.ep_size is None:
            parser.error("--expert-params needs --ep-size")
        if args.tokens and not args.hidden:
            parser.error("--tokens needs --hidden (values per token in the all-to-all)")
        moe = MoeInputs(args.expert_params, args.ep_size, args.tokens, args.hidden, args.top_k)
    elif args.ep_size is not None:
        parser.error("--ep-size needs --expert-params")
    if moe is not None and args.offload_optimizer:
        parser.error("--offload-optimizer is not planned together with --expert-params")
    sp = _sp_inputs(args, parser) if args.sp > 1 else None
    # The rates "auto" assumes when the config gives none, so the time columns match its pick.
    default_bandwidths = args.intra_bw is None or args.inter_bw is None
    intra_bw = DEFAULT_INTRA_BW if args.intra_bw is None else args.intra_bw
    inter_bw = DEFAULT_INTER_BW if args.inter_bw is None else args.inter_bw
    try:
        result = plan(_num_params(args, parser), args.world, args.node_size, args.grad_accum, args.dtype,
                      intra_bw, inter_bw, args.device_memory, args.memory_budget,
                      args.param_shard_size, args.grad_shard_size, args.optimizer_shard_size,
                      args.grad_accum_dtype, moe=moe, offload_optimizer=args.offload_optimizer, sp=sp,
                      nics_per_node=args.nics_per_node, allreduce=args.allreduce,
                      reference_models=args.reference_models)
    except ValueError as exc:  # includes AsyncHZPConfigError for an invalid explicit layout
        parser.error(str(exc))
    if default_bandwidths:
        result["inputs"]["default_bandwidths"] = True
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
