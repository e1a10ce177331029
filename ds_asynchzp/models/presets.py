"""The benchmark's model by preset name, and its element counts as the communication ledger counts them.

A preset is a GPT of `gpt.MODEL_PRESETS` (optionally with routed experts, its position table grown to a longer
sequence) or a Mixtral of `mixtral.MOE_PRESETS`. `model_config` is the exact architecture the benchmark's ranks
build for a dense preset; `element_counts` counts P_g, P_r and P_t of it, which the planner's formulas take.
"""

from __future__ import annotations

import dataclasses

from ..formulas.sizing import padded_num_params
from .gpt import MODEL_PRESETS, GPTConfig, build_model
from .mixtral import MOE_PRESETS, build_moe_model


def model_config(preset: str, moe_experts: int = 0, seq_len: int = 0) -> GPTConfig:
    """The GPT config of a dense preset, with ``moe_experts`` routed experts per block if non-zero."""
    cfg = MODEL_PRESETS[preset]
    changes = {}
    if moe_experts:
        changes["moe_experts"] = moe_experts
    # The position tables are sized by the config; only grow them when the requested sequence would not fit,
    # so a shorter --seq-len trains the preset's exact architecture.
    if seq_len > cfg.seq_len:
        changes["seq_len"] = seq_len
    return dataclasses.replace(cfg, **changes) if changes else cfg


def build_bench_model(preset: str, moe_experts: int, seq_len: int, seed: int):
    """The benchmark's model: a byte-level GPT preset (`gpt.py`), or the AutoEP Mixtral (`mixtral.py`)."""
    if preset in MOE_PRESETS:
        return build_moe_model(preset, seq_len, seed=seed)
    return build_model(model_config(preset, moe_experts, seq_len), seed=seed)


def _padded(numel: int, multiple: int) -> int:
    return padded_num_params([numel], multiple)


def element_counts(preset: str, moe_experts: int, seq_len: int, world: int, multiple: int | None = None) -> dict:
    """P_g, P_r, P_t of a dense preset's model (`model_config`), counted as the ledger tests count them.

    P_g: each module's own parameters (a tied weight once per module that owns it); P_r: trainable parameters
    except the deliberately unused one; P_t: all trainable parameters. Each padded to a multiple of
    ``multiple``: the world (default) for ZeRO-3 and hpZ, ``d_o`` for an AsyncHZP arm. ``qgz``: the unpadded
    elements of the 2-D gradients whose size splits into 2 x world parts (what stock qgZ's all-to-all takes).
    """
    multiple = world if multiple is None else multiple
    model = build_model(model_config(preset, moe_experts, seq_len))
    counts = {"gathered": 0, "reduced": 0, "trainable": 0, "qgz": 0}
    for module in model.modules():
        counts["gathered"] += sum(_padded(p.numel(), multiple) for p in module.parameters(recurse=False))
    for name, param in model.named_parameters():
        if param.requires_grad:
            counts["trainable"] += _padded(param.numel(), multiple)
            if name != "unused":
                counts["reduced"] += _padded(param.numel(), multiple)
                # Stock qgZ's all-to-all takes 2-D gradients whose size splits into 2N parts; the rest fall back.
                if param.dim() >= 2 and param.numel() % (2 * world) == 0:
                    counts["qgz"] += param.numel()
    return counts
