"""asynchzp-ops-bench: throughput of every op, against its torch reference and a plain copy of the same bytes.

For each op, dtype and size it times the compiled op, the pure-torch reference and a device copy
(``dst.copy_(src)``) that reads and writes as many bytes as the op, all in the same run, and reports GB/s as
(bytes read + bytes written) / time. Where CUDA is present it also times DeepSpeed's own quantizer and dequantizer
kernels on the same bytes. Progress goes to stderr, the markdown table to stdout.

What each figure counts:

* on CPU: the best wall time of one call (calls of the three taken in turns, so that a busy host slows them alike);
* on CUDA, per call: **kernel**, the device time of the op alone, from CUDA events around replays of a CUDA graph
  of back-to-back calls (no host work in it: the figure the ops' goals are stated in, and the copy's is taken the
  same way); **whole**, wall time per call of back-to-back calls ending in one synchronisation (host and device
  together, what a communication thread sees); **latency**, the best wall time of one call and a synchronisation;
  **host**, the host's time to issue one call (the argument checks, the segment table, the launch).

    asynchzp-ops-bench [--device cpu|cuda] [--sizes 1M,16M,64M] [--dtypes fp32,bf16] [--ops pack,...]
                       [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from . import api, builder, reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPS = ["pack", "unpack", "unpack_gathered", "bucket_add", "quantize8", "quantize4", "dequantize8", "dequantize4",
       "dequantize_reduce8"]
PARAMS = 16        # parameters per layout op
ROWS, GROUP = 2, 4  # rows of a shard, members of a shard group
REDUCE_K = 4        # chunks summed by dequantize_reduce
BLOCK = api.DEFAULT_BLOCK_SIZE


@dataclass
class Case:
    """One op at one dtype and size: the two implementations, the bytes they move, how to compare outputs."""

    ours: Callable[[], None]
    ref: Callable[[], None]
    bytes_moved: int
    outputs: Callable[[], tuple]   # (ours, ref) tensors after both ran


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def human(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def _atoms(total_per_row: int, count: int) -> List[int]:
    """Uneven atom sizes (as real parameters have) adding up to total_per_row."""
    weights = [1 + (7 * k) % 5 for k in range(count)]
    atoms = [max(1, total_per_row * w // sum(weights)) for w in weights]
    atoms[-1] += total_per_row - sum(atoms)
    return atoms


def make_case(op: str, dtype: torch.dtype, size: int, device: torch.device) -> Case:
    es = torch.empty((), dtype=dtype).element_size()
    n = max(size // es, 2 * ROWS * GROUP * PARAMS)

    if op in ("pack", "unpack"):
        buffer = torch.randn(ROWS, n // ROWS, dtype=dtype, device=device)
        atoms, views, column = _atoms(n // ROWS, PARAMS), [], 0
        for a in atoms:
            views.append(buffer[:, column:column + a])
            column += a
        flat, flat_ref = torch.empty(buffer.numel(), dtype=dtype, device=device), None
        if op == "pack":
            flat_ref = torch.empty_like(flat)
            return Case(lambda: api.pack(views, out=flat), lambda: reference.pack(views, flat_ref),
                        2 * flat.numel() * es, lambda: (flat, flat_ref))
        flat.copy_(buffer.view(-1))
        outs = [torch.empty_like(v) for v in views]
        outs_ref = [torch.empty_like(v) for v in views]
        return Case(lambda: api.unpack(flat, outs), lambda: reference.unpack(flat, outs_ref), 2 * flat.numel() * es,
                    lambda: (torch.cat([o.view(-1) for o in outs]), torch.cat([o.view(-1) for o in outs_ref])))

    if op == "unpack_gathered":
        atoms = _atoms(n // (ROWS * GROUP), PARAMS)
        recv = torch.randn(GROUP * ROWS * sum(atoms), dtype=dtype, device=device)
        numels = [ROWS * GROUP * a - (a // 3) for a in atoms]   # the last atom partly padding
        outs = [torch.empty(m, dtype=dtype, device=device) for m in numels]
        outs_ref = [torch.empty_like(o) for o in outs]
        moved = 2 * sum(numels) * es
        return Case(lambda: api.unpack_gathered(recv, outs, atoms, GROUP, ROWS),
                    lambda: reference.unpack_gathered(recv, outs_ref, atoms, GROUP, ROWS), moved,
                    lambda: (torch.cat(outs), torch.cat(outs_ref)))

    if op == "bucket_add":
        atoms = _atoms(n // (ROWS * GROUP), PARAMS)
        grads = [torch.randn(ROWS * GROUP * a - (a // 3), dtype=dtype, device=device) for a in atoms]
        bucket = torch.empty(GROUP * ROWS * sum(atoms), dtype=dtype, device=device)
        bucket_ref = torch.empty_like(bucket)
        moved = sum(g.numel() for g in grads) * es + bucket.numel() * es
        scale = 1.0 / 8
        return Case(lambda: api.bucket_add(bucket, grads, atoms, GROUP, ROWS, scale=scale),
                    lambda: reference.bucket_add(bucket_ref, grads, atoms, GROUP, ROWS, scale, False), moved,
                    lambda: (bucket, bucket_ref))

    bits = int(op[-1])
    x = torch.randn(n, dtype=dtype, device=device)
    q_bytes, blocks = api.quantized_sizes(n, bits, BLOCK)
    quant_bytes = q_bytes + 4 * blocks
    if op.startswith("quantize"):
        q_dtype = torch.int8 if bits == 8 else torch.uint8
        q, s = torch.empty(q_bytes, dtype=q_dtype, device=device), torch.empty(blocks, device=device)
        q_ref, s_ref = torch.empty_like(q), torch.empty_like(s)
        return Case(lambda: api.quantize(x, bits, BLOCK, out=(q, s)),
                    lambda: reference.quantize(x, q_ref, s_ref, bits, BLOCK), n * es + quant_bytes,
                    lambda: (torch.cat([q.float(), s]), torch.cat([q_ref.float(), s_ref])))

    q, s = api.quantize(x, bits, BLOCK)
    out, out_ref = torch.empty(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)
    if op.startswith("dequantize_reduce"):
        chunks = torch.stack([q.roll(j) for j in range(REDUCE_K)])
        scales = torch.stack([s.roll(j) for j in range(REDUCE_K)])
        return Case(lambda: api.dequantize_reduce(chunks, scales, bits, BLOCK, numel=n, out=out),
                    lambda: reference.dequantize_reduce(chunks, scales, out_ref, bits, BLOCK),
                    REDUCE_K * quant_bytes + n * es, lambda: (out, out_ref))
    return Case(lambda: api.dequantize(q, s, bits, BLOCK, numel=n, out=out),
                lambda: reference.dequantize(q, s, out_ref, bits, BLOCK), quant_bytes + n * es,
                lambda: (out, out_ref))


def best_times(fns: List[Callable[[], None]], device: torch.device, min_time: float,
               max_rounds: int = 50) -> List[float]:
    """Best wall time of one call of each function, over at least 3 rounds (after a warm-up round) or until the
    rounds took min_time. The functions take turns within a round, so a busy host slows all of them alike."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for fn in fns:
        fn()
    sync()
    best, spent, rounds = [math.inf] * len(fns), 0.0, 0
    while rounds < 3 or (spent < min_time and rounds < max_rounds):
        for k, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            sync()
            elapsed = time.perf_counter() - start
            best[k] = min(best[k], elapsed)
            spent += elapsed
        rounds += 1
    return best


