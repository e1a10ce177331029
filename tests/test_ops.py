"""The compiled ops against their pure-torch reference (the specification), and the reference against the
engine's layout written out index by index.

Layout ops must match bit for bit (NaN payloads aside). Quantization must match the reference bit for bit
too, and every dequantized value of a finite block must lie within the bound of absmax block quantization:

    |x - dequantize(quantize(x))| <= s * (1/2 + 2^-16),   s = the block's scale = absmax / 127 (int8) or / 7 (int4)

(1/2 from rounding to the nearest integer; 2^-16 covers the two fp32 roundings of x / s and of q * s), plus,
for a bf16 output, the bf16 rounding of the result: 2^-8 |result| (and 2^-133 below bf16's normal range;
an fp32 input beyond bf16's range dequantizes to +-inf there, as a cast to bf16 would).
"""

import json
import math
import os
import shutil

import pytest
import torch

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # the fuzz section below reports it as a skip with its reason
    given = None

from ds_asynchzp import ops
from ds_asynchzp.ops import api, bench, builder, conformance, reference

FLT_MAX = torch.finfo(torch.float32).max


@pytest.fixture(scope="session", autouse=True)
def compiled_ops(tmp_path_factory):
    """One build per test session, in a fresh cache directory of this session."""
    previous = os.environ.get(builder.ENV_CACHE)
    os.environ[builder.ENV_CACHE] = str(tmp_path_factory.getbasetemp() / "ds_asynchzp_ops_cache")
    status = builder.status("cpu")
    if not status.compiled:
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            pytest.skip(f"no C++ compiler here, the compiled ops cannot be tested: {status.reason}")
        pytest.fail(f"the ops did not build: {status.reason}")
    yield status
    if previous is None:
        os.environ.pop(builder.ENV_CACHE, None)
    else:
        os.environ[builder.ENV_CACHE] = previous


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-identical (signed zeros included), except that any NaN equals any NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.is_floating_point():
        nan = a.isnan()
        assert torch.equal(nan, b.isnan()), "NaN positions differ"
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(bits)[~nan], b.view(bits)[~nan]
    assert torch.equal(a, b), f"{(a != b).sum()} elements differ"


def special_values(n: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype)


# ------------------------------------------------------------------------ the reference is the engine's layout
def oracle_unpack_gathered(recv, numels, atoms, d, rows):
    """Parameter k's flat index (t*d + j)*a + c is member j's row t, column c (ds_asynchzp/layout.py)."""
    gathered, outs, column = recv.view(d, -1), [], 0
    for n, a in zip(numels, atoms):
        full = torch.empty(n, dtype=recv.dtype)
        for index in range(n):
            atom, c = divmod(index, a)
            t, j = divmod(atom, d)
            full[index] = gathered[j, column + t * a + c]
        outs.append(full)
        column += rows * a
    return outs


def oracle_bucket(grads, atoms, d, rows, scale, dtype):
    """Member i's chunk holds atoms i + t*d of each gradient, zero-padded; computed in fp32, rounded once."""
    width = rows * sum(atoms)
    bucket = torch.zeros(d, width, dtype=torch.float32)
    for i in range(d):
        column = 0
        for g, a in zip(grads, atoms):
            flat = g.reshape(-1).float()
            for t in range(rows):
                for c in range(a):
                    index = (t * d + i) * a + c
                    bucket[i, column + t * a + c] = flat[index] * scale if index < flat.numel() else 0.0
            column += rows * a
    return bucket.view(-1).to(dtype)


def test_reference_layouts_are_the_engines():
    d, rows, atoms, numels = 3, 2, [4, 1, 5], [24, 3, 26]
    recv = torch.randn(d * rows * sum(atoms))
    outs = [torch.empty(n) for n in numels]
    reference.unpack_gathered(recv, outs, atoms, d, rows)
    for got, want in zip(outs, oracle_unpack_gathered(recv, numels, atoms, d, rows)):
        assert_same(got, want)

    grads = [torch.randn(n) for n in numels]
    for dtype in (torch.float32, torch.bfloat16):
        bucket = torch.full((d * rows * sum(atoms),), 7.0, dtype=dtype)
        reference.bucket_add(bucket, grads, atoms, d, rows, 0.25, False)
        assert_same(bucket, oracle_bucket(grads, atoms, d, rows, 0.25, dtype))


