"""Random small models, layouts and ZeRO-3 knobs for the differential fuzzer (tests/test_fuzz_parity.py).

A case is a JSON spec drawn from one integer seed (`case_spec(seed)`), so a failing case is reproduced from its
seed alone, or from the printed spec. The model is built from a vocabulary of structures that touch every way a
parameter can be used, shared, skipped or frozen:

* `mlp`           two Linears with a tanh between (a residual block), sizes often prime;
* `branch`        an mlp run only on some forwards: by step parity, by step modulo 3, by micro-step parity, or never;
* `twice`         one Linear applied twice in one forward;
* `shared`        a Linear whose weight is the same Parameter as the first `twice`/`mlp` square weight;
* `frozen`        an mlp built with requires_grad=False (optionally kept in bf16 inside an fp32 model);
* `toggle`        an mlp whose requires_grad the training loop switches off on odd steps;
* `scalar`        a 1-element gain;
* `prime_bias`    a bias of prime length, longer than the width, of which only the first `dim` values are used;
* `buffer`        a registered (non-parameter) buffer used in forward;
* `checkpointed`  an mlp under activation checkpointing (torch.utils.checkpoint, reentrant or not);
* `ulysses`       causal attention under DeepSpeed's Ulysses sequence parallelism (`DistributedAttention`: the
                  sequence split over the SP group, all-to-alls to a split of the heads and back), added to the
                  cases drawn with `sp` 2 only: their ranks train in SP groups of 2 consecutive ranks, each on its
                  slice of the group's sequence, with ALST's mpu and loss aggregation.

Not drawn at random: `rank_gate`, a gain that a module running on every rank uses on rank 0 only, so that its
gradient is None on the other ranks. Stock ZeRO-3 aborts on it (its reduce-scatter sizes differ across ranks);
AsyncHZP must raise `GradientMismatchError` naming it (tests/test_fuzz_parity.py). A *module* run on some ranks
only is outside ZeRO-3 altogether: its parameter fetch is a collective that the other ranks never join (stock
ZeRO-3 aborts there too).

The embedding is optionally tied to the output head. Training-loop events: a parameter read outside forward
through `GatheredParameters` (and optionally edited on rank 0), and the `toggle` switch.
"""

from __future__ import annotations

import random

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41]
BRANCH_RULES = ("step_even", "step_odd", "step_mod3", "micro_even", "micro_odd", "never")
BLOCK_KINDS = ("mlp", "branch", "twice", "shared", "frozen", "toggle", "scalar", "prime_bias", "buffer",
               "checkpointed")

