"""The public ops: check arguments, allocate outputs, run the compiled kernel where there is one, else the
reference.

Which one runs is decided per call by the tensors' device type and dtypes (``builder.status(device)`` says
why a device runs the reference). Both give the same results, bit for bit apart from NaN payloads; the
reference is the specification (``reference.py``). All ops are data movement and rounding, not
differentiable: they run under ``torch.no_grad()``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from . import builder, reference

DEFAULT_BLOCK_SIZE = 512
FLOAT_DTYPES = (torch.float32, torch.bfloat16)

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]


def _compiled(device: torch.device) -> bool:
    return builder.compiled(device.type)


def _kernels():
    return torch.ops.ds_asynchzp


def _same(tensors: Sequence[torch.Tensor], like: torch.Tensor, what: str) -> None:
    for t in tensors:
        if t.dtype != like.dtype:
            raise TypeError(f"{what}: dtype {t.dtype} differs from {like.dtype}")
        if t.device != like.device:
            raise ValueError(f"{what}: device {t.device} differs from {like.device}")


def _layout_args(atoms: Sequence[int], group_size: int, rows: int, count: int, what: str) -> List[int]:
    atoms = [int(a) for a in atoms]
    if len(atoms) != count:
        raise ValueError(f"{what}: {count} tensors but {len(atoms)} atom sizes")
    if group_size < 1 or rows < 1 or any(a < 0 for a in atoms):
        raise ValueError(f"{what}: group_size and rows must be >= 1 and atoms >= 0")
    return atoms


# ------------------------------------------------------------------------------------------------ layout ops
@torch.no_grad()
def pack(srcs: Sequence[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Concatenate the sources' elements (row-major, any strides) into one flat tensor, in one pass.

    The gather's send buffer: ``pack([buffer.atoms(p) for p in params], out=send)``. All sources share one
    dtype and device; ``out`` (contiguous, as many elements as the sources together) is allocated if omitted.
    """
    srcs = list(srcs)
    total = sum(t.numel() for t in srcs)
    if out is None:
        if not srcs:
            raise ValueError("pack: no sources and no out to take a dtype from")
        out = torch.empty(total, dtype=srcs[0].dtype, device=srcs[0].device)
    _same(srcs, out, "pack")
    if out.numel() != total or not out.is_contiguous():
        raise ValueError(f"pack: out must be contiguous with {total} elements, got {tuple(out.shape)}")
    if _compiled(out.device):
        _kernels().pack(srcs, out)
    else:
        reference.pack(srcs, out)
    return out


