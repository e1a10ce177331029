"""Every op on one device against the pure-torch reference, over random layouts, sizes and alignments.

The compiled kernels take wide paths where addresses and sizes allow and narrow edges where they do not, so the
cases here are drawn to reach both: views that start at any element offset (source and destination aligned
differently), runs shorter than one 16-byte word and longer than many tiles, quantization blocks that are and are
not powers of two, odd int4 lengths, blocks holding inf, NaN, subnormals and zeros. Every output must equal the
reference bit for bit (NaN payloads aside).

``asynchzp-gpu-check`` runs it on CUDA; the test suite runs it on the CPU kernels, and with a planted wrong
element to show that it fails.
"""

from __future__ import annotations

import random
from typing import Callable, Dict, List

import torch

from . import api, reference

# Element counts up to a few tiles of the CUDA kernels (8 KiB copy tiles, 4 Ki-element fill tiles).
SMALL, LARGE = 40, 70_000


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (signed zeros included), any NaN equal to any NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.reshape(-1).view(bits)[~nan.reshape(-1)], b.reshape(-1).view(bits)[~nan.reshape(-1)])
    return torch.equal(a, b)


def _offset(numel: int, dtype: torch.dtype, device, rng: random.Random, fill: str = "randn") -> torch.Tensor:
    """A contiguous tensor of `numel` elements that starts 0 to 7 elements into its storage: any alignment."""
    skip = rng.randrange(8)
    if dtype.is_floating_point:
        base = torch.randn(numel + skip, device=device).mul_(rng.choice([1.0, 1e-3, 1e3])).to(dtype)
    else:
        base = torch.randint(-128, 128, (numel + skip,), device=device).to(dtype)
    if fill == "empty":
        base.fill_(float("nan") if dtype.is_floating_point else 0)
    return base[skip:]


def _specials(x: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """A few blocks' worth of the values quantization treats apart."""
    values = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 3e38, -3e38]
    for _ in range(rng.randrange(4)):
        if x.numel():
            x[rng.randrange(x.numel())] = rng.choice(values)
    if x.numel() > 8 and rng.random() < 0.3:
        start = rng.randrange(x.numel() - 4)
        x[start:start + rng.randrange(1, 5)] = 0.0
    return x


def _length(rng: random.Random) -> int:
    return rng.choice([rng.randrange(1, SMALL), rng.randrange(SMALL, 2000), rng.randrange(2000, LARGE)])


