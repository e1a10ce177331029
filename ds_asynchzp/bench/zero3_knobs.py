"""The ZeRO-3 knobs every arm of a benchmark run shares (``--zero3-knobs``), so that only the arm's own keys differ.

Presets:

* ``tuned`` (default): what a user training a model too large for one device would set, with stock ZeRO-3's own
  scheduling on. Every parameter is partitioned (persistence thresholds 0: small models would otherwise keep most
  of them whole) and released after use (reuse distance 0); ``stage3_max_live_parameters`` holds a few
  transformer blocks (`TUNED_LIVE_BLOCKS` of the largest), so that the coordinator's prefetch has room to run;
  DeepSpeed's default prefetch bucket; ``overlap_comm`` on. The reduce bucket stays small enough for a small
  model's backward to fill several buckets, so that reductions can overlap the rest of the backward.
* ``deepspeed``: DeepSpeed's defaults, untouched (only ``stage: 3``).
* ``no-overlap``: no prefetch, no live-parameter cache, no overlap: the settings of earlier reports, kept for
  comparison with them. Stock ZeRO-3 can then overlap nothing.

The AsyncHZP arms read the same knobs: DeepSpeed's coordinator still decides what to fetch, release and
prefetch (``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``, reuse distance) and calls AsyncHZP's
gathers; AsyncHZP's own replay of the recorded fetch order (``async_hzp.prefetch_depth``) follows DeepSpeed's
prefetch switch unless set (see ``config.resolve_prefetch_depth``).

On CPU ranks stock ZeRO-3's overlap is a no-op (it runs on CUDA streams, which the CPU accelerator does not
have), while AsyncHZP's runs on threads: part of any CPU speed-up comes from the testbed, which the report says.
"""

from __future__ import annotations

from torch import nn

PRESETS = ("tuned", "deepspeed", "no-overlap")
DEFAULT_PRESET = "tuned"
TUNED_LIVE_BLOCKS = 3
TUNED_REDUCE_BUCKET = int(5e5)
# DeepSpeed 0.19.8's default stage3_prefetch_bucket_size (runtime/zero/config.py).
DEEPSPEED_PREFETCH_BUCKET = int(5e7)

NO_OVERLAP = {
    "stage": 3,
    "stage3_param_persistence_threshold": 0,
    "stage3_model_persistence_threshold": 0,
    "stage3_max_live_parameters": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 0,
    "reduce_bucket_size": TUNED_REDUCE_BUCKET,
    "overlap_comm": False,
    "contiguous_gradients": True,
}


def largest_block_parameters(model: nn.Module) -> int:
    """Parameters of the largest member of the model's largest ``ModuleList`` (a transformer block); the whole
    model where it has none."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return sum(p.numel() for p in model.parameters())
    blocks = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return max(sum(p.numel() for p in block.parameters()) for block in blocks)


def zero3_knobs(preset: str, block_parameters: int) -> dict:
    """The ``zero_optimization`` section (before the arm's own keys) of a preset; `block_parameters` sizes the
    tuned preset's live-parameter cache."""
    if preset == "no-overlap":
        return dict(NO_OVERLAP)
    if preset == "deepspeed":
        return {"stage": 3}
    if preset == "tuned":
        return {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_model_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_max_live_parameters": TUNED_LIVE_BLOCKS * int(block_parameters),
            "stage3_prefetch_bucket_size": DEEPSPEED_PREFETCH_BUCKET,
            "reduce_bucket_size": TUNED_REDUCE_BUCKET,
            "overlap_comm": True,
            "contiguous_gradients": True,
        }
    raise ValueError(f"unknown ZeRO-3 knob preset {preset!r}; choose from {', '.join(PRESETS)}")