@torch.no_grad()
def unpack(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    """Copy consecutive runs of ``flat`` into the outputs (any strides), in one pass: the inverse of pack."""
    outs = list(outs)
    _same(outs, flat, "unpack")
    total = sum(t.numel() for t in outs)
    if flat.numel() != total or not flat.is_contiguous():
        raise ValueError(f"unpack: flat must be contiguous with {total} elements, got {tuple(flat.shape)}")
    if _compiled(flat.device):
        _kernels().unpack(flat, outs)
    else:
        reference.unpack(flat, outs)


@torch.no_grad()
def unpack_gathered(recv: torch.Tensor, outs: Sequence[torch.Tensor], atoms: Sequence[int], group_size: int,
                    rows: int) -> List[torch.Tensor]:
    """Lay out a parameter all-gather's receive buffer in atom order, one output per parameter.

    ``recv`` holds ``group_size`` (d) equal sends of ``width = rows * sum(atoms)`` elements, each the pack of
    every parameter's ``[rows, atom_k]`` shard. Output k (``numel <= rows * d * atom_k``, any shape, e.g. the
    parameter's full tensor) receives ``recv[j, column_k + r*atom_k + c]`` at flat index ``(r*d + j)*atom_k + c``;
    the padding past its numel is dropped. Returns ``outs``.
    """
    outs = list(outs)
    atoms = _layout_args(atoms, group_size, rows, len(outs), "unpack_gathered")
    _same(outs, recv, "unpack_gathered")
    width = rows * sum(atoms)
    if recv.numel() != group_size * width or not recv.is_contiguous():
        raise ValueError(f"unpack_gathered: recv must be contiguous with group_size * rows * sum(atoms) = "
                         f"{group_size * width} elements, got {recv.numel()}")
    for k, (out, atom) in enumerate(zip(outs, atoms)):
        if out.numel() > rows * group_size * atom:
            raise ValueError(f"unpack_gathered: output {k} has {out.numel()} elements, more than its "
                             f"{rows * group_size} atoms of {atom}")
    if _compiled(recv.device):
        _kernels().unpack_gathered(recv, outs, atoms, group_size, rows)
    else:
        reference.unpack_gathered(recv, outs, atoms, group_size, rows)
    return outs


@torch.no_grad()
def bucket_add(bucket: Optional[torch.Tensor], grads: Sequence[torch.Tensor], atoms: Sequence[int],
               group_size: int, rows: int, scale: float = 1.0, accumulate: bool = False,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Copy (or add) scaled gradients into a reduce-scatter bucket, transposed into member order, in one pass.

    ``bucket`` is flat ``[group_size * width]`` (``width = rows * sum(atoms)``): member i's chunk holds, per
    gradient k, its atoms ``i + r*d`` (r < rows) of ``scale * grad_k``, zero-padded past the gradient's end
    (``reference.bucket_add`` has the formula). Computed in fp32, rounded once to the bucket's dtype (fp32 or
    bf16); gradients are fp32 or bf16, any mix. ``accumulate`` adds instead of copying and leaves the padding
    as it is. ``bucket=None`` allocates one of ``dtype`` (default: the first gradient's). Returns the bucket.
    """
    grads = list(grads)
    atoms = _layout_args(atoms, group_size, rows, len(grads), "bucket_add")
    width = rows * sum(atoms)
    if bucket is None:
        if accumulate:
            raise ValueError("bucket_add: accumulate needs a bucket")
        if dtype is None and not grads:
            raise ValueError("bucket_add: no bucket, no gradients and no dtype")
        device = grads[0].device if grads else torch.device("cpu")
        bucket = torch.empty(group_size * width, dtype=dtype or grads[0].dtype, device=device)
    elif dtype is not None and bucket.dtype != dtype:
        raise TypeError(f"bucket_add: bucket is {bucket.dtype}, dtype says {dtype}")
    if bucket.dtype not in FLOAT_DTYPES or any(g.dtype not in FLOAT_DTYPES for g in grads):
        raise TypeError("bucket_add: bucket and gradients must be fp32 or bf16")
    if bucket.numel() != group_size * width or not bucket.is_contiguous():
        raise ValueError(f"bucket_add: bucket must be contiguous with group_size * rows * sum(atoms) = "
                         f"{group_size * width} elements, got {bucket.numel()}")
    for k, (grad, atom) in enumerate(zip(grads, atoms)):
        if grad.device != bucket.device:
            raise ValueError(f"bucket_add: gradient {k} is on {grad.device}, the bucket on {bucket.device}")
        if grad.numel() > rows * group_size * atom:
            raise ValueError(f"bucket_add: gradient {k} has {grad.numel()} elements, more than its "
                             f"{rows * group_size} atoms of {atom}")
    if _compiled(bucket.device):
        _kernels().bucket_add(bucket, grads, atoms, group_size, rows, float(scale), bool(accumulate))
    else:
        reference.bucket_add(bucket, grads, atoms, group_size, rows, float(scale), bool(accumulate))
    return bucket


# -------------------------------------------------------------------------------------------- quantization
def _check_quant(bits: int, block_size: int) -> None:
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if block_size < 1 or (bits == 4 and block_size % 2):
        raise ValueError(f"block_size must be >= 1, and even for int4 (got {block_size})")


def quantized_sizes(numel: int, bits: int, block_size: int) -> Tuple[int, int]:
    """(bytes of the quantized values, number of scales) for `numel` values."""
    return (numel if bits == 8 else (numel + 1) // 2), -(-numel // block_size)


@torch.no_grad()
def quantize(x: torch.Tensor, bits: int = 8, block_size: int = DEFAULT_BLOCK_SIZE,
             out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization of ``x`` (fp32 or bf16, flattened) in blocks of ``block_size`` values.

    Returns ``(q, scales)``: ``q`` int8 ``[numel]`` (bits=8) or uint8 ``[ceil(numel/2)]`` (bits=4, two values a
    byte), ``scales`` fp32 ``[ceil(numel/block_size)]``, written into ``out = (q, scales)`` when given (reused
    buffers: no allocation). Each value dequantizes to ``q * scale`` within ``scale / 2``; a block holding inf or
    NaN gets scale NaN (all its values dequantize to NaN).
    """
    _check_quant(bits, block_size)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"quantize: x must be fp32 or bf16, got {x.dtype}")
    x = x.contiguous()
    q_bytes, blocks = quantized_sizes(x.numel(), bits, block_size)
    q_dtype = torch.int8 if bits == 8 else torch.uint8
    if out is None:
        q = torch.empty(q_bytes, dtype=q_dtype, device=x.device)
        scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
    else:
        q, scales = out
        if (q.dtype != q_dtype or q.numel() != q_bytes or not q.is_contiguous() or scales.dtype != torch.float32
                or scales.numel() != blocks or not scales.is_contiguous() or q.device != x.device
                or scales.device != x.device):
            raise ValueError(f"quantize: out must be contiguous ({q_dtype} [{q_bytes}], float32 [{blocks}]) on "
                             f"{x.device}")
    if _compiled(x.device):
        _kernels().quantize(x, q, scales, bits, block_size)
    else:
        reference.quantize(x, q, scales, bits, block_size)
    return q, scales


def _numel(q_bytes: int, bits: int, numel: Optional[int]) -> int:
    if numel is not None:
        return int(numel)
    return q_bytes if bits == 8 else 2 * q_bytes


def _out(out: Optional[torch.Tensor], n: int, dtype: torch.dtype, device, what: str) -> torch.Tensor:
    if out is None:
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"{what}: dtype must be fp32 or bf16, got {dtype}")
        return torch.empty(n, dtype=dtype, device=device)
    if out.dtype not in FLOAT_DTYPES or out.numel() != n or not out.is_contiguous() or out.device != device:
        raise ValueError(f"{what}: out must be contiguous fp32 or bf16 with {n} elements on {device}")
    return out


