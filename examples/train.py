"""Train the small benchmark GPT (or, with --model moe, a small Mixtral whose experts DeepSpeed's AutoEP spreads
over ranks) with DeepSpeed, optionally with AsyncHZP.

Run it under the deepspeed launcher (see README.md). The ds_config decides everything:
with an "async_hzp" section the engine uses hierarchical ZeRO, without one it is stock DeepSpeed; the MoE model
needs an "expert_parallel" section (examples/ds_config_moe.json).
"""

import argparse
import math
import os

import deepspeed
import torch

import ds_asynchzp
from ds_asynchzp.bench.data import batch_for
from ds_asynchzp.bench.model import MODEL_PRESETS, build_model
from ds_asynchzp.bench.moe_model import MOE_PRESETS, build_moe_model

SEQ_LEN = 64  # tokens per sample of the MoE model


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_PRESETS) + sorted(MOE_PRESETS),
                        help="a byte-level GPT preset, or moe (a transformers Mixtral, for AutoEP)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--print-losses", action="store_true",
                        help="end with every step's loss (rank 0, last micro-step) at full precision, "
                             "to compare two runs bit for bit")
    parser.add_argument("--via-register", action="store_true",
                        help="call ds_asynchzp.register() and then plain deepspeed.initialize, "
                             "the way HF Trainer or Accelerate would reach it")
    parser = deepspeed.add_config_arguments(parser)  # adds --deepspeed_config
    return parser.parse_args()


def main():
    args = parse_args()
    # DeepSpeed's CPU accelerator would pick ccl, which is rarely installed; gloo always works.
    on_cpu = os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else None)

    # Same seed on every rank: all ranks must start from identical weights.
    if args.model in MOE_PRESETS:
        model = build_moe_model(args.model, SEQ_LEN, seed=args.seed)
    else:
        model = build_model(args.model, seed=args.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    if args.via_register:
        ds_asynchzp.register()
        engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=params)
    else:
        engine, *_ = ds_asynchzp.initialize(args=args, model=model, model_parameters=params)

    rank, world = engine.global_rank, engine.world_size
    micro_batch = engine.train_micro_batch_size_per_gpu()
    accumulation = engine.gradient_accumulation_steps()
    seq_len = getattr(model.config, "seq_len", SEQ_LEN)  # the GPT presets fix theirs; the Mixtral takes 64
    loss = first = None
    losses = []
    for step in range(args.steps):
        for micro in range(accumulation):
            inputs, targets = batch_for(step, micro, rank, world, micro_batch, seq_len, args.seed)
            loss = engine(inputs.to(engine.device), targets.to(engine.device))
            engine.backward(loss)
            engine.step()  # applies the optimizer only at the accumulation boundary
        first = loss.item() if first is None else first
        losses.append(loss.item())
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)

    # Average over ranks so every rank agrees on the number that is reported.
    final = loss.detach().float().clone()
    torch.distributed.all_reduce(final)
    final = final.item() / world
    if rank == 0:
        optimizer = type(engine.optimizer).__name__
        print(f"final_loss={final:.6f} optimizer={optimizer} first_loss={first:.6f}", flush=True)
        if args.print_losses:
            print("losses=" + ",".join(repr(value) for value in losses), flush=True)  # repr: round-trips exactly
    # Shut down as torch.distributed asks: the engine's threads and peer monitor, then the process groups. Left to
    # interpreter exit, a gloo group whose peers have gone can abort a finished rank ("terminate called without an
    # active exception"), which a launcher reports as a failed run.
    engine.destroy()
    torch.distributed.destroy_process_group()
    if not math.isfinite(final):
        raise SystemExit(f"loss is not finite: {final}")


if __name__ == "__main__":
    main()
