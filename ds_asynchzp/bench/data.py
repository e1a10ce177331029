"""Benchmark data: a shipped text corpus, a byte-level tokenizer, and
deterministic batches.

Every training arm of the benchmark must see exactly the same tokens on the
same rank at the same step, otherwise loss curves of different arms are not
comparable.  ``batch_for`` therefore derives its randomness only from its
arguments (never from global RNG state, which the arms may consume
differently), and the corpus ships inside the package so no run depends on
network access or on a tokenizer file.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from importlib import resources

import torch

# Byte-level tokenization: every byte value is a token, so the vocabulary is
# fixed at 256 and encoding/decoding needs no external files.
VOCAB_SIZE = 256

# Fraction of the corpus (taken from the end) held out for validation.  The
# tail is used instead of a random subset so the split never depends on a seed.
VAL_FRACTION = 0.05

_CORPUS_PACKAGE = "ds_asynchzp.bench"
_CORPUS_PATH = ("data", "corpus.txt")


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D LongTensor of token ids in [0, 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    """Inverse of :func:`encode`; undecodable byte sequences are replaced."""
    return bytes(int(t) for t in tokens.reshape(-1).tolist()).decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=1)
def _corpus_bytes() -> bytes:
    # importlib.resources works both from a source checkout and from an
    # installed wheel (the file is declared as package data).
    ref = resources.files(_CORPUS_PACKAGE).joinpath(*_CORPUS_PATH)
    return ref.read_bytes()


def load_corpus() -> torch.Tensor:
    """The whole shipped corpus as a 1-D LongTensor of byte tokens.

    A fresh tensor is returned on every call so callers may modify it freely.
    """
    return torch.frombuffer(bytearray(_corpus_bytes()), dtype=torch.uint8).long()


def train_val_split(
    tokens: torch.Tensor, val_fraction: float = VAL_FRACTION
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``tokens`` into (train, validation); validation is the last
    ``val_fraction`` of the sequence."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = max(1, int(round(len(tokens) * val_fraction)))
    return tokens[:-n_val], tokens[-n_val:]


@functools.lru_cache(maxsize=1)
def _cached_splits() -> tuple[torch.Tensor, torch.Tensor]:
    # batch_for runs every micro-step; decoding the corpus each time would
    # dominate small benchmarks.  These tensors are only read, never mutated.
    return train_val_split(load_corpus())


def _derive_seed(*parts: int) -> int:
    """Mix integers into one 63-bit generator seed.

    A cryptographic hash (rather than e.g. ``seed + step``) keeps nearby
    argument tuples from producing correlated streams, and unlike Python's
    ``hash`` it is stable across processes and interpreter versions.
    """
    packed = struct.pack(f"<{len(parts)}q", *parts)
    digest = hashlib.blake2b(packed, digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def batch_for(
    step: int,
    micro_step: int,
    rank: int,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    seed: int,
    *,
    split: str = "train",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of (inputs, targets), each of shape (micro_batch, seq_len).

    The result is a pure function of the arguments.  Each rank samples windows
    only from its own contiguous shard of the split (shard ``rank`` of
    ``world_size`` equal parts), so ranks see disjoint text, like a
    distributed sampler would give.  ``targets`` is ``inputs`` shifted left by
    one token (next-byte prediction).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    if micro_batch < 1 or seq_len < 1:
        raise ValueError("micro_batch and seq_len must be positive")
    train, val = _cached_splits()
    if split == "train":
        data, split_id = train, 0
    elif split in ("val", "validation"):
        data, split_id = val, 1
    else:
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'val'")

    shard_len = len(data) // world_size
    if shard_len < seq_len + 1:
        raise ValueError(
            f"{split} shard of rank {rank} has {shard_len} tokens, "
            f"too short for seq_len={seq_len} (world_size={world_size})"
        )
    shard_start = rank * shard_len

    gen = torch.Generator(device="cpu")
    gen.manual_seed(_derive_seed(seed, step, micro_step, rank, split_id))
    # Window starts are chosen so the (seq_len + 1)-token window fits inside
    # the shard; the extra token supplies the last target.
    starts = torch.randint(0, shard_len - seq_len, (micro_batch,), generator=gen)
    offsets = torch.arange(seq_len + 1)
    windows = data[shard_start + starts[:, None] + offsets[None, :]]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
