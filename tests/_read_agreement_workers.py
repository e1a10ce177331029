"""Rank-side code of tests/test_read_agreement.py (run by ds_asynchzp.bench.launch in fresh processes)."""

from __future__ import annotations

import time

import deepspeed

from tests._dist_workers import _build_engine, batch_for


def _micro_step(engine, case: dict, micro: int, rank: int, world: int) -> None:
    x, y = batch_for(0, micro, rank, world, 2, 32, seed=11)
    engine.backward(engine(x, y))
    engine.step()


def read_in_the_window(payload: dict) -> dict:
    """Two engines, a window of 2 micro-steps each. The first reads `optimizer.averaged_gradients` after the
    first backward on every rank; the second on `payload["readers"]` only. Each rank says what it saw."""
    from ds_asynchzp.errors import GradientReadMismatch

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    case = {"name": "reads", "gas": 2, "async_hzp": {"node_size": 1}}
    seen = {"rank": rank}
    engine = _build_engine(case)
    _micro_step(engine, case, 0, rank, world)
    engine.optimizer.averaged_gradients   # every rank: the window's sum starts, collectively
    _micro_step(engine, case, 1, rank, world)
    seen["every_rank_read"] = "done"
    engine.destroy()
    engine = _build_engine(case)
    _micro_step(engine, case, 0, rank, world)
    started = time.monotonic()
    try:
        if rank in payload["readers"]:
            engine.optimizer.averaged_gradients
        else:
            # The case the agreement ends at once: the read announced before the peer's next forward. A peer that
            # is already past its next forward's check learns of it only when the reader's process ends.
            time.sleep(3.0)
        _micro_step(engine, case, 1, rank, world)
        seen["some_ranks_read"] = "no error"
    except GradientReadMismatch as error:
        seen["some_ranks_read"] = str(error)
    seen["seconds"] = time.monotonic() - started
    deepspeed.comm.barrier()
    return seen
