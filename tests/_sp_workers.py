"""Rank-side code of tests/test_sequence_parallel.py: a tiny random Llama trained with DeepSpeed's Ulysses sequence
parallelism (ALST: `UlyssesSPAttentionHF`, optionally `TiledMLP`), under stock ZeRO-3 and under AsyncHZP, in the
same processes and on the same data.

ALST's state module can be set up once per process (`initialize_sequence_parallel` asserts it), so every arm of a
launch shares one `sp`. Each SP group trains on one sequence per micro-step, split along the sequence over its
ranks, as `UlyssesSPDataLoaderAdapter` does; the loss is aggregated over the SP group with
`ds_asynchzp.sequence_parallel_loss` (a token-weighted mean, differentiable, through deepspeed.comm).
"""

from __future__ import annotations

import os

import deepspeed
import torch

import ds_asynchzp

VOCAB, SEQ, HIDDEN, LAYERS = 64, 16, 32, 2


def build_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * SEQ,
                         tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def tile_mlps(model, shards: int = 2) -> None:
    """ALST's TiledMLP on every MLP: the backward runs tile by tile and marks the weights `ds_grad_is_ready` only
    at the last tile, so ZeRO-3 reduces each weight's gradient once, summed over the tiles."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp_forward(mlp, x):
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    for layer in model.model.layers:
        mlp = layer.mlp
        params = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        mlp.forward = (lambda x, mlp=mlp, params=params:
                       TiledMLP.apply(mlp_forward, mlp, x, shards, params))


def register_ulysses(model, sp: int):
    """ALST's setup: Ulysses attention registered with transformers; returns its state module, the `mpu`."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    return UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, core_attn_implementation="sdpa",
                                                            sequence_parallel_size=sp, micro_batch_size=1,
                                                            seq_length_is_variable=True)


def shard(step: int, rank: int, sp: int) -> dict:
    """The micro-step's sequence of this rank's SP group, and this rank's slice of it (ids, positions, labels
    shifted on the whole sequence first, as the data-loader adapter does)."""
    group, sp_rank = rank // sp, rank % sp
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1000 * step + group))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    labels[:, (step + group) % 5] = -100          # an ignored token, where it falls differs per sequence
    part = slice(sp_rank * SEQ // sp, (sp_rank + 1) * SEQ // sp)
    return {"input_ids": ids[:, part], "position_ids": torch.arange(SEQ).unsqueeze(0)[:, part],
            "shift_labels": labels[:, part]}


def config(case: dict, arm: str) -> dict:
    zero = {"stage": 3}
    if not case.get("default_knobs"):
        zero.update({"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2000})
    if case.get("reduce_scatter") is False:
        zero["reduce_scatter"] = False
    out = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": case.get("gas", 1),
           "gradient_clipping": case.get("clip", 1.0), "steps_per_print": 10**9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": zero}
    if arm == "hzp":
        out["async_hzp"] = dict(case["section"], log_layout=False)
    if case.get("universal"):
        out["checkpoint"] = {"load_universal": True}
    return out


def train(engine, case: dict, rank: int, sp: int, group, steps: int, micro: int = 0) -> list:
    """`steps` optimizer steps from micro-step `micro` on; the loss of every micro-step. Without SP (`group` None)
    a rank trains on its whole sequence."""
    losses = []
    for _ in range(steps):
        for _ in range(case.get("gas", 1)):
            batch = shard(micro, rank, sp)
            micro += 1
            logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            labels = batch["shift_labels"].view(-1)
            loss_sum = torch.nn.functional.cross_entropy(logits.float().view(-1, VOCAB), labels, ignore_index=-100,
                                                         reduction="sum")
            tokens = (labels != -100).sum()
            loss = (ds_asynchzp.sequence_parallel_loss(loss_sum, tokens, group) if group is not None
                    else loss_sum / tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _plant(case: dict) -> None:
    """Planted faults that the parity comparison must catch. "world_divisor": Stage 3's all-reduce path
    (`reduce_scatter: false`) divides by the world, as its reduce-scatter path does, not by world / sp as stock."""
    if case.get("plant") == "world_divisor":
        from ds_asynchzp.runtime.optimizer import HierarchicalZeroOptimizer

        original = HierarchicalZeroOptimizer._hzp_reduce_bucket
        HierarchicalZeroOptimizer._hzp_reduce_bucket = (
            lambda self, params, dtype, sp_divides=False: original(self, params, dtype, sp_divides=False))


def run_arms(payload: dict) -> dict:
    """Each case under stock and under AsyncHZP; per case and arm the losses of every micro-step. A case with
    `save_dir` saves both arms after `steps` steps and trains `steps_after` more."""
    sp = payload["sp"]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    mpu = register_ulysses(build_model(), sp)
    group = mpu.get_sequence_parallel_group()
    out = {}
    for case in payload["cases"]:
        _plant(case)
        for arm in case.get("arms", ("stock", "hzp")):
            model = build_model()
            if case.get("tiled_mlp"):
                tile_mlps(model)
            engine, *_ = ds_asynchzp.initialize(model=model, model_parameters=model.parameters(),
                                                config=config(case, arm), mpu=mpu)
            steps = case.get("steps", 3)
            result = {"losses": train(engine, case, rank, sp, group, steps),
                      "optimizer": type(engine.optimizer).__name__}
            if case.get("save_dir"):
                engine.save_checkpoint(os.path.join(case["save_dir"], arm), tag="saved")
                result["losses_after"] = train(engine, case, rank, sp, group, case["steps_after"],
                                               micro=steps * case.get("gas", 1))
            out[f"{case['name']}/{arm}"] = result
            engine.destroy()
    return out


def resume_run(payload: dict) -> dict:
    """Load a universal checkpoint without sequence parallelism (each rank trains on a whole sequence: rank r on
    what SP group r trained on) and train on; the losses of every micro-step."""
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    out = {}
    for case in payload["cases"]:
        model = build_model(seed=1)      # other weights: the load must replace them all
        engine, *_ = ds_asynchzp.initialize(model=model, model_parameters=model.parameters(),
                                            config=config(dict(case, universal=True), case["arm"]))
        engine.load_checkpoint(case["load_dir"], tag="saved_universal")
        out[case["name"]] = {"losses": train(engine, case, rank, 1, None, case["steps_after"],
                                             micro=case["first_micro"]),
                             "optimizer": type(engine.optimizer).__name__}
        engine.destroy()
    return out
