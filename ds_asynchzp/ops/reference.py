"""The ops in plain torch: the specification the compiled kernels are tested against, and the fallback.

Each function here defines its op's result bit for bit (NaN payloads aside); the compiled kernels compute the
same fp32 operations in the same order, each rounded once (no fused multiply-add). Arguments are already
checked by ``api.py``; outputs are allocated by the caller.

Layouts (the engine's, see ``ds_asynchzp/layout.py``): a parameter of ``n`` elements is padded to
``rows * d * atom`` and cut into ``rows * d`` atoms; atom ``r*d + i`` is member ``i``'s row ``r``. A flat
``[d, width]`` buffer (``width = rows * sum(atoms)``) holds, in member ``i``'s row, the parameters one after
the other, each as its ``rows`` atoms of member ``i``.
"""

from __future__ import annotations

from typing import Sequence

import torch

QMAX = {8: 127, 4: 7}


# ------------------------------------------------------------------------------------------------ layout ops
def pack(srcs: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """out = the concatenation of every source's elements in row-major order (sources may be strided)."""
    offset = 0
    for src in srcs:
        n = src.numel()
        out.view(-1)[offset:offset + n].view(src.shape).copy_(src)
        offset += n


def unpack(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    """The inverse of pack: each output (may be strided) receives its run of `flat`, in order."""
    offset = 0
    for out in outs:
        n = out.numel()
        out.copy_(flat.view(-1)[offset:offset + n].view(out.shape))
        offset += n


def _columns(atoms: Sequence[int], rows: int):
    offset = 0
    for atom in atoms:
        yield offset, atom
        offset += rows * atom


def unpack_gathered(recv: torch.Tensor, outs: Sequence[torch.Tensor], atoms: Sequence[int], group_size: int,
                    rows: int) -> None:
    """recv is [d, width]: member j's send. Output k receives parameter k in atom order, unpadded:
    out_k.view(-1)[(r*d + j)*a_k + c] = recv[j, column_k + r*a_k + c] for every index < out_k.numel()."""
    d = group_size
    gathered = recv.view(d, -1)
    for out, (column, atom) in zip(outs, _columns(atoms, rows)):
        block = gathered[:, column:column + rows * atom].view(d, rows, atom)
        full = block.transpose(0, 1).reshape(-1)          # [rows, d, atom]: atom order
        out.copy_(full[:out.numel()].view(out.shape))


def bucket_add(bucket: torch.Tensor, grads: Sequence[torch.Tensor], atoms: Sequence[int], group_size: int,
               rows: int, scale: float, accumulate: bool) -> None:
    """bucket is [d, width]; member i's row receives, per gradient k, its atoms i + r*d (r < rows) of
    scale * grad_k, zero-padded past grad_k's end:

        bucket[i, column_k + r*a_k + c]  =  scale * g_k[(r*d + i)*a_k + c]          (copy)
                                         +=  scale * g_k[(r*d + i)*a_k + c]         (accumulate)

    computed in fp32 (g_k in fp32 times fp32(scale), then the add), rounded once to the bucket's dtype. Copying
    writes zeros into the padding; accumulating leaves the padding untouched."""
    d = group_size
    view = bucket.view(d, -1)
    for grad, (column, atom) in zip(grads, _columns(atoms, rows)):
        region = view[:, column:column + rows * atom].view(d, rows, atom).transpose(0, 1)  # [rows, d, atom]
        n = grad.numel()
        scaled = torch.zeros(rows * d * atom, dtype=torch.float32, device=bucket.device)
        scaled[:n] = grad.reshape(-1).float() * scale
        scaled = scaled.view(rows, d, atom)
        if accumulate:
            inside = (torch.arange(rows * d * atom, device=bucket.device) < n).view(rows, d, atom)
            region.copy_(torch.where(inside, region.float() + scaled, region.float()))
        else:
            region.copy_(scaled)


# -------------------------------------------------------------------------------------------- quantization
def _blocks(x: torch.Tensor, block_size: int):
    flat = x.reshape(-1).float()
    n = flat.numel()
    blocks = -(-n // block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float32, device=x.device)
    padded[:n] = flat
    return padded.view(blocks, block_size), n


def block_scales(blocks: torch.Tensor, qmax: int) -> torch.Tensor:
    """absmax / qmax per block, one ulp up where s*qmax < absmax, one ulp down where s*qmax overflows; NaN for a
    block holding inf or NaN (see quant_math.h for why)."""
    finite = torch.isfinite(blocks).all(dim=1)
    absmax = torch.where(finite, blocks.abs().amax(dim=1), torch.zeros_like(blocks[:, 0]))
    # A tensor divisor: torch on CUDA turns a division by a Python scalar into a multiplication by its reciprocal,
    # which is not the correctly rounded quotient the kernels compute (one ulp off for some blocks at qmax 7).
    s = absmax / torch.full_like(absmax, qmax)
    s = torch.where(s * qmax < absmax, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
    s = torch.where(torch.isinf(s * qmax), torch.nextafter(s, torch.zeros_like(s)), s)
    return torch.where(finite, s, torch.full_like(s, float("nan")))


def quantize(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int) -> None:
    """Symmetric absmax block quantization of x flattened: q = round_half_even(x / s) per block (|q| <= 127 for
    int8, 7 for int4; 0 where s is 0 or NaN). int4 packs element 2i in the low nibble of byte i, 2i+1 in the
    high one (two's complement; the high nibble of an odd length's last byte is 0)."""
    qmax = QMAX[bits]
    blocks, n = _blocks(x, block_size)
    s = block_scales(blocks, qmax)
    scales.copy_(s)
    usable = (s > 0)[:, None]
    ratio = blocks / torch.where(usable, s[:, None], torch.ones_like(s[:, None]))
    values = torch.where(usable, torch.round(ratio).clamp(-qmax, qmax), torch.zeros_like(ratio))
    values = values.reshape(-1)[:n].to(torch.int8)
    if bits == 8:
        q.copy_(values)
        return
    nibbles = torch.zeros(2 * q.numel(), dtype=torch.int16, device=x.device)
    nibbles[:n] = values.to(torch.int16) & 0xF
    pairs = nibbles.view(-1, 2)
    q.copy_((pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8))


def _values(q: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The integers of a quantized tensor, as fp32, first n of them."""
    if bits == 8:
        return q.view(-1)[:n].float()
    b = q.view(-1).to(torch.int16)
    pairs = torch.stack([((b & 0xF) ^ 8) - 8, ((b >> 4) ^ 8) - 8], dim=1)
    return pairs.reshape(-1)[:n].float()


def _dequantize_fp32(q: torch.Tensor, scales: torch.Tensor, n: int, bits: int, block_size: int) -> torch.Tensor:
    values = _values(q, n, bits)
    per_value = scales.view(-1).repeat_interleave(block_size)[:n]
    return values * per_value


def dequantize(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, bits: int, block_size: int) -> None:
    """out = q * s per block, in fp32, rounded once to out's dtype."""
    n = out.numel()
    out.view(-1).copy_(_dequantize_fp32(q, scales, n, bits, block_size))


def dequantize_reduce(chunks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, bits: int,
                      block_size: int) -> None:
    """out = sum over j = 0..k-1 (in that order, in fp32, starting from +0) of dequantize(chunks[j], scales[j]),
    rounded once to out's dtype."""
    n = out.numel()
    acc = torch.zeros(n, dtype=torch.float32, device=out.device)
    for j in range(chunks.shape[0]):
        acc = acc + _dequantize_fp32(chunks[j], scales[j], n, bits, block_size)
    out.view(-1).copy_(acc)


# --------------------------------------------------------------- ZeRO++'s quantizer contract (ops/cpu_zeropp.cpp)
def zeropp_codes(x16: torch.Tensor, groups: int, bits: int):
    """Symmetric grouped quantization of fp16 values, as DeepSpeed's CUDA kernels define it: per contiguous
    group, absmax over the fp16 values (NaN ignored), scale = 2^bits / (2 * absmax) (1 where absmax is 0), code =
    clamp(round_half_even(x * scale), -2^(bits-1), 2^(bits-1) - 1) (NaN -> 0), param = 1 / scale.
    Returns (codes [groups, len] int8, one a value; params [groups] fp32)."""
    x = x16.reshape(groups, -1).float()
    absmax = torch.where(torch.isnan(x), torch.zeros_like(x), x.abs()).amax(dim=1)
    scale = torch.where(absmax == 0, torch.ones_like(absmax), torch.full_like(absmax, float(1 << bits)) / (2 * absmax))
    v = torch.nan_to_num(x * scale[:, None], nan=0.0)
    codes = torch.round(v).clamp(-(1 << (bits - 1)), (1 << (bits - 1)) - 1).to(torch.int8)
    return codes, torch.ones_like(scale) / scale


def zeropp_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (int8, one a value) as stored: int8 as they are; int4 two a byte, element 2i in the high nibble."""
    flat = codes.reshape(-1)
    if bits == 8:
        return flat.clone()
    pairs = flat.to(torch.int16).view(-1, 2)
    return (((pairs[:, 0] & 0xF) << 4) | (pairs[:, 1] & 0xF)).to(torch.uint8).view(torch.int8)


def zeropp_unpack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of zeropp_pack: int8 codes, one a value (int4 nibbles sign-extended)."""
    flat = q.reshape(-1)
    if bits == 8:
        return flat.clone()
    b = flat.view(torch.uint8).to(torch.int16)
    return torch.stack([((b >> 4) ^ 8) - 8, ((b & 0xF) ^ 8) - 8], dim=1).reshape(-1).to(torch.int8)


def zeropp_quantize(x16: torch.Tensor, q: torch.Tensor, params: torch.Tensor, groups: int, bits: int,
                    pipeline: int, nodes: int, devices_per_node: int) -> None:
    """zeropp_codes of x16, with its groups swizzled for qgZ's two all-to-alls: seen as [nodes, devices_per_node,
    pipeline, C] groups, they are written in the order [pipeline, devices_per_node, nodes, C], so that output
    chunk d holds the shards of global ranks d, dpn + d, 2 dpn + d, ... (nodes = devices_per_node = pipeline = 1:
    plain quantization)."""
    codes, p = zeropp_codes(x16, groups, bits)
    order = torch.arange(groups, device=x16.device).view(nodes, devices_per_node, pipeline, -1).permute(2, 1, 0, 3).reshape(-1)
    q.view(-1).copy_(zeropp_pack(codes[order], bits))
    params.view(-1).copy_(p[order])


def zeropp_dequantize(q: torch.Tensor, params: torch.Tensor, out: torch.Tensor, groups: int, bits: int) -> None:
    """out = code * param of its group, computed in fp32 and rounded once to out's dtype (fp16, or fp32)."""
    codes = zeropp_unpack(q, bits).view(groups, -1).float()
    out.view(-1).copy_((codes * params.reshape(-1)[:groups, None]).reshape(-1))


def zeropp_quantized_reduction(q: torch.Tensor, params: torch.Tensor, out_q: torch.Tensor, out_params: torch.Tensor,
                               in_groups: int, out_groups: int, bits: int, devices_per_node: int) -> None:
    """q holds devices_per_node chunks, each quantized in in_groups / devices_per_node groups with its own params.
    Each chunk is dequantized to fp16, the chunks are summed in fp16 in chunk order (each partial sum rounded to
    fp16, starting from +0; no division), and the sum is requantized in out_groups groups."""
    d = devices_per_node
    chunks = q.reshape(d, -1)
    acc = torch.zeros(chunks.shape[1] * 8 // bits, dtype=torch.float16, device=q.device)
    for j in range(d):
        deq = torch.empty_like(acc)
        zeropp_dequantize(chunks[j], params.reshape(-1)[j * (in_groups // d):], deq, in_groups // d, bits)
        acc = (acc.float() + deq.float()).half()
    codes, p = zeropp_codes(acc, out_groups, bits)
    out_q.view(-1).copy_(zeropp_pack(codes, bits))
    out_params.view(-1).copy_(p)