def copy_of(bytes_moved: int, device: torch.device) -> Callable[[], None]:
    """A plain copy that reads bytes_moved / 2 and writes as many: the device's copy bandwidth, same run. The count
    is rounded down to whole 4 KiB: measured on an H200 (torch 2.11), torch's CUDA copy of 64 MiB ran at 4.06 TB/s
    and of 64 MiB - 16 bytes at 2.64, and every other count not a multiple of 4 KiB tried ran at 2.5 to 2.6, which
    would handicap the baseline."""
    half = max(4096, bytes_moved // 2 // 4096 * 4096)
    src = torch.empty(half, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().view(-1), b.float().view(-1)
    if not torch.equal(a.isnan(), b.isnan()):
        return math.inf
    keep = ~a.isnan()
    return float((a[keep] - b[keep]).abs().max()) if keep.any() else 0.0


def cuda_times(fn: Callable[[], None], calls: int = 50, graph_calls: int = 20,
               replays: int = 10) -> Dict[str, Optional[float]]:
    """Seconds per call of `fn` on the current CUDA device: kernel (graph replay, CUDA events), whole (back-to-back
    calls then one synchronisation), latency (one call and a synchronisation, best of 5) and host (issue only).
    Everything runs on one side stream, so that the ops' kept segment tables (cached per stream) are warm when the
    graph is captured; kernel is None where `fn` cannot be captured (it synchronises, say)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        stream.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - start) / calls
        stream.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        stream.synchronize()
        whole = (time.perf_counter() - start) / calls
        latency = math.inf
        for _ in range(5):
            start = time.perf_counter()
            fn()
            stream.synchronize()
            latency = min(latency, time.perf_counter() - start)
    kernel: Optional[float] = None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(graph_calls):
                fn()
        with torch.cuda.stream(stream):
            graph.replay()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            for _ in range(replays):
                graph.replay()
            end.record(stream)
            end.synchronize()
        kernel = begin.elapsed_time(end) / 1e3 / (replays * graph_calls)
        del graph
    except RuntimeError as error:  # reported as a missing figure, not fatal
        print(f"  (no graph capture: {str(error).splitlines()[0][:120]})", file=sys.stderr, flush=True)
    torch.cuda.synchronize()
    return {"kernel": kernel, "whole": whole, "latency": latency, "host": host}


def _cuda_columns(bytes_moved: int, ours: Dict, copy: Dict) -> Dict:
    def gbps(seconds):
        return bytes_moved / seconds / 1e9 if seconds else None

    return {"gbps": gbps(ours["kernel"]), "copy_gbps": gbps(copy["kernel"]), "whole_gbps": gbps(ours["whole"]),
            "latency_us": ours["latency"] * 1e6, "host_us": ours["host"] * 1e6, "timing": "kernel (graph replay)"}


def deepspeed_quantizer(device: torch.device):
    """DeepSpeed's CUDA quantizer module, or the reason it cannot be measured."""
    if device.type != "cuda":
        return None, "DeepSpeed's quantizer kernel is CUDA-only and this run is on CPU"
    import os
    import re

    # DeepSpeed 0.19.8's builder reads every TORCH_CUDA_ARCH_LIST entry as integers and fails on the arch-specific
    # suffix some images set ('9.0a'); for its build alone, name the device's own capability instead.
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    entries = [e for e in re.split(r"[;, ]+", arch or "") if e]
    own = "{}.{}".format(*torch.cuda.get_device_capability(device))
    override = arch is not None and not all(re.fullmatch(r"\d+\.\d+(\+PTX)?", e) for e in entries)
    try:
        if override:
            os.environ["TORCH_CUDA_ARCH_LIST"] = own
        from deepspeed.ops.op_builder import QuantizerBuilder
        return QuantizerBuilder().load(), ""
    except Exception as exc:  # reported in the table, not fatal
        return None, f"DeepSpeed's quantizer failed to load: {str(exc).splitlines()[0][:200]}"
    finally:
        if override:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch


def deepspeed_rows(module, reason: str, size: int, device: torch.device) -> List[Dict]:
    """DeepSpeed's int8 quantizer and dequantizer (fp16, its kernels' type) on the bytes of ours at `size`."""
    rows = []
    for op in ("quantize8[deepspeed]", "dequantize8[deepspeed]"):
        row = {"op": op, "size_bytes": size, "dtype": "fp16", "gbps": None, "ref_gbps": None, "copy_gbps": None,
               "speedup": None, "max_abs_err": None}
        if module is None:
            row["note"] = f"unavailable: {reason}"
        rows.append(row)
    if module is None:
        return rows
    # Groups of BLOCK values, as ours; fp16 in and out.
    n = max(size // 2, BLOCK)
    n -= n % BLOCK
    x = torch.randn(n, dtype=torch.float16, device=device)
    groups = n // BLOCK
    moved = 2 * n + n + 4 * groups
    q, params = module.quantize(x, groups, 8, module.Symmetric)
    calls = {"quantize8[deepspeed]": lambda: module.quantize(x, groups, 8, module.Symmetric),
             "dequantize8[deepspeed]": lambda: module.dequantize(q, params, groups, 8, module.Symmetric)}
    copy = cuda_times(copy_of(moved, device))
    for row in rows:
        row.update(_cuda_columns(moved, cuda_times(calls[row["op"]]), copy),
                   note="fp16 (its kernels' type); bytes as ours; allocates its output per call")
    return rows


def run(ops: List[str], dtypes: List[str], sizes: List[int], device: torch.device, min_time: float,
        backend: str = "compiled") -> List[Dict]:
    rows = []
    total = len(ops) * len(dtypes) * len(sizes)
    k = 0
    for op in ops:
        for dname in dtypes:
            for size in sizes:
                k += 1
                case = make_case(op, DTYPES[dname], size, device)
                copy = copy_of(case.bytes_moved, device)
                # The speed-up over the reference is of best single calls; on CUDA the copy is timed by graph
                # replay below, with the op, and not here.
                cuda = device.type == "cuda"
                t_ours, t_ref, *t_copy = best_times([case.ours, case.ref] + ([] if cuda else [copy]), device,
                                                    min_time)
                ours, ref = case.outputs()
                row = {"op": op, "size_bytes": size, "dtype": dname, "gbps": case.bytes_moved / t_ours / 1e9,
                       "ref_gbps": case.bytes_moved / t_ref / 1e9,
                       "copy_gbps": case.bytes_moved / t_copy[0] / 1e9 if t_copy else None,
                       "speedup": t_ref / t_ours, "max_abs_err": max_abs_err(ours, ref), "backend": backend,
                       "timing": "best call"}
                if cuda:
                    row.update(_cuda_columns(case.bytes_moved, cuda_times(case.ours), cuda_times(copy)))
                rows.append(row)
                ratio = f", {row['gbps'] / row['copy_gbps']:.2f} of a copy" if row["gbps"] and row["copy_gbps"] else ""
                print(f"[{k}/{total}] {op} {dname} {human(size)}: ours {row['gbps'] or 0:.2f} GB/s ({row['timing']})"
                      f"{ratio}, reference {row['ref_gbps']:.2f}, speedup {row['speedup']:.1f}x",
                      file=sys.stderr, flush=True)
                del case, ours, ref
    return rows


def table(rows: List[Dict]) -> str:
    cuda = any(r.get("timing", "").startswith("kernel") for r in rows)
    extra = " whole GB/s | latency µs | host µs |" if cuda else ""
    lines = ["| op | dtype | size | ours GB/s | reference GB/s | copy GB/s | ours / copy | speedup vs reference | "
             "max abs err |" + extra, "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" * 3 if cuda else "")]

    def number(value, spec):
        return "-" if value is None else format(value, spec)

    for r in rows:
        if r["gbps"] is None:
            lines.append(f"| {r['op']} | {r['dtype']} | {human(r['size_bytes'])} | {r.get('note', '')} | | | | | |"
                         + (" | | |" if cuda else ""))
            continue
        lines.append(f"| {r['op']} | {r['dtype']} | {human(r['size_bytes'])} | {r['gbps']:.2f} | "
                     f"{number(r['ref_gbps'], '.2f')} | {number(r['copy_gbps'], '.2f')} | "
                     f"{number(r['gbps'] / r['copy_gbps'] if r['copy_gbps'] else None, '.2f')} | "
                     + (f"{r['speedup']:.1f}x" if r["speedup"] is not None else "-") + " | "
                     + number(r["max_abs_err"], ".3g") + " |"
                     + (f" {number(r.get('whole_gbps'), '.2f')} | {number(r.get('latency_us'), '.1f')} | "
                        f"{number(r.get('host_us'), '.1f')} |" if cuda else ""))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="asynchzp-ops-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sizes", default="1M,16M,64M", help="bytes of each op's input, e.g. 1M,16M,256M")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds of calls per measurement (>= 3 calls)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = sorted(set(ops) - set(OPS))
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if unknown or set(dtypes) - set(DTYPES):
        parser.error(f"unknown op or dtype: {unknown or dtypes} (ops: {', '.join(OPS)}; dtypes: fp32, bf16)")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]

    status = builder.status(device.type)
    print(f"ds_asynchzp ops: {status}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"device {device}", file=sys.stderr, flush=True)
    rows = run(ops, dtypes, sizes, device, args.min_time, status.backend)
    if any(op.startswith("quantize8") for op in ops):
        module, reason = deepspeed_quantizer(device)
        for size in sizes:
            rows += deepspeed_rows(module, reason, size, device)
        if module is None:
            print(f"DeepSpeed's quantizer: unavailable ({reason})", file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
