"""TRL's GRPOTrainer with a reference model (``beta`` > 0) under DeepSpeed ZeRO-3, generating with the policy itself
(no vLLM server), as a training script. The tokenizer, the tiny random Llama and the ds_config are
`trl_dpo.py`'s; the prompts are sums, the reward counts the digits of a completion. TRL loads the reference model
with `from_pretrained` under ZeRO-3 (so `deepspeed.zero.Init` partitions it over the world as it is built) and
builds its engine from a copy of the trainer's ds_config without its optimizer.

    torchrun --nproc_per_node 4 examples/trl_grpo.py [--asynchzp]
    asynchzp-ab --arms zero3,asynchzp --steps 6 --config examples/ds_config_trl_dpo.json --out ab -- \\
        asynchzp-cluster --nodes 2 --ranks-per-node 2 -- deepspeed --num_gpus 2 examples/trl_grpo.py \\
        --deepspeed_config {config} --output_dir ab/{arm}/grpo_out

Like `trl_dpo.py` it calls `ds_asynchzp.register()`, so the ds_config decides what runs.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_dpo import common_arguments, ds_config, saved_model, start_rank  # noqa: E402  (the sibling example)


def digits(completions, **_) -> list:
    """The reward: how many digits a completion holds."""
    return [float(sum(c.isdigit() for c in text)) for text in completions]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="grpo_out", help="the trainer's output folder (default: %(default)s)")
    args = common_arguments(parser)
    start_rank()
    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    tokenizer, saved = saved_model(args.output_dir)
    config = GRPOConfig(output_dir=args.output_dir, deepspeed=ds_config(args.asynchzp, args.deepspeed_config),
                        max_steps=args.steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        num_generations=4, max_completion_length=8, beta=0.1, learning_rate=1e-3,
                        lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                        report_to="none", disable_tqdm=True, dataloader_pin_memory=False, bf16=False, fp16=False,
                        seed=0)
    prompts = Dataset.from_dict({"prompt": [f"{i % 10}+{(i * 3) % 10}=" for i in range(64)]})
    trainer = GRPOTrainer(model=LlamaForCausalLM.from_pretrained(saved), reward_funcs=digits, args=config,
                          train_dataset=prompts, processing_class=tokenizer)
    trainer.train()
    if torch.distributed.get_rank() == 0:
        reference = trainer.ref_model
        print(f"RESULT optimizer={type(trainer.model_wrapped.optimizer).__name__} "
              f"reference={type(reference.optimizer).__name__ if reference is not None else None}", flush=True)


if __name__ == "__main__":
    main()
