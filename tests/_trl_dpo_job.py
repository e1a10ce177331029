"""TRL's DPOTrainer with a reference model under DeepSpeed ZeRO-3, as a training script (tests/test_trl_dpo.py runs
it on CPU ranks). Nothing is downloaded: a character-level tokenizer, a tiny random Llama and a preference data
set are built here. The Llama is saved once and both models are loaded with `from_pretrained` after the trainer's
arguments exist, as TRL's users load them: under ZeRO-3, so `deepspeed.zero.Init` partitions them over the world
as they are built.

    torchrun ... tests/_trl_dpo_job.py --out losses.json [--asynchzp]

`--asynchzp` adds an "async_hzp" section to the ds_config and calls `ds_asynchzp.register()`, as a user of HF or
TRL would; TRL then builds the reference model's engine from a copy of that config without its optimizer. Rank 0
writes every micro-step's loss, unrounded (the Trainer's log rounds to 4 digits), and the engines' types.
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


def ds_config(asynchzp: bool) -> dict:
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                         "weight_decay": "auto", "torch_adam": True}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "bf16": {"enabled": False}, "fp16": {"enabled": False}}
    if asynchzp:
        config["async_hzp"] = {}
    return config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--asynchzp", action="store_true")
    args = parser.parse_args()

    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")   # CPU ranks; Accelerate adopts the group
    from trl import DPOConfig, DPOTrainer

    if args.asynchzp:
        import ds_asynchzp
        ds_asynchzp.register()

    losses = []

    class RecordingDPOTrainer(DPOTrainer):
        def compute_loss(self, *a, **kw):
            result = super().compute_loss(*a, **kw)
            loss = result[0] if isinstance(result, tuple) else result
            losses.append(float(loss.detach()))
            return result

    tokenizer = build_tokenizer()
    saved = os.path.join(os.path.dirname(args.out), "tiny_llama")
    if torch.distributed.get_rank() == 0:
        build_model(tokenizer).save_pretrained(saved)
    torch.distributed.barrier()
    output_dir = os.path.join(os.path.dirname(args.out), "dpo_out")
    config = DPOConfig(output_dir=output_dir, deepspeed=ds_config(args.asynchzp),
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
    if torch.distributed.get_rank() == 0:
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
