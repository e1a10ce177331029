"""asynchzp-gpu-check: on a machine with a CUDA GPU, check in minutes what no CPU test can, and write a report.

    asynchzp-gpu-check [--quick] [--out docs/benchmarks] [--steps 50] [--model small]

`--quick` fits a short slot on one GPU (about 5 minutes, the JIT builds included): fewer op cases and steps, the
sanitizer arm for one step, no A/B on a real launch.

1. **Ops**: every op of the package, compiled for CUDA, against its pure-torch reference (bit for bit) on random
   layouts, sizes and alignments (`ds_asynchzp/ops/conformance.py`), and `asynchzp-ops-bench --device cuda`: each
   op's kernel time (CUDA graph replay) and whole-op time against a device copy of the same bytes and DeepSpeed's
   quantizer and dequantizer, the host's part of a call, and the kernels' goals (`ops_checks.py`).
2. **Training**, on the GPUs present, against stock ZeRO-3 (DeepSpeed's default ZeRO-3 knobs, `overlap_comm`
   on, throughput timer unsynchronised): AsyncHZP with its threads, with `torch.cuda._sleep` after every
   module's forward on the compute stream, must train to the losses of AsyncHZP synchronous (`async_comm:
   false`, bit for bit) and of stock ZeRO-3 (relative 1e-6, fp32); the same run under
   `TORCH_CUDA_SANITIZER=1` must report no unsynchronised access. Two or more GPUs: NCCL, one rank per GPU,
   two ranks per node. One GPU: ranks that share it over gloo with CUDA tensors, as far as gloo supports them.
3. **Memory**: reserved memory and the allocator's retries flat over the measured steps after warm-up.
4. **Optimizer offload** (`offload_optimizer: cpu`, pinned host memory, DeepSpeedCPUAdam): AsyncHZP with its
   threads and sleeps, whose boundary copies each summed chunk to the host on a stream of its own and refreshes
   each stepped sub-group while the host steps the next, must train to stock ZeRO-3 with the same offload
   (relative 1e-6, fp32). `--skip-offload` leaves it out.
5. **Communication**: per step, busy time of each communication thread from CUDA events on its stream, and
   step times (CUDA events) of the three arms.
6. **Package buffers**: the AsyncHZP arms' own buffers beyond the model states, by kind, next to the model
   states and `torch.cuda.max_memory_allocated`.
7. **A/B on a real launch**: `asynchzp-ab` on `examples/train.py` under the `deepspeed` launcher, one rank per GPU,
   arms zero3 and asynchzp; its report goes next to the check's (`gpu-check-<date>-ab/`). `--skip-ab` leaves it out.

The report (`gpu-check-<date>-<device>.json` and `.md`, with the date, the commit and the device) goes to
`--out`. Exit status 0 when every check passed, 1 when one failed, 2 when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from .ab_run import run_ab_check
from .copy_count import copy_check
from .ops_checks import bench_ops, check_conformance
from .report import verdict, write_report

SANITIZER_MARK = "CSAN detected a possible data race"
LOSS_RTOL = 1e-6


def _commit() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+changes" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _device_info(cuda: bool) -> Dict:
    import torch

    if not cuda:
        return {"name": "cpu (dry run)", "count": 0}
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "count": torch.cuda.device_count(),
            "memory_gib": round(props.total_memory / 2**30, 1), "capability": f"{props.major}.{props.minor}"}


def _progress(message: str) -> None:
    print(f"[asynchzp-gpu-check] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- training
OFFLOAD_ARMS = ("zero3-offload", "offload")


def _ds_config(arm: str, node_size: int, grad_accum: int, micro_batch: int) -> Dict:
    config = {
        "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": grad_accum,
        # torch's AdamW: no JIT build of DeepSpeed's fused Adam inside an arm's time limit.
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": 3},          # DeepSpeed's default ZeRO-3 knobs, overlap_comm on
        "timers": {"throughput": {"enabled": True, "synchronized": False}},
        "steps_per_print": 10**9,
    }
    if arm in OFFLOAD_ARMS:
        # Host master weights stepped by DeepSpeedCPUAdam (DeepSpeed's choice with offload), in pinned memory; a
        # few sub-groups, so that the refresh of one overlaps the host step of the next.
        config["optimizer"]["params"].pop("torch_adam")
        config["zero_optimization"].update(offload_optimizer={"device": "cpu", "pin_memory": True},
                                           sub_group_size=OFFLOAD_SUB_GROUP)
    if arm not in ("zero3", "zero3-offload"):
        config["async_hzp"] = {"node_size": node_size, "async_comm": arm != "sync", "log_layout": False}
    return config


# Elements per optimizer sub-group in the offload arms (DeepSpeed's default, 1e9, makes one of any small model).
OFFLOAD_SUB_GROUP = 2_000_000


def _arms(sanitizer: bool, offload: bool = True) -> List[str]:
    return ["zero3", "sync", "async"] + (list(OFFLOAD_ARMS) if offload else []) + (["sanitized"] if sanitizer else [])


def _build_host_adam() -> None:
    """DeepSpeedCPUAdam's op, built (or loaded from the cache) here, before the offload arms' ranks start: a first
    build takes a minute, which would count against an arm's time limit."""
    from deepspeed.accelerator import get_accelerator

    started = time.monotonic()
    _progress("building DeepSpeedCPUAdam's op for the offload arms (cached afterwards) ...")
    get_accelerator().create_op_builder("CPUAdamBuilder").load()
    _progress(f"DeepSpeedCPUAdam's op ready ({time.monotonic() - started:.0f} s)")