# DeepSpeed's own defaults (nothing set) and the bench's forced regather (nothing stays gathered between passes).
FORCED_KNOBS = {"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
                "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0, "overlap_comm": False}
KNOB_CHOICES = {
    "stage3_param_persistence_threshold": (0, 16, 100000),
    "stage3_prefetch_bucket_size": (0, 50000000),
    "stage3_max_live_parameters": (0, 1000000000),
    "stage3_max_reuse_distance": (0, 1000000000),
    "overlap_comm": (True, False),
    "contiguous_gradients": (True, False),
    "reduce_scatter": (True, False),
    "reduce_bucket_size": (64, 500, 500000000),
}


def valid_layouts(world: int, node: int) -> list:
    """Every (d_p, d_g, d_o) the config accepts for this world and node size (the package's own list)."""
    from ds_asynchzp.formulas.sizing import valid_layouts as accepted
    return accepted(world, node)


def model_spec(rng: random.Random) -> dict:
    dim = rng.choice([8, 11, 12, 16])
    n_blocks = rng.randint(2, 6)
    kinds = [rng.choice(BLOCK_KINDS) for _ in range(n_blocks)]
    if not any(k in ("branch", "toggle") for k in kinds):
        # Most cases carry a parameter that misses its gradient in some windows: the behaviour under test.
        kinds[rng.randrange(n_blocks)] = "branch"
    blocks = []
    for kind in kinds:
        block = {"kind": kind, "hidden": rng.choice(PRIMES[3:] + [dim, 2 * dim]), "bias": rng.random() < 0.7}
        if kind == "branch":
            block["when"] = rng.choice(BRANCH_RULES)
        if kind == "frozen":
            block["bf16"] = rng.random() < 0.5
        if kind == "prime_bias":
            block["length"] = rng.choice([p for p in PRIMES + [43, 47, 53] if p >= dim])
        if kind == "checkpointed":
            block["reentrant"] = rng.random() < 0.5
        blocks.append(block)
    return {"vocab": rng.choice([16, 23, 32]), "dim": dim, "tied": rng.random() < 0.5, "blocks": blocks,
            "seq_len": rng.choice([4, 8]), "micro_batch": rng.choice([1, 2])}


def case_spec(seed: int, worlds=((4, 2), (4, 4), (8, 4), (8, 2)), sequence_parallel: bool = True) -> dict:
    """Everything one fuzz case trains: model, layout, knobs, accumulation, clipping, events, steps; with
    `sequence_parallel` False, never Ulysses SP (the case is the same as drawn, without the SP draw)."""
    rng = random.Random(seed)
    world, node = worlds[rng.randrange(len(worlds))]
    d_p, d_g, d_o = rng.choice(valid_layouts(world, node))
    if rng.random() < 0.35:
        knobs, knob_name = {}, "defaults"
    elif rng.random() < 0.5:
        knobs, knob_name = dict(FORCED_KNOBS), "forced"
    else:
        knobs = {k: rng.choice(v) for k, v in KNOB_CHOICES.items() if rng.random() < 0.6}
        knob_name = "random"
    spec = {
        "seed": seed, "world": world, "node_size": node,
        "layout": {"param_shard_size": d_p, "grad_shard_size": d_g, "optimizer_shard_size": d_o},
        "knob_name": knob_name, "zero": knobs,
        "gas": rng.randint(1, 4), "clip": rng.choice([0.0, 1.0]), "steps": rng.randint(4, 6),
        "async_comm": rng.random() < 0.6,
        "model": model_spec(rng),
        "gathered_read_at": rng.choice([None, 1, 2]),
        "modify_at": rng.choice([None, None, 2]),
        "lr": rng.choice([1e-2, 3e-3]), "weight_decay": rng.choice([0.0, 0.01]),
    }
    # Drawn last, so the fields above stay what they were for every seed.
    spec["offload"] = rng.random() < 0.3
    if rng.random() < 0.25 and sequence_parallel:
        with_sequence_parallelism(spec, rng.randrange(len(spec["model"]["blocks"]) + 1))
    # Under offload, the host step in pieces (the default) or whole; drawn after everything else.
    spec["offload_pipeline"] = rng.random() < 0.7
    return spec


def with_sequence_parallelism(spec: dict, position: int, sp: int = 2) -> dict:
    """The case trained with Ulysses SP of degree `sp`, an attention block at `position` (in place; returned)."""
    spec["sp"] = sp
    spec["model"]["blocks"].insert(position, {"kind": "ulysses", "hidden": 4, "bias": False})
    return spec


def describe(spec: dict) -> str:
    layout = spec["layout"]
    kinds = ",".join(b["kind"] + (f"[{b['when']}]" if "when" in b else "") for b in spec["model"]["blocks"])
    return (f"seed {spec['seed']}: {spec['world']} ranks in nodes of {spec['node_size']}, d_p={layout['param_shard_size']} "
            f"d_g={layout['grad_shard_size']} d_o={layout['optimizer_shard_size']}, {spec['knob_name']} knobs "
            f"{spec['zero']}, gas {spec['gas']}, clip {spec['clip']}, async {spec['async_comm']}, "
            f"tied {spec['model']['tied']}, offload {bool(spec.get('offload'))}"
            f"{'' if spec.get('offload_pipeline', True) else ' (host step whole)'}, sp {spec.get('sp', 1)}, "
            f"blocks {kinds}")


# ------------------------------------------------------------------------------------------------ the model
def _runs(when: str, step: int, micro: int, rank: int) -> bool:
    return {"step_even": step % 2 == 0, "step_odd": step % 2 == 1, "step_mod3": step % 3 == 0,
            "micro_even": micro % 2 == 0, "micro_odd": micro % 2 == 1, "never": False}[when]


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, h):
        return h + 0.5 * self.down(torch.tanh(self.up(h)))


