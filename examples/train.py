"""Train the small benchmark GPT (or, with --model moe, a small Mixtral whose experts DeepSpeed's AutoEP spreads
over ranks) with DeepSpeed, optionally with AsyncHZP.

Run it under the deepspeed launcher (see README.md). The ds_config decides everything:
with an "async_hzp" section the engine uses hierarchical ZeRO, without one it is stock DeepSpeed; the MoE model
needs an "expert_parallel" section (examples/ds_config_moe.json).

The samples of a step depend on the global batch (world x micro-batch x gradient accumulation), not on the world
size, as with a distributed sampler over a fixed dataset; the loss printed is the mean over the global batch. A
run saved with --save-dir and resumed with --load-dir on fewer ranks, with the same global batch, therefore trains
on as the original run would have (docs/multinode.md, "Resume on fewer nodes").
"""

import argparse
import math
import os

import deepspeed
import torch

import ds_asynchzp
from ds_asynchzp.bench.data import batch_for
from ds_asynchzp.models.gpt import MODEL_PRESETS, build_model
from ds_asynchzp.models.mixtral import MOE_PRESETS, build_moe_model

SEQ_LEN = 64  # tokens per sample of the MoE model


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--steps", type=int, default=20,
                        help="optimizer steps in all: a resumed run trains from its checkpoint's step up to this one")
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_PRESETS) + sorted(MOE_PRESETS),
                        help="a byte-level GPT preset, or moe (a transformers Mixtral, for AutoEP)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--print-losses", action="store_true",
                        help="print each logged step's loss also at full precision, and end with the loss of "
                             "every step of this run, to compare two runs bit for bit")
    parser.add_argument("--save-dir", metavar="DIR",
                        help="save a checkpoint into DIR after the last step (tag global_step<N>, which DIR/latest "
                             "then names), and every --save-every steps")
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="with --save-dir, also save after every N optimizer steps")
    parser.add_argument("--load-dir", metavar="DIR",
                        help="resume from the checkpoint DIR/latest names (DIR/latest_universal, written by "
                             "ds_to_universal, when the ds_config has \"checkpoint\": {\"load_universal\": true}) "
                             "and train on up to --steps")
    parser.add_argument("--via-register", action="store_true",
                        help="call ds_asynchzp.register() and then plain deepspeed.initialize, "
                             "the way HF Trainer or Accelerate would reach it")
    parser = deepspeed.add_config_arguments(parser)  # adds --deepspeed_config
    return parser.parse_args()


def micro_batch_for(step, micro, rank, world, accumulation, size, seq_len, seed):
    """Rank `rank`'s samples at micro-step `micro` of optimizer step `step`: sample j of a step is window
    step * global_batch + j of the data, and rank r takes samples (micro * world + r) * size + i, as a
    distributed sampler would. A step's samples depend only on the global batch, not on how it is split."""
    first = step * world * accumulation * size + (micro * world + rank) * size
    pairs = [batch_for(first + i, 0, 0, 1, 1, seq_len, seed) for i in range(size)]
    return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])


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

    start = 0
    if args.load_dir:
        path, _ = engine.load_checkpoint(args.load_dir)
        if path is None:  # DeepSpeed only warns when there is no `latest` file
            raise SystemExit(f"no checkpoint to resume from in {args.load_dir}")
        start = engine.global_steps
        if engine.global_rank == 0:
            print(f"resumed from {os.path.dirname(path)} at step {start}", flush=True)  # path: a model-states file
        if start >= args.steps:
            raise SystemExit(f"the checkpoint is at step {start}: nothing to train up to --steps {args.steps}")

    rank, world = engine.global_rank, engine.world_size
    micro_batch = engine.train_micro_batch_size_per_gpu()
    accumulation = engine.gradient_accumulation_steps()
    seq_len = getattr(model.config, "seq_len", SEQ_LEN)  # the GPT presets fix theirs; the Mixtral takes 64
    losses = []
    for step in range(start, args.steps):
        # On the engine's device: NCCL reduces device tensors only, and the sum stays there until the step ends.
        total = torch.zeros(1, dtype=torch.float64, device=engine.device)
        for micro in range(accumulation):
            inputs, targets = micro_batch_for(step, micro, rank, world, accumulation, micro_batch, seq_len,
                                              args.seed)
            loss = engine(inputs.to(engine.device), targets.to(engine.device))
            engine.backward(loss)
            engine.step()  # applies the optimizer only at the accumulation boundary
            total += loss.detach().double()
        # The mean over the global batch: the same number on every rank, and at every world size.
        torch.distributed.all_reduce(total)
        losses.append(total.item() / (world * accumulation))
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            exact = f"  exact {losses[-1]!r}" if args.print_losses else ""
            print(f"step {step:4d}  loss {losses[-1]:.4f}{exact}", flush=True)
        if args.save_dir and (step == args.steps - 1 or (args.save_every and (step + 1) % args.save_every == 0)):
            engine.save_checkpoint(args.save_dir)  # tag global_step<N>; every rank takes part
            if rank == 0:
                print(f"saved {os.path.join(args.save_dir, f'global_step{engine.global_steps}')}", flush=True)

    final = losses[-1]
    if rank == 0:
        optimizer = type(engine.optimizer).__name__
        print(f"final_loss={final:.6f} optimizer={optimizer} first_loss={losses[0]:.6f}", flush=True)
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