def run_training(args, cuda: bool, work: Path) -> List[Dict]:
    """The arms, each in fresh rank processes; the checks on their results."""
    import torch

    from ..bench.launch import RankFailure, launch_local

    gpus = torch.cuda.device_count() if cuda else 0
    backend = "nccl" if gpus >= 2 else "gloo"
    world = gpus if gpus >= 2 else args.ranks
    node_size = 2 if world % 2 == 0 and world > 2 else world
    base_env = {"DS_ACCELERATOR": "cuda" if cuda else "cpu"}
    results, failures, failure_tails, sanitizer_reports = {}, {}, {}, None
    arms = _arms(args.sanitizer and cuda, offload=args.offload)
    if args.offload:
        _build_host_adam()
    for arm in arms:
        payload = {"backend": backend, "model": args.model, "seed": 7, "ds_config":
                   _ds_config("async" if arm == "sanitized" else arm, node_size, args.grad_accum, args.micro_batch),
                   # The sanitizer arm checks stream order, not flat memory: one warm-up step is enough.
                   "warmup_steps": 1 if arm == "sanitized" else args.warmup,
                   "steps": args.sanitizer_steps if arm == "sanitized" else args.steps,
                   "grad_accum": args.grad_accum, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
                   "sleep_cycles": args.sleep_cycles if arm in ("async", "sanitized", "offload") else 0,
                   "count_copies": arm in OFFLOAD_ARMS}
        env = dict(base_env, **({"TORCH_CUDA_SANITIZER": "1"} if arm == "sanitized" else {}))
        logs = work / arm
        _progress(f"training arm '{arm}': {world} rank(s) over {backend}, {payload['warmup_steps']}+{payload['steps']} "
                  "steps")
        started = time.monotonic()
        timeout = args.sanitizer_timeout if arm == "sanitized" and args.sanitizer_timeout else args.arm_timeout
        try:
            results[arm] = launch_local("ds_asynchzp.gpu_check.worker:run_arm", world, node_size, payload,
                                        timeout_s=timeout, workdir=str(logs), env=env)
        except (RankFailure, TimeoutError) as failure:
            # One arm's failure or time-out keeps the others' results. The logs live in a temporary directory:
            # the report keeps the failure's first line and its end.
            lines = str(failure).splitlines()
            failures[arm] = lines[0][:400]
            failure_tails[arm] = "\n".join(lines[-30:])
        _progress(f"arm '{arm}' {'done' if arm in results else 'failed'} in {time.monotonic() - started:.0f} s")
        if arm == "sanitized":
            sanitizer_reports = [str(path) for path in sorted(logs.glob("rank*.log"))
                                 if SANITIZER_MARK in path.read_text(errors="replace")]
    checks = _training_checks(results, failures, sanitizer_reports, world, backend)
    copies = copy_check(results, world, node_size, args.grad_accum, args.model, args.seq_len)
    if copies is not None:
        checks.append(copies)
    for check in checks:
        if check["name"] == "training arms ran":
            check["details"]["failure tails"] = failure_tails
    return checks


