"""TRL's DPOTrainer with a reference model under DeepSpeed ZeRO-3, as DPO users run it. Nothing is downloaded: a
character-level tokenizer, a tiny random Llama and a preference data set are built here. The Llama is saved once
and both models are loaded with `from_pretrained` after the trainer's arguments exist, as TRL's users load them:
under ZeRO-3, so `deepspeed.zero.Init` partitions them over the world as they are built. TRL then builds the
reference model's engine from a copy of the trainer's ds_config without its optimizer.

    torchrun --nproc_per_node 4 examples/trl_dpo.py --out result.json [--asynchzp]
    asynchzp-ab --arms zero3,asynchzp --steps 6 --config examples/ds_config_trl_dpo.json --out ab -- \
        asynchzp-cluster --nodes 2 --ranks-per-node 2 -- deepspeed --num_gpus 2 examples/trl_dpo.py \
        --deepspeed_config {config} --output_dir ab/{arm}/dpo_out

The script calls `ds_asynchzp.register()`, as a user of HF or TRL would: the ds_config decides what runs (stock
ZeRO-3 without an "async_hzp" section). `--deepspeed_config` reads it from a file; without it the built-in one is
used, with an empty "async_hzp" section under `--asynchzp`. With `--out`, rank 0 writes every micro-step's loss,
unrounded (the Trainer's log rounds to 4 digits), and the engines' types.
"""

from __future__ import annotations

import argparse
import json
import os

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + [chr(c) for c in range(32, 127)])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # one token per character
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>", model_max_length=512)


def build_model(tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, use_cache=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)      # the same weights on every rank; policy and reference start equal
    return LlamaForCausalLM(config)


def build_dataset():
    from datasets import Dataset

    rows = [(i % 10, (i * 3) % 10, i) for i in range(64)]
    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b, _ in rows],
                              "chosen": [f"{a + b}" for a, b, _ in rows],
                              "rejected": [f"{(a + b + 1 + i % 7) % 19}" for a, b, i in rows]})


CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config_trl_dpo.json")


def ds_config(asynchzp: bool, path: str | None = None) -> dict:
    """The ds_config the trainer gets: `path`'s, else this folder's ds_config_trl_dpo.json (HF's "auto" values,
    fp32, every parameter partitioned), with an "async_hzp" section added under `asynchzp` (one reference model)."""
    with open(path or CONFIG) as f:
        config = json.load(f)
    if asynchzp:
        config["async_hzp"] = {"reference_models": 1}   # the DPO reference model, for "auto" and the log
    return config


def common_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The options this example shares with trl_grpo.py, added to `parser`, and the parsed arguments."""
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--asynchzp", action="store_true", help="add an async_hzp section to the built-in ds_config")
    parser.add_argument("--deepspeed_config", default=None, help="a ds_config file instead of the built-in one")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = parser.parse_args()
    if args.deepspeed_config is not None and args.asynchzp:
        parser.error("--asynchzp adds a section to the built-in ds_config; put it in --deepspeed_config's file instead")
    return args


def start_rank() -> None:
    """Communication up, and `ds_asynchzp.register()` called, before the trainer's arguments start Accelerate."""
    # AsyncHZP's node_size defaults to LOCAL_WORLD_SIZE (else LOCAL_SIZE); on CPU ranks Accelerate, which the
    # trainer's arguments start, writes LOCAL_WORLD_SIZE = 1 where the deepspeed launcher set only LOCAL_SIZE, and
    # every rank would count as a node of its own (examples/hf_trainer.py does the same).
    if "LOCAL_SIZE" in os.environ and "LOCAL_WORLD_SIZE" not in os.environ:
        os.environ["LOCAL_WORLD_SIZE"] = os.environ["LOCAL_SIZE"]
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")   # CPU ranks; Accelerate adopts the group
    import ds_asynchzp

    ds_asynchzp.register()


def saved_model(output_dir: str):
    """The tokenizer, and the folder rank 0 saved the tiny Llama into (every rank waits for it)."""
    import torch

    tokenizer = build_tokenizer()
    saved = os.path.join(output_dir, "tiny_llama")
    if torch.distributed.get_rank() == 0:
        build_model(tokenizer).save_pretrained(saved)
    torch.distributed.barrier()
    return tokenizer, saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="rank 0 writes the losses and the engines' types here")
    parser.add_argument("--output_dir", default=None, help="the trainer's output folder (default: next to --out, "
                                                          "else ./dpo_out)")
    args = common_arguments(parser)
    start_rank()
    import torch
    from trl import DPOConfig, DPOTrainer

    losses = []

    class RecordingDPOTrainer(DPOTrainer):
        def compute_loss(self, *a, **kw):
            result = super().compute_loss(*a, **kw)
            loss = result[0] if isinstance(result, tuple) else result
            losses.append(float(loss.detach()))
            return result

    output_dir = args.output_dir or os.path.join(os.path.dirname(os.path.abspath(args.out)) if args.out else ".",
                                                 "dpo_out")
    tokenizer, saved = saved_model(output_dir)
    config = DPOConfig(output_dir=output_dir, deepspeed=ds_config(args.asynchzp, args.deepspeed_config),
                       max_steps=args.steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                       learning_rate=1e-3, lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1,
                       save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
                       dataloader_pin_memory=False, bf16=False, fp16=False, seed=0, max_length=48, beta=0.1)
    from transformers import LlamaForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    assert is_deepspeed_zero3_enabled(), "the DPO arguments did not make from_pretrained load under ZeRO-3"
    policy, reference = (LlamaForCausalLM.from_pretrained(saved) for _ in range(2))
    assert all(hasattr(p, "ds_id") for p in reference.parameters()), "zero.Init did not partition the reference"
    trainer = RecordingDPOTrainer(model=policy, ref_model=reference, args=config,
                                  train_dataset=build_dataset(), processing_class=tokenizer)
    trainer.train()
    if args.out is not None and torch.distributed.get_rank() == 0:
        reference = trainer.ref_model
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "steps": trainer.state.global_step,
                       "optimizer": type(trainer.model_wrapped.optimizer).__name__,
                       "reference_optimizer": type(reference.optimizer).__name__,
                       "reference_hpz": reference.zero_hpz_partition_size(),
                       # hpZ's copies inside the node, made when the reference engine was built.
                       "reference_copies": all(getattr(p, "ds_secondary_tensor", None) is not None
                                               for p in reference.module.parameters()),
                       "world": torch.distributed.get_world_size()}, f)


if __name__ == "__main__":
    main()