# ------------------------------------------------------------------------------------------------ layout ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_pack_and_unpack_are_exact_for_strided_views(dtype):
    buffer = torch.arange(3 * 1001).remainder(251).to(dtype).view(3, 1001)
    views = [buffer[:, 0:7], buffer[:, 7:7], buffer[:, 7:500], buffer[1:2, 500:1001], buffer.t()[3:9],  # transposed
             buffer[2, 900:901].view(1, 1, 1)]
    flat = ops.pack(views)
    want = torch.empty_like(flat)
    reference.pack(views, want)
    assert_same(flat, want)
    assert flat.numel() == sum(v.numel() for v in views)

    targets = torch.zeros_like(buffer)
    outs = [targets[:, 0:7], targets[:, 7:7], targets[:, 7:500], targets[1:2, 500:1001], targets.t()[3:9],
            targets[2, 900:901].view(1, 1, 1)]
    ops.unpack(flat, outs)
    for out, view in zip(outs, views):
        assert_same(out.contiguous(), view.contiguous())


def test_pack_of_nothing_and_size_mismatch():
    assert ops.pack([torch.empty(0)]).numel() == 0
    with pytest.raises(ValueError, match="pack: out"):
        ops.pack([torch.ones(3)], out=torch.empty(4))
    with pytest.raises(TypeError, match="dtype"):
        ops.pack([torch.ones(3), torch.ones(2, dtype=torch.bfloat16)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpack_gathered_matches_reference(dtype):
    d, rows, atoms = 4, 3, [129, 0, 1, 1000]
    numels = [rows * d * 129 - 5, 0, 11, rows * d * 1000]
    recv = special_values(d * rows * sum(atoms), 1, dtype)
    got = ops.unpack_gathered(recv, [torch.empty(n, dtype=dtype) for n in numels], atoms, d, rows)
    want = [torch.empty(n, dtype=dtype) for n in numels]
    reference.unpack_gathered(recv, want, atoms, d, rows)
    for a, b in zip(got, want):
        assert_same(a, b)
    # Into existing tensors of any shape, strided included (the persistent-parameter regather).
    target = torch.zeros(2, rows * d * 1000, dtype=dtype)
    ops.unpack_gathered(recv, [torch.empty(numels[0], dtype=dtype), torch.empty(0, dtype=dtype),
                               torch.empty(11, dtype=dtype), target[:, ::2].t()], atoms, d, rows)
    assert_same(target[:, ::2].t().reshape(-1).contiguous(), want[3].view(-1, 2).reshape(-1))


@pytest.mark.parametrize("bucket_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 1 / 3, 0.125])
def test_bucket_add_matches_reference(bucket_dtype, scale):
    d, rows, atoms = 4, 2, [1000, 3, 0, 257]
    numels = [rows * d * 1000 - 999, 24, 0, rows * d * 257]
    grads = [special_values(n, k, dt, 1e3) for k, (n, dt) in
             enumerate(zip(numels, [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]))]
    grads[0][5] = float("nan")
    grads[0][6] = float("inf")
    grads[1][0] = -0.0
    got = ops.bucket_add(None, grads, atoms, d, rows, scale=scale, dtype=bucket_dtype)
    want = torch.empty_like(got)
    reference.bucket_add(want, grads, atoms, d, rows, scale, False)
    assert_same(got, want)
    # Accumulating adds into what is there and leaves the padding alone: gradient 0 has 7001 of its 8 * 1000
    # padded elements, so member 3's row-1 atom (atom 7) ends in padding; a NaN put there must stay.
    for bucket in (got, want):
        bucket.view(d, -1)[3, 1000 + 999] = float("nan")
    ops.bucket_add(got, grads, atoms, d, rows, scale=0.5, accumulate=True)
    reference.bucket_add(want, grads, atoms, d, rows, 0.5, True)
    assert_same(got, want)
    assert torch.isnan(got.view(d, -1)[3, 1999]) and not torch.isnan(got.view(d, -1)[3, 1000 + 1]).item()


def test_bucket_add_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="larger|more than"):
        ops.bucket_add(None, [torch.ones(9)], [2], 2, 2)
    with pytest.raises(TypeError, match="fp32 or bf16"):
        ops.bucket_add(None, [torch.ones(4, dtype=torch.float16)], [1], 2, 2)
    with pytest.raises(ValueError, match="accumulate needs a bucket"):
        ops.bucket_add(None, [torch.ones(4)], [1], 2, 2, accumulate=True)


# -------------------------------------------------------------------------------------------- quantization
def quant_bound(x: torch.Tensor, dq: torch.Tensor, scales: torch.Tensor, block_size: int) -> None:
    """Every value of a finite block within s * (1/2 + 2^-16) (+ the bf16 rounding of dq)."""
    n = x.numel()
    per_value = scales.repeat_interleave(block_size)[:n]
    finite = torch.isfinite(per_value)
    err = (x.float() - dq.float()).abs()
    bound = per_value * (0.5 + 2.0 ** -16)
    if dq.dtype == torch.bfloat16:
        bound = bound + dq.float().abs() * 2.0 ** -8 + 2.0 ** -133
        # An fp32 input beyond bf16's range dequantizes to +-inf in bf16, as a cast to bf16 would.
        checked = finite & ~dq.isinf()
    else:
        checked = finite
    worst = (err - bound)[checked]
    assert worst.numel() == 0 or worst.max() <= 0, f"error above the bound by {worst.max()}"
    # A block holding inf or NaN dequantizes to NaN throughout; a finite block never does.
    blocks = -(-n // block_size)
    padded = torch.zeros(blocks * block_size)
    padded[:n] = x.float()
    nonfinite = ~torch.isfinite(padded.view(blocks, block_size)).all(dim=1)
    assert torch.equal(torch.isnan(scales), nonfinite)
    assert torch.equal(dq.isnan(), ~finite)


def check_quantization(x: torch.Tensor, bits: int, block_size: int) -> None:
    q, s = ops.quantize(x, bits, block_size)
    q_ref, s_ref = torch.empty_like(q), torch.empty_like(s)
    reference.quantize(x.contiguous(), q_ref, s_ref, bits, block_size)
    assert_same(q, q_ref)
    assert_same(s, s_ref)
    assert q.numel() == (x.numel() if bits == 8 else (x.numel() + 1) // 2)
    reused = (torch.full_like(q, 99), torch.full_like(s, 99.0))
    assert ops.quantize(x, bits, block_size, out=reused)[0] is reused[0]
    assert_same(reused[0], q)
    assert_same(reused[1], s)
    values = reference._values(q, x.numel(), bits)
    assert values.abs().max() <= reference.QMAX[bits] if values.numel() else True
    for out_dtype in (torch.float32, torch.bfloat16):
        dq = ops.dequantize(q, s, bits, block_size, numel=x.numel(), dtype=out_dtype)
        dq_ref = torch.empty_like(dq)
        reference.dequantize(q, s, dq_ref, bits, block_size)
        assert_same(dq, dq_ref)
        quant_bound(x, dq, s, block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,block_size", [(0, 64), (1, 64), (1001, 64), (4097, 512), (100003, 2048), (7, 2)])
def test_quantize_round_trip_within_bound(dtype, bits, n, block_size):
    check_quantization(special_values(n, n, dtype, 3.0), bits, block_size)


def test_quantize_extremes():
    blocks = [
        [FLT_MAX, -FLT_MAX, 1.0, 0.0],                 # s * 127 would overflow without the one-ulp nudge down
        [1e-45, -3e-45, 0.0, 1e-45],                   # subnormal: absmax / 127 underflows to 0
        [1e-39, 2e-40, -1e-39, 5e-41],                 # subnormal scale
        [0.0, -0.0, 0.0, 0.0],                         # zeros: scale 0
        [float("nan"), 1.0, 2.0, 3.0],                 # NaN: whole block NaN
        [1.0, float("-inf"), 2.0, 3.0],                # inf: whole block NaN
        [3.4e38, 1e-30, -2.5, 7.0],                    # huge and tiny together
    ]
    x = torch.tensor([v for block in blocks for v in block], dtype=torch.float32)
    for bits in (8, 4):
        check_quantization(x, bits, 4)
        q, s = ops.quantize(x, bits, 4)
        assert math.isnan(s[4]) and math.isnan(s[5]) and s[3] == 0 and s[1] > 0
        assert torch.isfinite(ops.dequantize(q, s, bits, 4, numel=x.numel())[:4]).all()


def test_quantize_rejects_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        ops.quantize(torch.ones(4), bits=3)
    with pytest.raises(ValueError, match="even for int4"):
        ops.quantize(torch.ones(4), bits=4, block_size=3)
    with pytest.raises(TypeError, match="fp32 or bf16"):
        ops.quantize(torch.ones(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be"):
        ops.quantize(torch.ones(4), out=(torch.empty(4, dtype=torch.uint8), torch.empty(1)))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_reduce_sums_k_chunks(bits, out_dtype):
    k, n, block = 5, 3001, 128
    xs = [special_values(n, j, torch.bfloat16 if j % 2 else torch.float32, 10.0) for j in range(k)]
    xs[2][17] = float("nan")
    pairs = [ops.quantize(x, bits, block) for x in xs]
    chunks = torch.stack([q for q, _ in pairs])
    scales = torch.stack([s for _, s in pairs])
    got = ops.dequantize_reduce(chunks, scales, bits, block, numel=n, dtype=out_dtype)
    want = torch.empty_like(got)
    reference.dequantize_reduce(chunks, scales, want, bits, block)
    assert_same(got, want)
    # As the fp32 sum of the k dequantized chunks, in order; lists work as well as a [k, bytes] tensor.
    total = torch.zeros(n)
    for q, s in pairs:
        total = total + ops.dequantize(q, s, bits, block, numel=n)
    assert_same(got, total.to(out_dtype))
    assert_same(ops.dequantize_reduce([q for q, _ in pairs], [s for _, s in pairs], bits, block, numel=n,
                                      dtype=out_dtype), got)
    assert torch.isnan(got[:block]).all() and not torch.isnan(got[block:]).any()
    assert ops.dequantize_reduce([], [], bits, block, numel=4).eq(0).all()


# ------------------------------------------------------------------------------------------------------- fuzz
if given is None:
    def test_fuzz():
        pytest.skip("hypothesis is not installed: the fuzz tests need it (pip install hypothesis)")
else:
    FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    finite_or_not = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


    @FUZZ
    @given(values=st.lists(finite_or_not, max_size=70), bits=st.sampled_from([8, 4]),
           block_size=st.sampled_from([2, 4, 6, 16, 64]), bf16=st.booleans())
    def test_fuzz_quantize_arbitrary_values(values, bits, block_size, bf16):
        x = torch.tensor(values, dtype=torch.float32).to(torch.bfloat16 if bf16 else torch.float32)
        check_quantization(x, bits, block_size)


    @FUZZ
    @given(n=st.integers(0, 5000), seed=st.integers(0, 2 ** 16), exponent=st.integers(-140, 120),
           bits=st.sampled_from([8, 4]), block_size=st.sampled_from([2, 10, 64, 500, 4096]),
           specials=st.lists(st.tuples(st.integers(0, 4999), st.sampled_from([float("nan"), float("inf"), -float("inf"),
                                                                             0.0, -0.0, 1e-45, FLT_MAX, -FLT_MAX])),
                             max_size=4),
           bf16=st.booleans())
    def test_fuzz_quantize_scaled_arrays(n, seed, exponent, bits, block_size, specials, bf16):
        x = special_values(n, seed, torch.float32) * 2.0 ** exponent
        for index, value in specials:
            if index < n:
                x[index] = value
        check_quantization(x.to(torch.bfloat16) if bf16 else x, bits, block_size)


    @st.composite
    def layouts(draw):
        d, rows = draw(st.integers(1, 4)), draw(st.integers(1, 3))
        atoms = draw(st.lists(st.integers(0, 40), min_size=1, max_size=5))
        numels = [draw(st.integers(0, rows * d * a)) for a in atoms]
        return d, rows, atoms, numels


    @FUZZ
    @given(layout=layouts(), seed=st.integers(0, 1000), scale=st.sampled_from([1.0, 0.5, 1 / 3, 1e-30, 3e30]),
           bucket_dtype=st.sampled_from([torch.float32, torch.bfloat16]), grad_bf16=st.lists(st.booleans(), min_size=5,
                                                                                             max_size=5))
    def test_fuzz_layout_ops(layout, seed, scale, bucket_dtype, grad_bf16):
        d, rows, atoms, numels = layout
        dtypes = [torch.bfloat16 if b else torch.float32 for b in grad_bf16]
        grads = [special_values(n, seed + k, dt, 100.0) for k, (n, dt) in enumerate(zip(numels, dtypes))]
        got = ops.bucket_add(None, grads, atoms, d, rows, scale=scale, dtype=bucket_dtype)
        want = torch.empty_like(got)
        reference.bucket_add(want, grads, atoms, d, rows, scale, False)
        assert_same(got, want)
        assert_same(got, oracle_bucket(grads, atoms, d, rows, scale, bucket_dtype))
        ops.bucket_add(got, grads, atoms, d, rows, scale=scale, accumulate=True)
        reference.bucket_add(want, grads, atoms, d, rows, scale, True)
        assert_same(got, want)

        recv = special_values(d * rows * sum(atoms), seed, bucket_dtype)
        outs = ops.unpack_gathered(recv, [torch.empty(n, dtype=bucket_dtype) for n in numels], atoms, d, rows)
        for out, want_out in zip(outs, oracle_unpack_gathered(recv, numels, atoms, d, rows)):
            assert_same(out, want_out)
        back = [torch.empty_like(o) for o in outs]
        ops.unpack(ops.pack(outs), back)
        for a, b in zip(back, outs):
            assert_same(a, b)


# ---------------------------------------------------------------------- the sweep the GPU check runs on CUDA
def test_the_conformance_sweep_passes_on_the_cpu_kernels_and_catches_planted_faults(monkeypatch):
    result = conformance.summary(conformance.run(torch.device("cpu"), cases=25, seed=3))
    assert result["passed"] and result["calls"] == 25 * 10, result["first_mismatches"]
    assert {r["op"] for r in result["rows"]} == {"pack", "unpack", "unpack_gathered", "bucket_add",
                                                 "bucket_add accumulate", "quantize", "dequantize",
                                                 "dequantize_reduce"}

    # One wrong byte at the start of a pack, one wrong value at the end of a reduction: the narrow edges.
    pack, reduce = api.pack, api.dequantize_reduce

    def bad_pack(srcs, out=None):
        out = pack(srcs, out=out)
        if out.numel():
            out.view(torch.uint8)[0] ^= 1
        return out

    def bad_reduce(*args, **kwargs):
        out = reduce(*args, **kwargs)
        if out.numel():
            out[-1] = 12345.0
        return out

    monkeypatch.setattr(api, "pack", bad_pack)
    monkeypatch.setattr(api, "dequantize_reduce", bad_reduce)
    planted = conformance.summary(conformance.run(torch.device("cpu"), cases=25, seed=3))
    wrong = {(r["op"]) for r in planted["rows"] if r["mismatches"]}
    assert not planted["passed"] and wrong == {"pack", "unpack", "dequantize_reduce"}, planted["rows"]


# ------------------------------------------------------------------------------------------------------ bench
def test_bench_reports_every_column(tmp_path, capsys):
    out = tmp_path / "ops.json"
    assert bench.main(["--sizes", "64K", "--dtypes", "bf16", "--ops", "pack,bucket_add,quantize8,dequantize_reduce8",
                       "--min-time", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    keys = {"op", "size_bytes", "dtype", "gbps", "ref_gbps", "copy_gbps", "speedup", "max_abs_err"}
    measured = [r for r in rows if r["gbps"] is not None]
    assert [r["op"] for r in measured] == ["pack", "bucket_add", "quantize8", "dequantize_reduce8"]
    for row in rows:
        assert keys <= set(row)
    for row in measured:
        assert row["size_bytes"] == 64 * 1024 and row["max_abs_err"] == 0 and row["gbps"] > 0 and row["copy_gbps"] > 0
    deepspeed = [r for r in rows if "deepspeed" in r["op"]]
    assert deepspeed and deepspeed[0]["note"].startswith("unavailable: ")
    captured = capsys.readouterr()
    assert "| pack | bf16 | 64 KiB |" in captured.out and "[1/4] pack" in captured.err