def _rel(a: List[float], b: List[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b)) if a and len(a) == len(b) else float("inf")


def _training_checks(results: Dict, failures: Dict, sanitizer_reports: Optional[List[str]], world: int,
                     backend: str) -> List[Dict]:
    """What the arms' results say; `sanitizer_reports` None when the sanitized arm did not run."""
    checks = []
    setup = f"{world} ranks over {backend}"
    if failures:
        checks.append({"name": "training arms ran", "passed": False,
                       "summary": "; ".join(f"{arm}: {why}" for arm, why in failures.items()), "details": {}})
    losses = {arm: ranks[0]["losses"] for arm, ranks in results.items() if ranks}
    if "async" in losses and "sync" in losses:
        same = losses["async"] == losses["sync"]
        checks.append({"name": "threads and sleeps change no loss", "passed": same,
                       "summary": f"{setup}: AsyncHZP with its threads (on CUDA with a sleep after every module) vs "
                                  "synchronous: "
                                  + ("bit-identical" if same else f"max relative difference "
                                     f"{_rel(losses['async'], losses['sync']):.3g}"),
                       "details": {"rows": [{"step": i, "async": a, "sync": s}
                                            for i, (a, s) in enumerate(zip(losses["async"], losses["sync"]))]}})
    if "async" in losses and "zero3" in losses:
        rel = _rel(losses["async"], losses["zero3"])
        checks.append({"name": "losses equal stock ZeRO-3", "passed": rel <= LOSS_RTOL,
                       "summary": f"{setup}, fp32: max relative difference {rel:.3g} (bound {LOSS_RTOL:g})",
                       "details": {}})
    if "offload" in losses and "zero3-offload" in losses:
        rel = _rel(losses["offload"], losses["zero3-offload"])
        checks.append({"name": "offload losses equal stock ZeRO-3 offload", "passed": rel <= LOSS_RTOL,
                       "summary": f"{setup}, fp32, offload_optimizer cpu (pinned, DeepSpeedCPUAdam), AsyncHZP with "
                                  f"its threads and sleeps: max relative difference {rel:.3g} (bound {LOSS_RTOL:g})",
                       "details": {"rows": [{"step": i, "asynchzp": a, "zero3": z} for i, (a, z) in
                                            enumerate(zip(losses["offload"], losses["zero3-offload"]))]}})
    if sanitizer_reports is not None:
        checks.append({"name": "CUDA sanitizer", "passed": not sanitizer_reports and "sanitized" not in failures,
                       "summary": "TORCH_CUDA_SANITIZER=1: " + (f"reports in {', '.join(sanitizer_reports)}"
                                                                 if sanitizer_reports
                                                                 else "no unsynchronised access reported"),
                       "details": {}})
    for arm, name in (("async", "memory flat after warm-up"), ("offload", "memory flat after warm-up (offload)")):
        memory = [r["memory"] for r in results.get(arm) or [] if r.get("memory")]
        if not memory:
            continue
        flat = all(m["end"]["reserved"] == m["after_warmup"]["reserved"]
                   and m["end"]["alloc_retries"] == m["after_warmup"]["alloc_retries"] for m in memory)
        checks.append({"name": name, "passed": flat,
                       "summary": f"arm {arm}: reserved bytes and allocation retries per rank, after warm-up and at "
                                  "the end: "
                                  + "; ".join(f"rank {i}: {m['after_warmup']['reserved'] / 2**20:.0f} -> "
                                              f"{m['end']['reserved'] / 2**20:.0f} MiB, retries "
                                              f"{m['after_warmup']['alloc_retries']} -> {m['end']['alloc_retries']}"
                                              for i, m in enumerate(memory)), "details": {}})
    buffers = _buffer_check(results)
    if buffers is not None:
        checks.append(buffers)
    rows = []
    for arm, arm_ranks in results.items():
        if arm_ranks:
            times = sorted(t for r in arm_ranks for t in r["step_ms"])
            busy = arm_ranks[0].get("comm_busy_ms", {})
            rows.append({"arm": arm, "median step ms": times[len(times) // 2] if times else None,
                         **{f"{flow} busy ms/step": busy.get(flow) for flow in ("gather", "reduce", "boundary")}})
    if rows:
        checks.append({"name": "communication", "passed": None, "measured": True,
                       "summary": "median step time per arm over ranks and steps (CUDA events on the compute stream) "
                                  "and each communication thread's busy time per step (CUDA events on its stream, "
                                  "rank 0)",
                       "details": {"rows": rows}})
    return checks


def _buffer_check(results: Dict) -> Optional[Dict]:
    """The AsyncHZP arms' own buffers beyond the model states, by kind (rank 0), next to its model states and the
    allocator's peak; None when no arm recorded them."""
    from ..bench.buffer_table import KIND_LABELS, KIND_LEGEND

    rows = []
    for arm, arm_ranks in results.items():
        recorded = [r for r in arm_ranks or [] if r.get("package_buffer_bytes")]
        if not recorded:
            continue
        first = recorded[0]
        buffers, peak = first["package_buffer_bytes"], (first.get("memory") or {}).get("max_allocated")
        kinds = {f"{label} MiB": buffers.get(kind, 0) / 2**20 for kind, label in KIND_LABELS.items()}
        rows.append({"arm": arm, **kinds,
                     "total MiB": buffers["total"] / 2**20,
                     "total, largest rank MiB": max(r["package_buffer_bytes"]["total"] for r in recorded) / 2**20,
                     "model states MiB": (first["model_state_bytes"] / 2**20
                                          if first.get("model_state_bytes") is not None else None),
                     "max allocated MiB": None if peak is None else peak / 2**20})
    if not rows:
        return None
    return {"name": "package buffers per rank", "passed": None, "measured": True,
            "summary": "bytes of AsyncHZP's own buffers beyond the model states, rank 0, at the end of the measured "
                       "steps (`hzp_buffer_bytes`), next to its model states and torch.cuda.max_memory_allocated "
                       "(everything the allocator handed out at once, activations included)",
            "details": {"rows": rows, "legend": KIND_LEGEND}}


# ------------------------------------------------------------------------------------------------ main
# --quick: what fits a short slot on one GPU. The sanitizer arm, slowest by far, runs one step after one warm-up.
QUICK = {"op_cases": 60, "op_min_time": 0.02, "steps": 6, "warmup": 3, "sanitizer_steps": 1, "arm_timeout": 90.0,
         "sanitizer_timeout": 150.0, "ab": False}
def run_checks(args) -> Dict:
    import deepspeed
    import torch

    cuda = not args.cpu_dry_run
    device = torch.device("cuda" if cuda else "cpu")
    result = {"date": datetime.date.today().isoformat(), "commit": _commit(), "device": _device_info(cuda),
              "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                           "cuda": torch.version.cuda},
              "settings": {"quick": args.quick, "model": args.model, "steps": args.steps, "warmup": args.warmup,
                           "grad_accum": args.grad_accum, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
                           "sleep_cycles": args.sleep_cycles, "zero3_knobs": "DeepSpeed's defaults"},
              "checks": []}
    sizes = [size.strip() for size in args.sizes.split(",") if size.strip()]
    started = time.monotonic()

    def progress(message: str) -> None:
        _progress(f"{message} ({time.monotonic() - started:.0f} s)")

    sections = [] if args.skip_ops else [
        ("ops", lambda: [check_conformance(device, args.op_cases, progress)]),
        ("ops bandwidth", lambda: bench_ops(device, sizes, args.op_min_time))]
    with tempfile.TemporaryDirectory(prefix="asynchzp-gpu-check-") as work:
        sections.append(("training", lambda: run_training(args, cuda, Path(work))))
        if args.ab:
            ranks = torch.cuda.device_count() if cuda else args.ranks
            ab_out = Path(args.out) / f"gpu-check-{result['date']}-ab"
            env = dict(os.environ, DS_ACCELERATOR="cuda" if cuda else "cpu")
            sections.append(("asynchzp-ab", lambda: [run_ab_check(ab_out, ranks, args.ab_steps,
                                                                  2 * args.arm_timeout + 120, env)]))
        for name, section in sections:
            progress(f"{name} ...")
            try:
                result["checks"] += section()
            except Exception as error:  # noqa: BLE001 - one broken section must not lose the others' report
                result["checks"].append({"name": name, "passed": False,
                                         "summary": f"raised {type(error).__name__}: {str(error)[:300]}",
                                         "details": {}})
            # The report so far, after every section: a slot that ends early keeps what was measured.
            result["settings"]["seconds"] = round(time.monotonic() - started)
            write_report(result, args.out)
    return result


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="asynchzp-gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/benchmarks", help="directory for the report (default: %(default)s)")
    parser.add_argument("--model", default="small", help="benchmark model preset (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=50, help="measured steps per arm after warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--ranks", type=int, default=2, help="ranks sharing one GPU over gloo (one GPU only)")
    parser.add_argument("--sleep-cycles", type=int, default=200_000,
                        help="torch.cuda._sleep cycles after every module's forward in the threaded arms")
    parser.add_argument("--sizes", default="1M,64M", help="op sizes for the bandwidth table")
    parser.add_argument("--op-cases", type=int, default=300, help="random cases of the ops against the reference")
    parser.add_argument("--op-min-time", type=float, default=0.1,
                        help="seconds of best-call timing per op (the CUDA figures take fixed counts of calls)")
    parser.add_argument("--no-sanitizer", dest="sanitizer", action="store_false")
    parser.add_argument("--skip-ops", action="store_true", help="training checks only (the ops checked elsewhere)")
    parser.add_argument("--skip-offload", dest="offload", action="store_false",
                        help="leave out the optimizer-offload arms")
    parser.add_argument("--sanitizer-steps", type=int, default=3, help="steps under the sanitizer (slow)")
    parser.add_argument("--arm-timeout", type=float, default=240.0, help="seconds per training arm")
    parser.add_argument("--sanitizer-timeout", type=float, default=None,
                        help="seconds for the sanitizer arm (default: --arm-timeout)")
    parser.add_argument("--quick", action="store_true",
                        help="fit a short slot on one GPU (~5 minutes): " + ", ".join(
                            f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items() if v is not False)
                        + ", no A/B; flags given explicitly win")
    parser.add_argument("--skip-ab", dest="ab", action="store_false",
                        help="leave out asynchzp-ab on examples/train.py (zero3 and asynchzp on the GPUs present)")
    parser.add_argument("--ab-steps", type=int, default=10, help="optimizer steps per asynchzp-ab arm")
    # Runs every part that can run without CUDA, on CPU ranks, to test the command itself.
    parser.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        given = {a.split("=", 1)[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
        for key, value in QUICK.items():
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value)

    import torch

    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("asynchzp-gpu-check needs a CUDA GPU, and torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}, CUDA build {torch.version.cuda}). On a CPU machine run the test suite "
              "instead (README: 'Run the tests').", file=sys.stderr)
        return 2
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if args.cpu_dry_run else "cuda")
    result = run_checks(args)
    json_path, md_path = write_report(result, args.out)
    print(md_path.read_text(), flush=True)
    _progress(f"report: {json_path} and {md_path} ({result['settings'].get('seconds', 0)} s)")
    return 0 if verdict(result) else 1


if __name__ == "__main__":
    sys.exit(main())