def _layout_case(rng: random.Random, device) -> List[Dict]:
    dtype = rng.choice([torch.float32, torch.bfloat16])
    d, rows = rng.randrange(1, 5), rng.randrange(1, 4)
    atoms = [rng.choice([0, rng.randrange(1, 9), rng.randrange(9, 300), _length(rng) // (d * rows) + 1])
             for _ in range(rng.randrange(1, 6))]
    numels = [rng.randrange(0, rows * d * a + 1) if rng.random() < 0.5 else rows * d * a for a in atoms]
    width = rows * sum(atoms)
    results = []

    # pack / unpack of [rows, atom] column views of one [rows, width] shard buffer, and of a byte tensor.
    for packed_dtype in (dtype, torch.uint8):
        buffer = _offset(rows * width, packed_dtype, device, rng).view(rows, width) if width else \
            torch.empty(rows, 0, dtype=packed_dtype, device=device)
        views, column = [], 0
        for a in atoms:
            views.append(buffer[:, column:column + a])
            column += a
        total = sum(v.numel() for v in views)
        flat, want = _offset(total, packed_dtype, device, rng, "empty"), torch.empty(total, dtype=packed_dtype,
                                                                                       device=device)
        api.pack(views, out=flat)
        reference.pack(views, want)
        results.append(("pack", packed_dtype, same(flat, want)))
        outs = [torch.full_like(v, 7) for v in views]
        api.unpack(flat, outs)
        results.append(("unpack", packed_dtype, all(same(o, v) for o, v in zip(outs, views))))

    recv = _offset(d * width, dtype, device, rng)
    outs = [_offset(n, dtype, device, rng, "empty") for n in numels]
    outs_ref = [torch.empty(n, dtype=dtype, device=device) for n in numels]
    api.unpack_gathered(recv, outs, atoms, d, rows)
    reference.unpack_gathered(recv, outs_ref, atoms, d, rows)
    results.append(("unpack_gathered", dtype, all(same(o, r) for o, r in zip(outs, outs_ref))))

    grads = [_offset(n, rng.choice([torch.float32, torch.bfloat16]), device, rng) for n in numels]
    scale = rng.choice([1.0, 0.125, 1 / 3, 1e-30])
    bucket = _offset(d * width, dtype, device, rng, "empty")
    want = torch.empty(d * width, dtype=dtype, device=device)
    api.bucket_add(bucket, grads, atoms, d, rows, scale=scale)
    reference.bucket_add(want, grads, atoms, d, rows, scale, False)
    results.append(("bucket_add", dtype, same(bucket, want)))
    api.bucket_add(bucket, grads, atoms, d, rows, scale=scale, accumulate=True)
    reference.bucket_add(want, grads, atoms, d, rows, scale, True)
    results.append(("bucket_add accumulate", dtype, same(bucket, want)))
    return [{"op": op, "dtype": str(dt).replace("torch.", ""), "passed": ok,
             "case": f"d={d} rows={rows} atoms={atoms} numels={numels}"} for op, dt, ok in results]


def _quant_case(rng: random.Random, device) -> List[Dict]:
    dtype = rng.choice([torch.float32, torch.bfloat16])
    bits = rng.choice([8, 4])
    block = rng.choice([2, 6, 64, 500, 512, 4096])
    n = _length(rng)
    x = _specials(_offset(n, dtype, device, rng), rng)
    q_bytes, blocks = api.quantized_sizes(n, bits, block)
    q_dtype = torch.int8 if bits == 8 else torch.uint8
    q, s = _offset(q_bytes, q_dtype, device, rng), _offset(blocks, torch.float32, device, rng, "empty")
    q_ref, s_ref = torch.empty_like(q), torch.empty_like(s)
    api.quantize(x, bits, block, out=(q, s))
    reference.quantize(x, q_ref, s_ref, bits, block)
    results = [("quantize", same(q, q_ref) and same(s, s_ref))]

    out_dtype = rng.choice([torch.float32, torch.bfloat16])
    out, out_ref = _offset(n, out_dtype, device, rng, "empty"), torch.empty(n, dtype=out_dtype, device=device)
    api.dequantize(q_ref, s_ref, bits, block, numel=n, out=out)
    reference.dequantize(q_ref, s_ref, out_ref, bits, block)
    results.append(("dequantize", same(out, out_ref)))

    k = rng.randrange(1, 5)
    pitch = q_bytes + rng.randrange(3)   # rows of an all-to-all buffer, possibly with a gap between them
    chunks = torch.stack([q_ref.roll(j) for j in range(k)])
    chunks = torch.nn.functional.pad(chunks, (0, pitch - q_bytes))[:, :q_bytes] if pitch != q_bytes else chunks
    scales = torch.stack([s_ref.roll(j) for j in range(k)])
    out, out_ref = _offset(n, out_dtype, device, rng, "empty"), torch.empty(n, dtype=out_dtype, device=device)
    api.dequantize_reduce(chunks, scales, bits, block, numel=n, out=out)
    reference.dequantize_reduce(chunks, scales, out_ref, bits, block)
    results.append(("dequantize_reduce", same(out, out_ref)))
    return [{"op": op, "dtype": str(dtype).replace("torch.", ""), "passed": ok,
             "case": f"n={n} bits={bits} block={block} out={str(out_dtype).replace('torch.', '')} k={k}"}
            for op, ok in results]


def run(device: torch.device, cases: int = 200, seed: int = 0,
        progress: Callable[[str], None] = lambda message: None) -> List[Dict]:
    """`cases` random layout cases and as many quantization cases; one row per op call, with whether it matched."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows: List[Dict] = []
    step = max(1, cases // 4)
    for k in range(cases):
        rows += _layout_case(rng, device)
        rows += _quant_case(rng, device)
        if (k + 1) % step == 0:
            progress(f"ops conformance: {k + 1}/{cases} cases, {sum(not r['passed'] for r in rows)} mismatches")
    return rows


def summary(rows: List[Dict]) -> Dict:
    """Per op and dtype: calls and mismatches, and the first few mismatching cases."""
    table: Dict = {}
    for r in rows:
        entry = table.setdefault((r["op"], r["dtype"]), {"op": r["op"], "dtype": r["dtype"], "calls": 0,
                                                         "mismatches": 0})
        entry["calls"] += 1
        entry["mismatches"] += 0 if r["passed"] else 1
    failed = [r for r in rows if not r["passed"]]
    return {"rows": sorted(table.values(), key=lambda e: (e["op"], e["dtype"])),
            "first_mismatches": failed[:5], "calls": len(rows), "mismatches": len(failed),
            "passed": bool(rows) and not failed}
