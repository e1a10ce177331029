"""Train a tiny random Llama with the Hugging Face Trainer on DeepSpeed ZeRO-3 with AsyncHZP.

The Trainer (through Accelerate) calls plain ``deepspeed.initialize`` itself; ``ds_asynchzp.register()``, called
before the Trainer is built, routes that call through ``ds_asynchzp.initialize`` so that the ``"async_hzp"``
section of the ds_config takes effect. Nothing is downloaded: the model is built from a ``LlamaConfig`` and the
data are the bytes of the text shipped in ``ds_asynchzp/bench/data/corpus.txt`` (vocabulary 256).

Run it under the deepspeed launcher, from the repository root (CPU ranks shown; see examples/README.md):

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 4 examples/hf_trainer.py

It ends with one line on rank 0 (first_loss is step 1's, last_loss the mean of the last --log-every steps), e.g.

    RESULT optimizer=HierarchicalZeroOptimizer engine=AsyncHZPEngine first_loss=5.552496 last_loss=2.882201 ...

``--no-register`` skips ``register()``: the same config then trains stock ZeRO-3 (DeepSpeedZeroOptimizer_Stage3).
"""

import argparse
import math
import os
import tempfile
from pathlib import Path

import torch
from torch.utils.data import Dataset

import ds_asynchzp
from ds_asynchzp.bench.data import VOCAB_SIZE, load_corpus

HERE = Path(__file__).resolve().parent


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by the deepspeed launcher")
    parser.add_argument("--deepspeed_config", default=str(HERE / "ds_config_hf_trainer.json"))
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per micro-step")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-steps per optimizer step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "ds_asynchzp_hf_trainer"),
                        help="the Trainer's output_dir; nothing is saved there (save_strategy='no')")
    parser.add_argument("--no-register", action="store_true",
                        help="do not call ds_asynchzp.register(): stock ZeRO-3 ignores the async_hzp section")
    return parser.parse_args()


class ByteChunks(Dataset):
    """Consecutive, non-overlapping ``seq_len``-byte windows of the corpus; token id = byte value.

    ``labels`` equal ``input_ids``: the model shifts them by one position itself.
    """

    def __init__(self, seq_len: int):
        tokens = load_corpus()  # the corpus file's bytes as a 1-D LongTensor
        n = len(tokens) // seq_len
        self.chunks = tokens[: n * seq_len].view(n, seq_len)

    def __len__(self):
        return len(self.chunks)

    def __getitem__(self, i):
        ids = self.chunks[i]
        return {"input_ids": ids, "labels": ids.clone()}


def build_model(seq_len: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max(seq_len, 128),
                         tie_word_embeddings=False, use_cache=False)
    # Same seed on every rank: every rank starts from the same weights. The model is built before
    # TrainingArguments exists, so transformers does not wrap its construction in deepspeed.zero.Init.
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def main():
    args = parse_args()
    # AsyncHZP's node_size defaults to LOCAL_WORLD_SIZE (else LOCAL_SIZE). The deepspeed launcher sets only
    # LOCAL_SIZE; on CPU ranks Accelerate (which TrainingArguments starts) then writes LOCAL_WORLD_SIZE from its
    # own lookup, which does not read LOCAL_SIZE and falls back to 1: every rank would count as a node of its
    # own. Handing it the launcher's value first keeps node_size right. An exported LOCAL_WORLD_SIZE (to emulate
    # smaller nodes) is left as it is.
    if "LOCAL_SIZE" in os.environ and "LOCAL_WORLD_SIZE" not in os.environ:
        os.environ["LOCAL_WORLD_SIZE"] = os.environ["LOCAL_SIZE"]

    import deepspeed
    from transformers import Trainer, TrainingArguments

    # On CPU, start the process group with gloo ourselves (DeepSpeed's CPU accelerator would ask for ccl);
    # Accelerate then finds it initialised and reuses it.
    if os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available():
        deepspeed.init_distributed(dist_backend="gloo")

    model = build_model(args.seq_len, args.seed)
    dataset = ByteChunks(args.seq_len)

    if not args.no_register:
        ds_asynchzp.register()  # before the Trainer: it makes plain deepspeed.initialize honour "async_hzp"

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=args.deepspeed_config,  # "auto" values in it are filled from the arguments below
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        logging_steps=args.log_every,
        logging_first_step=True,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_drop_last=True,
        dataloader_pin_memory=False,
        seed=args.seed,
        # No use_cpu: without CUDA (DS_ACCELERATOR=cpu) Accelerate and DeepSpeed already keep everything on the
        # CPU, and leaving it unset keeps the script unchanged for GPU ranks. use_cpu=True trains the same on CPU.
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    trainer.train()

    engine = trainer.model_wrapped  # the DeepSpeed engine (trainer.deepspeed is the same object)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if not losses or not all(math.isfinite(x) for x in losses):
        raise SystemExit(f"losses are missing or not finite: {losses}")
    if training_args.process_index == 0:
        print(f"RESULT optimizer={type(engine.optimizer).__name__} engine={type(engine).__name__} "
              f"first_loss={losses[0]:.6f} last_loss={losses[-1]:.6f} logged={len(losses)} "
              f"steps={trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
