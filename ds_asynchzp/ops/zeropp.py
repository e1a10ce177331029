"""DeepSpeed ZeRO++'s quantizer on CPU: the module stock qwZ and qgZ load through ``QuantizerBuilder().load()``.

DeepSpeed 0.19.8 ships this quantizer as CUDA kernels only; on the CPU accelerator its builder is a
``NotImplementedBuilder`` and stock ZeRO++ fails at ``deepspeed.initialize``. This module is a drop-in for the
loaded CUDA module: the same function names, arguments and results, and the attributes ``Symmetric`` and
``Asymmetric``. ``ds_asynchzp.platform.deepspeed_internals.install_cpu_zeropp_quantizer()`` binds it into
DeepSpeed where DeepSpeed has no quantizer of its own; a rank calls it before ``deepspeed.initialize``.

What ZeRO++ calls: ``quantize(x, groups, 8, Symmetric)`` and ``dequantize(q, params, groups, 8, Symmetric)``
(qwZ), ``swizzle_quant(x, groups, 4, Symmetric, 1, nodes, devices_per_node)``, ``quantized_reduction(q, params,
in_groups, out_groups, 4, Symmetric, devices_per_node)`` and ``dequantize(q, params, groups, 4, Symmetric)``
(qgZ). The arithmetic is the CUDA kernels' (``ops/cpu_zeropp.cpp`` has it in full): per contiguous group of fp16
values, absmax, scale ``2^bits / (2 * absmax)`` (1 where absmax is 0), codes rounded half to even and clamped to
``[-2^(bits-1), 2^(bits-1) - 1]``, the fp32 param ``1 / scale`` stored per group, dequantized values rounded to
fp16; int4 packs two codes a byte, the even element in the high nibble; ``quantized_reduction`` sums its
``devices_per_node`` chunks in fp16, in chunk order, without dividing.

Where it deliberately differs from the CUDA module:

* params (scales) come back 1-D ``[groups]``, not ``[groups, 1]`` (same memory; gloo's all-gather into a flat
  tensor rejects the 2-D shape, and ZeRO++ only uses ``numel()``, ``cat`` and dim-0 splits of them);
* non-fp16 input (bf16, fp32) is converted to fp16 by value; the CUDA kernels read any input through ``__half*``
  and so reinterpret a bf16 gradient's bits (DeepSpeed only casts qwZ's parameters to fp16 first);
* IEEE single-rounding arithmetic: the CUDA build uses ``--use_fast_math``, so results agree closely with a GPU's,
  not bit for bit;
* sizes that make the CUDA kernels leave groups unwritten or straddle a byte (groups not dividing the values,
  ``groups % (nodes * devices_per_node) != 0``, an odd int4 group) raise ``ValueError`` instead;
* ``Asymmetric`` exists as an attribute, but its use raises ``NotImplementedError`` (ZeRO++ never uses it).

The C++ kernels (``torch.ops.ds_asynchzp.zeropp_*``) run where the ops library is built (``builder.py``); the
pure-torch reference (``reference.py``, the specification) runs otherwise (``DS_ASYNCHZP_OPS=reference``, no
compiler, or tensors off the CPU). Both give the same results, bit for bit.
"""

from __future__ import annotations

import enum
from typing import List

import torch

from . import builder, reference


class QuantizationType(enum.IntEnum):
    """The CUDA module's ``QuantizationType`` enum (same values)."""

    Symmetric = 0
    Asymmetric = 1


Symmetric = QuantizationType.Symmetric
Asymmetric = QuantizationType.Asymmetric


