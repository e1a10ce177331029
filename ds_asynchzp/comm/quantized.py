"""Quantized variants of the collectives: block-quantize, send one byte buffer, dequantize.

The wire format is `ds_asynchzp.quantization.QuantFormat`: each member's row carries its quantized values and
their fp32 block scales together, so a quantized collective is one collective of a uint8 buffer (the ledger
counts the bytes as sent). A row may be cut into **segments** (one per parameter): blocks then restart at every
segment, so a parameter of small values (a bias) never shares a scale with one of large values (a LayerNorm
weight next to it). The arithmetic is the ops library's (`ds_asynchzp.ops`: compiled kernels where they build,
the pure-torch reference otherwise, same results):

* `reduce_scatter`: the sum over the group of each member's row k into member k, as a pairwise exchange of
  quantized rows followed by a fused dequantize-and-sum in fp32 (ZeRO++ qgZ's scheme: dequantizing before
  summing keeps errors from compounding). Rows may carry error feedback: the part of each row the
  quantization dropped is added to the same row of the next call;
* `all_gather`: every member's quantized row, dequantized (its own row too, so every member sees the same
  values);
* `all_reduce`: `reduce_scatter` of 1/n slices, then `all_gather` of the sums (its blocks may span segments:
  the slices are cut by size, not by parameter).

Buffers come from the caller's scratch (`state.scratch.Scratch`): no allocation in steady state.
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

import torch

from .. import ops
from ..platform import ledger
from ..quantization import SCALE_BYTES, QuantFormat
from ..platform.process_groups import Group
from ..state.scratch import Scratch
from .collectives import all_gather as _all_gather
from .collectives import all_to_all as _all_to_all


class RowLayout:
    """Where each segment of a row of n values lives in its wire bytes: (first value, length, first byte)."""

    def __init__(self, fmt: QuantFormat, segments: Tuple[int, ...]):
        self.fmt = fmt
        self.pieces: List[Tuple[int, int, int]] = []
        start = offset = 0
        for length in segments:
            if length:
                self.pieces.append((start, length, offset))
                offset += fmt.row_bytes(length)
            start += length
        self.numel = start
        self.row_bytes = offset
        # What the ledger counts as scales (the alignment padding before them counts as payload).
        scale_bytes = sum(SCALE_BYTES * fmt.blocks(length) for _, length, _ in self.pieces)
        self.scale_share = scale_bytes / offset if offset else 0.0

    def views(self, rows: torch.Tensor, piece: Tuple[int, int, int]):
        """(values [k, value_bytes], scales [k, blocks]) of one segment in a [k, row_bytes] uint8 buffer."""
        _, length, offset = piece
        fmt = self.fmt
        values = rows[:, offset:offset + fmt.value_bytes(length)]
        if fmt.bits == 8:
            values = values.view(torch.int8)
        start = offset + fmt.scales_offset(length)
        return values, rows[:, start:start + 4 * fmt.blocks(length)].view(torch.float32)


@lru_cache(maxsize=4096)
def row_layout(fmt: QuantFormat, segments: Tuple[int, ...]) -> RowLayout:
    """The layout of a row cut into `segments` (cached: every step sends the same rows)."""
    return RowLayout(fmt, segments)


def _layout(fmt: QuantFormat, n: int, segments: Optional[Sequence[int]]) -> RowLayout:
    layout = row_layout(fmt, tuple(segments) if segments is not None else (n,))
    if layout.numel != n:
        raise ValueError(f"segments add up to {layout.numel} values, the row has {n}")
    return layout


def _quantize_rows(src: torch.Tensor, out: torch.Tensor, layout: RowLayout, pool: Scratch,
                   residual: Optional[torch.Tensor]) -> None:
    """Quantize each row of src [k, n] into out [k, row_bytes]; with `residual` [k, n] fp32, quantize
    src + residual and keep what the quantization dropped in residual."""
    k = src.shape[0]
    fmt = layout.fmt
    rows = out.view(k, layout.row_bytes)
    for piece in layout.pieces:
        start, length, _ = piece
        values, scales = layout.views(rows, piece)
        for j in range(k):
            row = src[j, start:start + length]
            if row.dtype not in ops.FLOAT_DTYPES or residual is not None:
                # fp16 (the ops take fp32 and bf16), or the compensated row of error feedback, staged in fp32.
                staged = pool.get("q_staged", length, torch.float32, src.device)
                staged.copy_(row)
                if residual is not None:
                    staged.add_(residual[j, start:start + length])
                row = staged
            ops.quantize(row, fmt.bits, fmt.block_size, out=(values[j], scales[j]))
            if residual is not None:
                # residual = (src + residual) - dequantize(q): the error the receiver will not see this time.
                kept = residual[j, start:start + length]
                ops.dequantize(values[j], scales[j], fmt.bits, fmt.block_size, numel=length, out=kept)
                torch.sub(row, kept, out=kept)


def _into(op, out: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat, length: int,
          pool: Scratch) -> None:
    """`op` (ops.dequantize or ops.dequantize_reduce) into `out`; through fp32 scratch where `out` is fp16 or
    strided (the ops write fp32 or bf16, contiguous)."""
    if out.dtype in ops.FLOAT_DTYPES and out.is_contiguous():
        op(values, scales, fmt.bits, fmt.block_size, numel=length, out=out)
    else:
        out.copy_(op(values, scales, fmt.bits, fmt.block_size, numel=length,
                     out=pool.get("q_out", length, torch.float32, out.device)))


def reduce_scatter(out: torch.Tensor, send: torch.Tensor, group: Group, fmt: QuantFormat, pool: Scratch,
                   residual: Optional[torch.Tensor] = None, segments: Optional[Sequence[int]] = None) -> None:
    """out [n] (fp32 or bf16) = sum over members m of member m's send[group.rank]; send is [group.size, n].
    Synchronous (it runs inside a communication thread's job)."""
    k, n = send.shape
    if group.size == 1:
        out.copy_(send[0])
        return
    if n == 0:
        return
    layout = _layout(fmt, n, segments)
    packed = pool.get("q_send", k * layout.row_bytes, torch.uint8, send.device)
    _quantize_rows(send, packed, layout, pool, residual)
    received = pool.get("q_recv", k * layout.row_bytes, torch.uint8, send.device)
    with ledger.carrying_scales(layout.scale_share):
        _all_to_all(received, packed, group).wait()
    rows = received.view(k, layout.row_bytes)
    for piece in layout.pieces:
        start, length, _ = piece
        values, scales = layout.views(rows, piece)
        _into(ops.dequantize_reduce, out[start:start + length], values, scales, fmt, length, pool)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group, fmt: QuantFormat, pool: Scratch,
               segments: Optional[Sequence[int]] = None) -> None:
    """out [group.size, n] (fp32 or bf16) = every member's inp [n], quantized on the wire. Synchronous."""
    n = inp.numel()
    k = group.size
    if k == 1:
        out.view(-1).copy_(inp.view(-1))
        return
    if n == 0:
        return
    layout = _layout(fmt, n, segments)
    packed = pool.get("q_send", layout.row_bytes, torch.uint8, inp.device)
    _quantize_rows(inp.view(1, n), packed, layout, pool, None)
    received = pool.get("q_recv", k * layout.row_bytes, torch.uint8, inp.device)
    with ledger.carrying_scales(layout.scale_share):
        _all_gather(received, packed, group).wait()
    rows = received.view(k, layout.row_bytes)
    target = out.view(k, n)
    for piece in layout.pieces:
        start, length, _ = piece
        values, scales = layout.views(rows, piece)
        for j in range(k):
            _into(ops.dequantize, target[j, start:start + length], values[j], scales[j], fmt, length, pool)


def all_reduce(tensor: torch.Tensor, group: Group, fmt: QuantFormat, pool: Scratch) -> None:
    """tensor [n] (fp32 or bf16) = its sum over the group: a quantized reduce-scatter of 1/k slices, then a
    quantized all-gather of the sums. Synchronous."""
    k, n = group.size, tensor.numel()
    if k == 1 or n == 0:
        return
    part = -(-n // k)
    padded = pool.get("q_ar_in", k * part, torch.float32, tensor.device)
    padded[:n].copy_(tensor.view(-1))
    padded[n:].zero_()
    mine = pool.get("q_ar_part", part, torch.float32, tensor.device)
    reduce_scatter(mine, padded.view(k, part), group, fmt, pool)
    reduced = pool.get("q_ar_out", k * part, torch.float32, tensor.device)
    all_gather(reduced, mine, group, fmt, pool)
    tensor.view(-1).copy_(reduced[:n])