class _Block(nn.Module):
    def __init__(self, spec: dict, dim: int, first_square):
        super().__init__()
        self.kind, self.spec = spec["kind"], spec
        kind = self.kind
        if kind in ("mlp", "branch", "toggle", "checkpointed", "frozen"):
            self.mlp = _MLP(dim, spec["hidden"], spec["bias"])
            if kind == "frozen":
                self.mlp.requires_grad_(False)
                if spec.get("bf16"):
                    self.mlp.to(torch.bfloat16)
        elif kind == "twice":
            self.square = nn.Linear(dim, dim, bias=spec["bias"])
        elif kind == "shared":
            self.square = nn.Linear(dim, dim, bias=False)
            if first_square is not None:
                self.square.weight = first_square.weight
        elif kind in ("scalar", "rank_gate"):
            self.gain = nn.Parameter(torch.full((1,), 0.1))
            if kind == "rank_gate":
                self.square = nn.Linear(dim, dim, bias=False)
        elif kind == "prime_bias":
            self.bias = nn.Parameter(0.02 * torch.randn(spec["length"]))
        elif kind == "buffer":
            self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
            self.square = nn.Linear(dim, dim, bias=False)
        elif kind == "ulysses":
            # Two heads of `hidden` values: one per rank of an SP group of 2 after the all-to-all.
            self.qkv = nn.Linear(dim, 3 * ULYSSES_HEADS * spec["hidden"], bias=spec["bias"])
            self.out = nn.Linear(ULYSSES_HEADS * spec["hidden"], dim, bias=spec["bias"])
            self.attention = None      # set by FuzzModel.use_sequence_parallel_group

    def forward(self, h, step: int, micro: int, rank: int):
        kind = self.kind
        if kind == "branch":
            return self.mlp(h) if _runs(self.spec["when"], step, micro, rank) else h
        if kind in ("mlp", "toggle"):
            return self.mlp(h)
        if kind == "frozen":
            return self.mlp(h.to(self.mlp.up.weight.dtype)).to(h.dtype)
        if kind == "checkpointed":
            return torch.utils.checkpoint.checkpoint(self.mlp, h, use_reentrant=self.spec["reentrant"])
        if kind == "twice":
            return h + 0.5 * torch.tanh(self.square(torch.tanh(self.square(h))))
        if kind == "shared":
            return h + 0.5 * torch.tanh(self.square(h))
        if kind == "scalar":
            return h * (1.0 + self.gain)
        if kind == "rank_gate":
            h = h + 0.5 * torch.tanh(self.square(h))
            return h * (1.0 + self.gain) if rank == 0 else h
        if kind == "prime_bias":
            return h + self.bias[:h.shape[-1]]
        if kind == "buffer":
            return h + 0.5 * torch.tanh(self.square(h) * self.scale)
        if kind == "ulysses":
            q, k, v = self.qkv(h).unflatten(-1, (3, ULYSSES_HEADS, self.spec["hidden"])).unbind(2)
            context = self.attention(q, k, v, 0) if self.attention is not None else _causal_attention(q, k, v)
            return h + 0.5 * self.out(context.flatten(-2))
        raise ValueError(kind)


ULYSSES_HEADS = 2


def _causal_attention(q, k, v):
    """[batch, seq, heads, dim] in and out."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


class FuzzModel(nn.Module):
    """forward(x, y, step, micro, rank) -> loss; the branch rules read the three integers."""

    def __init__(self, spec: dict):
        super().__init__()
        dim = spec["dim"]
        self.embed = nn.Embedding(spec["vocab"], dim)
        self.blocks = nn.ModuleList()
        first_square = None
        for block_spec in spec["blocks"]:
            block = _Block(block_spec, dim, first_square)
            if first_square is None and block_spec["kind"] == "twice":
                first_square = block.square
            self.blocks.append(block)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, spec["vocab"], bias=False)
        if spec["tied"]:
            self.head.weight = self.embed.weight

    def forward(self, x, y, step: int = 0, micro: int = 0, rank: int = 0):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, step, micro, rank)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    def use_sequence_parallel_group(self, group) -> None:
        """Ulysses blocks attend over the whole sequence, split over `group` (DeepSpeed's DistributedAttention)."""
        from deepspeed.sequence.layer import DistributedAttention

        for block in self.blocks:
            if block.kind == "ulysses":
                block.attention = DistributedAttention(_causal_attention, group, scatter_idx=2, gather_idx=1)

    def toggled_parameters(self) -> list:
        return [p for b in self.blocks if b.kind == "toggle" for p in b.parameters()]

    def branch_parameters(self) -> list:
        return [p for b in self.blocks if b.kind == "branch" for p in b.parameters()]


def build(spec: dict, seed: int) -> FuzzModel:
    torch.manual_seed(seed)
    return FuzzModel(spec)


def batch(spec: dict, step: int, micro: int, rank: int, seed: int):
    """Random tokens, a pure function of the arguments (every rank sees its own)."""
    g = torch.Generator().manual_seed(hash((seed, step, micro, rank)) & 0x7FFFFFFF)
    x = torch.randint(0, spec["vocab"], (spec["micro_batch"], spec["seq_len"]), generator=g)
    y = torch.randint(0, spec["vocab"], (spec["micro_batch"], spec["seq_len"]), generator=g)
    return x, y
