"""Long-context fine-tuning with DeepSpeed's Ulysses sequence parallelism (ALST) and AsyncHZP, through the DeepSpeed
API directly.

Each sequence is split along its length over the `--sp` ranks of a sequence-parallel group (consecutive ranks:
inside one node when sp divides the node size); attention sees it whole through Ulysses' all-to-alls, and
AsyncHZP shards the model states over the whole world, as stock ZeRO-3 under ALST does. The steps, as ALST's
recipe takes them:

1. `UlyssesSPAttentionHF.register_with_transformers` (after the model is built, before `initialize`) returns the
   sequence-parallel state, which goes to `initialize` as `mpu`;
2. `UlyssesSPDataLoaderAdapter` hands each rank its slice of the group's sequences (with `position_ids` and
   `shift_labels`);
3. the loss of each slice is summed, and `ds_asynchzp.sequence_parallel_loss` takes the token-weighted mean over
   the group (its collectives go through `deepspeed.comm`, in AsyncHZP's one issue order);
4. optionally (`--tiled-mlp N`) ALST's TiledMLP computes each MLP in N tiles of the sequence.

By default the model is a small random Llama on the shipped byte-level text (nothing is downloaded); `--model-name`
loads a Hugging Face model instead (its tokenizer is not used: the text is fed as bytes, so use it for a smoke test).

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 4 examples/long_context_sp.py \\
        --deepspeed_config examples/ds_config_sp.json --sp 2
"""

import argparse
import math
import os

import deepspeed
import torch
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP, UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

import ds_asynchzp
from ds_asynchzp.bench.data import load_corpus


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--sp", type=int, default=2, help="sequence-parallel degree (ranks per sequence)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence, a multiple of --sp")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--tiled-mlp", type=int, default=0, metavar="N",
                        help="compute every MLP in N tiles along the sequence (ALST's TiledMLP); 0: off")
    parser.add_argument("--model-name", help="a Hugging Face model to load instead of the small random Llama")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def build_model(name):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if name:
        return AutoModelForCausalLM.from_pretrained(name, attn_implementation="sdpa")
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)      # the same weights on every rank
    return LlamaForCausalLM(config)


def tile_mlps(model, shards: int) -> None:
    """TiledMLP's backward marks the weights `ds_grad_is_ready` only at the last tile: ZeRO-3 reduces each once."""
    def mlp_forward(mlp, x):
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    for layer in model.model.layers:
        mlp = layer.mlp
        weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        mlp.forward = lambda x, mlp=mlp, weights=weights: TiledMLP.apply(mlp_forward, mlp, x, shards, weights)


class ByteWindows(torch.utils.data.Dataset):
    """Windows of the shipped text as bytes, with the keys Ulysses' data-loader adapter expects."""

    def __init__(self, seq_len: int):
        self.tokens, self.seq_len = load_corpus(), seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i):
        window = self.tokens[i * self.seq_len:(i + 1) * self.seq_len]
        return {"input_ids": window, "labels": window.clone(), "position_ids": torch.arange(self.seq_len)}


def main():
    args = parse_args()
    on_cpu = os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else None)
    model = build_model(args.model_name)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, core_attn_implementation="sdpa",
                                                          sequence_parallel_size=args.sp, micro_batch_size=1,
                                                          seq_length_is_variable=True)
    if args.tiled_mlp:
        tile_mlps(model, args.tiled_mlp)
    engine, *_ = ds_asynchzp.initialize(args=args, model=model, model_parameters=model.parameters(), mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    rank, world = engine.global_rank, engine.world_size

    # Every rank reads its own sequences (a distributed sampler over the world); the adapter then gives each rank of
    # an SP group its slice of the group's sequences in turn.
    data = ByteWindows(args.seq_len)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=torch.distributed.get_world_size(), rank=rank,
                                                  shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler)
    loader = UlyssesSPDataLoaderAdapter(loader, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=group,
                                        sp_world_size=args.sp, device=engine.device)
    batches = iter(loader)
    losses = []
    for step in range(args.steps):
        total = torch.zeros(1, dtype=torch.float64, device=engine.device)
        for _ in range(engine.gradient_accumulation_steps()):
            batch = next(batches)
            labels = batch["shift_labels"].to(engine.device)
            logits = engine(input_ids=batch["input_ids"].to(engine.device),
                            position_ids=batch["position_ids"].to(engine.device)).logits
            loss_sum = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                                         ignore_index=-100, reduction="sum")
            loss = ds_asynchzp.sequence_parallel_loss(loss_sum, (labels != -100).sum(), group)
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()
        # The mean over the data-parallel replicas (every rank of an SP group holds its sequence's loss), through
        # deepspeed.comm, so in the one issue order.
        deepspeed.comm.all_reduce(total)
        losses.append(total.item() / (world * engine.gradient_accumulation_steps()))
        if rank == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    if rank == 0:
        print(f"final_loss={losses[-1]:.6f} optimizer={type(engine.optimizer).__name__} first_loss={losses[0]:.6f}",
              flush=True)
    engine.destroy()
    torch.distributed.destroy_process_group()
    if not math.isfinite(losses[-1]):
        raise SystemExit(f"loss is not finite: {losses[-1]}")


if __name__ == "__main__":
    main()
