"""A small byte-level GPT used by the benchmark and the tests.

Besides an ordinary pre-LayerNorm transformer, the model deliberately holds
parameters that are awkward for ZeRO-3 style partitioning, so every training
arm is exercised on them (tests check that each is present):

* a token embedding TIED to the output head (one Parameter used twice),
* a FROZEN parameter (requires_grad=False) that is still used in forward,
* a parameter whose element count is PRIME, so it can never be split evenly
  across ranks and always needs padding,
* an UNUSED trainable parameter that never receives a gradient,
* optionally, Mixture-of-Experts MLPs made of ordinary parameters.

Construction draws only from torch's global RNG, so ``torch.manual_seed``
(or ``build_model(..., seed=...)``) makes the weights reproducible.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    seq_len: int = 64
    # 0 = dense MLP; > 0 = that many routed experts per block.
    moe_experts: int = 0
    # Experts chosen per token when moe_experts > 0 (1 or 2).
    moe_top_k: int = 1

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} not divisible by n_head={self.n_head}")
        if self.moe_experts and not 1 <= self.moe_top_k <= min(2, self.moe_experts):
            raise ValueError(f"moe_top_k must be 1 or 2 and <= moe_experts, got {self.moe_top_k}")


MODEL_PRESETS: dict[str, GPTConfig] = {
    # Unit tests and quick smoke runs.
    "tiny": GPTConfig(n_layer=3, n_head=4, d_model=64, seq_len=64),
    # Default of the benchmark: big enough to have many partitioned tensors,
    # small enough for several CPU ranks on a laptop.
    "small": GPTConfig(n_layer=4, n_head=5, d_model=160, seq_len=128),
    # For runs where communication volume should matter more than overhead.
    "medium": GPTConfig(n_layer=8, n_head=6, d_model=384, seq_len=256),
    # Host overhead per parameter (HOST_OVERHEAD_PRESET): ~400 tiny tensors, so a step's time is the per-parameter
    # Python work of fetching, releasing and reducing each one, not arithmetic or bytes.
    "many-small": GPTConfig(n_layer=32, n_head=2, d_model=16, seq_len=64),
}

# The preset whose step time measures host overhead per parameter; the bench's table shows that figure for it.
HOST_OVERHEAD_PRESET = "many-small"


def _largest_prime_at_most(n: int, step: int = 1) -> int:
    for candidate in range(n, 1, -step):
        if all(candidate % d for d in range(2, math.isqrt(candidate) + 1)):
            return candidate
    raise ValueError(f"no prime <= {n}")


def _prime_logit_bias_size(n: int) -> int:
    """The largest prime p <= n that is one less than a multiple of 64 (191 for bytes), else the largest prime.

    Prime, so no world size > 1 divides it; p + 1 a multiple of 64, so its shard at 2, 4 or 8 ranks is
    (p + 1) / W elements, a multiple of 8, which stock ZeRO++'s weight quantizer needs of every gather (its
    ``CUDAQuantizer.quantize`` asserts it)."""
    try:
        return _largest_prime_at_most(n - (n + 1) % 64, step=64)
    except ValueError:
        return _largest_prime_at_most(n)


def _sinusoidal_positions(seq_len: int, d_model: int) -> torch.Tensor:
    # Fixed (not learned) values, so the frozen parameter is meaningful and
    # independent of the RNG.  Scaled to the 0.02 std of the learned
    # embeddings: at unit scale the table would drown the token signal and
    # training would stall near the unigram loss.
    pos = torch.arange(seq_len, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2).float() / d_model)
    table = torch.zeros(seq_len, d_model)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
    return 0.02 * table


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        # (b, t, d) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class MoEMLP(nn.Module):
    """Top-k routed experts, computed densely with plain torch.

    Every expert runs on every token and the outputs are mixed with sparse
    gates.  That wastes FLOPs but needs no all-to-all (so it runs on CPU
    without deepspeed.moe) and gives every expert parameter a gradient each
    step (zeros where not routed), keeping the expert weights ordinary
    parameters from the partitioner's point of view.  Routing is a plain
    argmax/topk of router logits, hence deterministic.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.top_k = cfg.moe_top_k
        self.router = nn.Linear(cfg.d_model, cfg.moe_experts, bias=False)
        # Each expert is narrower than the dense MLP (2x instead of 4x) so the
        # MoE variant stays comparable in size for small expert counts.
        self.experts = nn.ModuleList(MLP(cfg.d_model, 2 * cfg.d_model) for _ in range(cfg.moe_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.router(x), dim=-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(-1, top_i, top_p)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + gates[..., e : e + 1] * expert(x)
        return out


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MoEMLP(cfg) if cfg.moe_experts > 0 else MLP(cfg.d_model, 4 * cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        # FROZEN but used: a fixed sinusoidal position table added next to the
        # learned one.  It is a Parameter (not a buffer) on purpose, so the
        # partitioner must handle a partitioned tensor that needs gathering
        # for forward yet never gets a gradient or optimizer state.
        self.frozen_pos = nn.Parameter(_sinusoidal_positions(cfg.seq_len, cfg.d_model), requires_grad=False)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # TIED: the output head reuses the token embedding Parameter, so one
        # partitioned tensor is gathered twice per forward and its gradient
        # accumulates from two uses.
        self.lm_head.weight = self.wte.weight
        # PRIME-sized: a bias on the first p logits, p a prime <= vocab_size
        # (191 for bytes, see _prime_logit_bias_size).  Its numel is divisible
        # by no world size > 1, so sharding it always needs padding (yet its
        # shards stay multiples of 8, as stock ZeRO++'s quantizer requires).
        self.prime_logit_bias = nn.Parameter(torch.zeros(_prime_logit_bias_size(cfg.vocab_size)))
        # UNUSED: trainable but never touched in forward, so its grad stays
        # None; gradient reduction must not wait for it or crash on it.
        self.unused = nn.Parameter(torch.zeros(cfg.d_model))

        self.apply(self._init_weights)
        # GPT-2 style: shrink residual-branch outputs with depth so the
        # residual stream does not grow with the layer count.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy if ``targets`` is given, else logits."""
        _, t = idx.shape
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds model seq_len {self.config.seq_len}")
        x = self.wte(idx) + self.wpe.weight[:t] + self.frozen_pos[:t]
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        p = self.prime_logit_bias.numel()
        logits = torch.cat([logits[..., :p] + self.prime_logit_bias, logits[..., p:]], dim=-1)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def build_model(name_or_config: str | GPTConfig, seed: int | None = None) -> GPT:
    """Build a GPT from a preset name or a config.

    With ``seed`` the weights are drawn from that seed without disturbing the
    caller's global RNG; without it they come from the current global RNG.
    """
    if isinstance(name_or_config, str):
        try:
            cfg = MODEL_PRESETS[name_or_config]
        except KeyError:
            raise ValueError(f"unknown model preset {name_or_config!r}; choose from {sorted(MODEL_PRESETS)}") from None
    else:
        cfg = name_or_config
    if seed is None:
        return GPT(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg)


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Unique parameter counts (a tied tensor counts once; frozen and unused
    parameters are included in ``total``)."""
    params = list(model.parameters())  # parameters() already de-duplicates tied tensors
    return {
        "total": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        # Parameter tensors: what the per-parameter host overhead is divided by.
        "tensors": len(params),
    }