def _compiled(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and builder.compiled("cpu")


def _kernels():
    return torch.ops.ds_asynchzp


def _check(what: str, bits: int, quant_type) -> int:
    if int(quant_type) == Asymmetric:
        raise NotImplementedError(f"zeropp {what}: Asymmetric quantization is not implemented on CPU (ZeRO++ "
                                  "uses Symmetric only)")
    if int(quant_type) != Symmetric:
        raise ValueError(f"zeropp {what}: unknown quantization type {quant_type!r}")
    if bits not in (8, 4):
        raise ValueError(f"zeropp {what}: num_bits must be 8 or 4, got {bits}")
    return int(bits)


def _require(ok: bool, what: str, message: str) -> None:
    if not ok:
        raise ValueError(f"zeropp {what}: {message}")


def _fp16(x: torch.Tensor) -> torch.Tensor:
    """The kernels' input: fp16, contiguous (non-fp16 values converted by value, see the module docstring)."""
    return x.detach().to(torch.float16).contiguous()


def _last_dim_scaled(shape, mul: int, div: int) -> list:
    sizes = list(shape) or [1]
    sizes[-1] = sizes[-1] * mul // div
    return sizes


def _group_quantize(what: str, x: torch.Tensor, groups: int, bits: int, pipeline: int, nodes: int,
                    devices_per_node: int, q_shape) -> List[torch.Tensor]:
    groups, partitions = int(groups), int(nodes) * int(devices_per_node)
    n = x.numel()
    _require(groups > 0 and n % groups == 0, what, f"{groups} groups do not divide {n} values")
    _require(pipeline > 0 and partitions > 0 and groups % (partitions * pipeline) == 0, what,
             f"{groups} groups are not a multiple of nodes * devices_per_node * pipeline = {partitions * pipeline} "
             "(the CUDA kernel would leave the remainder unwritten)")
    _require(bits == 8 or (n // groups) % 2 == 0, what, f"int4 needs an even group length, got {n // groups}")
    _require(torch.Size(q_shape).numel() * 8 == n * bits, what, f"int4 needs an even last dimension, got {q_shape}")
    x16 = _fp16(x)
    q = torch.empty(q_shape, dtype=torch.int8, device=x.device)
    params = torch.empty(groups, dtype=torch.float32, device=x.device)
    if _compiled(x16):
        _kernels().zeropp_quantize(x16, q, params, groups, bits, int(pipeline), int(nodes), int(devices_per_node))
    else:
        reference.zeropp_quantize(x16, q, params, groups, bits, int(pipeline), int(nodes), int(devices_per_node))
    return [q, params]


@torch.no_grad()
def quantize(input_vals: torch.Tensor, groups: int, num_bits: int, quant_type=Symmetric) -> List[torch.Tensor]:
    """``[q, params]``: int8 codes (the input's shape, last dim halved for int4) and fp32 params ``[groups]``."""
    bits = _check("quantize", num_bits, quant_type)
    return _group_quantize("quantize", input_vals, groups, bits, 1, 1, 1,
                           _last_dim_scaled(input_vals.shape, bits, 8))


def _dequantize(what: str, quantized_data: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int,
                quant_type, dtype: torch.dtype) -> torch.Tensor:
    bits = _check(what, num_bits, quant_type)
    groups = int(groups)
    out = torch.empty(_last_dim_scaled(quantized_data.shape, 8, bits), dtype=dtype, device=quantized_data.device)
    n = out.numel()
    _require(quantized_data.element_size() == 1, what, f"codes must be int8, got {quantized_data.dtype}")
    _require(groups > 0 and n % groups == 0 and params.numel() >= groups, what,
             f"{groups} groups must divide {n} values and have a param each ({params.numel()} given)")
    q = quantized_data.contiguous().view(torch.int8)
    p = params.to(torch.float32).contiguous()
    if _compiled(q):
        _kernels().zeropp_dequantize(q, p, out, groups, bits)
    else:
        reference.zeropp_dequantize(q, p, out, groups, bits)
    return out


@torch.no_grad()
def dequantize(quantized_data: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int,
               quant_type=Symmetric) -> torch.Tensor:
    """fp16 values ``code * param`` (the codes' shape, last dim doubled for int4)."""
    return _dequantize("dequantize", quantized_data, params, groups, num_bits, quant_type, torch.float16)


@torch.no_grad()
def dequantize_fp32(quantized_data: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int,
                    quant_type=Symmetric) -> torch.Tensor:
    """As ``dequantize``, in fp32."""
    return _dequantize("dequantize_fp32", quantized_data, params, groups, num_bits, quant_type, torch.float32)


@torch.no_grad()
def swizzle_quant(input_vals: torch.Tensor, groups: int, num_bits: int, quant_type, pipeline_size: int, nodes: int,
                  devices_per_node: int) -> List[torch.Tensor]:
    """qgZ's first step: quantize in ``groups`` groups, then reorder them for the intra-node all-to-all, so that
    output chunk d (of ``devices_per_node``) holds the shards of global ranks d, dpn + d, 2 dpn + d, ... (with a
    pipeline of P, each chunk is cut in P slices and slice p of every chunk comes first). Returns
    ``[q (1-D int8), params [groups]]``."""
    bits = _check("swizzle_quant", num_bits, quant_type)
    return _group_quantize("swizzle_quant", input_vals, groups, bits, int(pipeline_size), nodes, devices_per_node,
                           [input_vals.numel() * bits // 8])


@torch.no_grad()
def quantized_reduction(input_vals: torch.Tensor, input_scales: torch.Tensor, in_groups: int, out_groups: int,
                        num_bits: int, quant_type, devices_per_node: int) -> List[torch.Tensor]:
    """qgZ's intra-node reduction: the ``devices_per_node`` received chunks (each in ``in_groups /
    devices_per_node`` groups with its own params) dequantized to fp16, summed in fp16 in chunk order (no
    division), requantized in ``out_groups`` groups. Returns ``[q (last dim / devices_per_node), params
    [out_groups]]``."""
    what = "quantized_reduction"
    bits = _check(what, num_bits, quant_type)
    d, in_groups, out_groups = int(devices_per_node), int(in_groups), int(out_groups)
    _require(input_vals.element_size() == 1, what, f"codes must be int8, got {input_vals.dtype}")
    _require(d > 0 and input_vals.numel() % d == 0 and in_groups % d == 0, what,
             f"devices_per_node = {d} must divide the {input_vals.numel()} codes and in_groups = {in_groups}")
    n = input_vals.numel() // d * 8 // bits
    per_chunk = in_groups // d
    _require(per_chunk > 0 and out_groups > 0 and n % per_chunk == 0 and n % out_groups == 0, what,
             f"in_groups / devices_per_node = {per_chunk} and out_groups = {out_groups} must divide a chunk's {n} "
             "values")
    _require(bits == 8 or (n // out_groups) % 2 == 0, what, "int4 needs an even output group length")
    _require(input_scales.numel() >= in_groups, what, f"{in_groups} params needed, {input_scales.numel()} given")
    q = input_vals.contiguous().view(torch.int8)
    p = input_scales.to(torch.float32).contiguous()
    out_q = torch.empty(_last_dim_scaled(input_vals.shape, 1, d), dtype=torch.int8, device=q.device)
    out_params = torch.empty(out_groups, dtype=torch.float32, device=q.device)
    _require(out_q.numel() * d == q.numel(), what, f"devices_per_node = {d} must divide the last dimension")
    if _compiled(q):
        _kernels().zeropp_quantized_reduction(q, p, out_q, out_params, in_groups, out_groups, bits, d)
    else:
        reference.zeropp_quantized_reduction(q, p, out_q, out_params, in_groups, out_groups, bits, d)
    return [out_q, out_params]


def stock_zeropp_problems(named_parameters, world_size: int) -> List[str]:
    """Why stock ZeRO++ (DeepSpeed 0.19.8's Python around this quantizer) cannot train these parameters on
    ``world_size`` ranks: one line per parameter, empty where it can.

    * qwZ: ``CUDAQuantizer.quantize`` asserts that a gather quantizes a multiple of 8 elements. A gather holds
      whole parameter shards (``ceil(numel / world)`` elements each), and the coordinator's prefetch may cut its
      set of parameters anywhere, so every shard must be a multiple of 8.
    * qgZ: a 2-D gradient with ``numel % (2 * world) == 0`` is quantized in ``max(rows, cols, world)`` groups,
      which must be a multiple of the world (else the CUDA kernel leaves groups unwritten, and this module
      refuses) and of even length (int4 pairs)."""
    problems = []
    for name, param in named_parameters:
        shard = -(-param.numel() // world_size)
        if world_size > 1 and shard % 8:
            problems.append(f"{name} ({param.numel()} elements) shards to {shard} elements at {world_size} ranks, "
                            "not a multiple of 8 (qwZ)")
        if param.requires_grad and param.dim() == 2 and param.numel() % (2 * world_size) == 0:
            groups = max(param.shape[0], param.shape[1], world_size)
            if groups % world_size or (param.numel() // groups) % 2:
                problems.append(f"{name} {tuple(param.shape)}: {groups} int4 groups of {param.numel() // groups} "
                                f"do not split over {world_size} ranks (qgZ)")
    return problems


__all__ = ["QuantizationType", "Symmetric", "Asymmetric", "quantize", "dequantize", "dequantize_fp32",
           "swizzle_quant", "quantized_reduction", "stock_zeropp_problems"]
