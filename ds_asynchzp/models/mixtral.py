"""The benchmark's mixture-of-experts model: a small random `transformers` Mixtral, built locally.

DeepSpeed's AutoEP (`"expert_parallel": {"enabled": true, "preset_model": "mixtral"}`) recognises Mixtral's
`model.layers.N.mlp` blocks and replaces each by an expert-parallel layer holding this rank's experts; so the
model is the `transformers` class itself (a subclass keeps its module names and `config.model_type`), built from
a config with random weights: nothing is downloaded. Its `forward(idx, targets)` is the byte-level GPT's
(`gpt.py`): the mean next-token cross-entropy, so the benchmark and the tests train both alike.

`transformers` is imported on first use only (the dense benchmark does not need it); the tests pin the release
whose output-recorder registry DeepSpeed 0.19.8's AutoEP understands.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# name -> MixtralConfig keywords (vocabulary: bytes, as the shipped text is read).
MOE_PRESETS = {
    # 4 experts of which each token uses 2, in every layer: small enough for 8 CPU ranks.
    "moe": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                router_aux_loss_coef=0.0, output_router_logits=False),
}
# What AutoEP needs in the ds_config for these models (the benchmark adds autoep_size).
AUTOEP_PRESET = "mixtral"


@functools.lru_cache(maxsize=None)
def _model_class():
    from transformers import MixtralForCausalLM

    class BenchMixtral(MixtralForCausalLM):
        """Mixtral with the benchmark's calling convention."""

        def forward(self, idx, targets=None, **kwargs):
            if kwargs or not torch.is_tensor(idx):
                return super().forward(idx, **kwargs)
            logits = super().forward(input_ids=idx).logits
            if targets is None:
                return logits
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

    return BenchMixtral


def build_moe_model(name: str = "moe", seq_len: int = 64, seed: int | None = None):
    """A random Mixtral of preset `name`, positions up to `seq_len`; seeded like `gpt.build_model`."""
    from transformers import MixtralConfig

    try:
        keywords = MOE_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown MoE preset {name!r}; choose from {sorted(MOE_PRESETS)}") from None
    config = MixtralConfig(max_position_embeddings=max(seq_len, 64), **keywords)
    if seed is None:
        return _model_class()(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _model_class()(config)


def autoep_config(autoep_size: int) -> dict:
    """The ds_config's `expert_parallel` section for these models."""
    return {"enabled": True, "autoep_size": autoep_size, "preset_model": AUTOEP_PRESET}