@torch.no_grad()
def dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int = 8, block_size: int = DEFAULT_BLOCK_SIZE,
               numel: Optional[int] = None, dtype: torch.dtype = torch.float32,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``q * scale`` per value, as fp32 or bf16 (``dtype``, or ``out``'s). ``numel`` defaults to every value q
    holds (for int4 pass it when the original length was odd)."""
    _check_quant(bits, block_size)
    n = _numel(q.numel(), bits, numel)
    q_bytes, blocks = quantized_sizes(n, bits, block_size)
    if q.element_size() != 1 or q.numel() < q_bytes or scales.dtype != torch.float32 or scales.numel() < blocks:
        raise ValueError(f"dequantize: need >= {q_bytes} int8/uint8 values and >= {blocks} fp32 scales for {n} "
                         f"values, got {q.numel()} {q.dtype} and {scales.numel()} {scales.dtype}")
    out = _out(out, n, dtype, q.device, "dequantize")
    q, scales = q.contiguous().view(-1), scales.contiguous().view(-1)
    if _compiled(q.device):
        _kernels().dequantize(q, scales, out, bits, block_size)
    else:
        reference.dequantize(q, scales, out, bits, block_size)
    return out


def _rows(t: TensorOrList, what: str) -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        if t.dim() != 2:
            raise ValueError(f"dequantize_reduce: {what} must be [k, ...] (2-D) or a list of k tensors")
        return t if t.stride(-1) == 1 or t.shape[1] <= 1 else t.contiguous()
    return torch.stack([c.reshape(-1) for c in t]) if len(t) else None


@torch.no_grad()
def dequantize_reduce(chunks: TensorOrList, scales: TensorOrList, bits: int = 8,
                      block_size: int = DEFAULT_BLOCK_SIZE, numel: Optional[int] = None,
                      dtype: torch.dtype = torch.float32, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The sum of k quantized chunks: ``sum_j dequantize(chunks[j], scales[j])``, summed in fp32 in order
    j = 0..k-1 and rounded once to fp32 or bf16. ``chunks`` is ``[k, bytes]`` (an all-to-all's receive buffer)
    or a list of k tensors, ``scales`` ``[k, blocks]`` or a list; every chunk was quantized on its own (for
    chunks cut from one quantized tensor, make the chunk length a multiple of block_size)."""
    _check_quant(bits, block_size)
    chunks, scales = _rows(chunks, "chunks"), _rows(scales, "scales")
    if chunks is None or scales is None:
        if numel is None:
            raise ValueError("dequantize_reduce: no chunks: pass numel")
        device = out.device if out is not None else torch.device("cpu")
        return _out(out, int(numel), dtype, device, "dequantize_reduce").zero_()
    n = _numel(chunks.shape[1], bits, numel)
    q_bytes, blocks = quantized_sizes(n, bits, block_size)
    if (chunks.element_size() != 1 or scales.dtype != torch.float32 or chunks.shape[0] != scales.shape[0]
            or chunks.shape[1] < q_bytes or scales.shape[1] < blocks or chunks.device != scales.device):
        raise ValueError(f"dequantize_reduce: need k chunks of >= {q_bytes} int8/uint8 values and k rows of "
                         f">= {blocks} fp32 scales for {n} values, got {tuple(chunks.shape)} {chunks.dtype} and "
                         f"{tuple(scales.shape)} {scales.dtype}")
    out = _out(out, n, dtype, chunks.device, "dequantize_reduce")
    if _compiled(chunks.device):
        _kernels().dequantize_reduce(chunks, scales, out, bits, block_size)
    else:
        reference.dequantize_reduce(chunks, scales, out, bits, block_size)
    return out
