"""Rank-side code of tests/test_offload_pipeline.py: each case trains stock ZeRO-3 with optimizer offload, then
AsyncHZP with the host step in pieces (`offload_pipeline` true) and whole (false), on the same ranks, model, data
and seed (the fuzzer's models and training loop, tests/_fuzz_workers.py), and reports what differs."""

from __future__ import annotations

import contextlib
import datetime
import os

import deepspeed
import torch

from tests import _fuzz_workers


def _pieces_per_step(spec: dict) -> dict:
    """Train the pipelined arm while counting DeepSpeedCPUAdam calls per sub-group step and copies back."""
    from ds_asynchzp.comm import host_copy
    from ds_asynchzp.runtime import host_step_pipeline

    counts = {"copies": 0, "sub_group_steps": 0}
    copy, step = host_copy.ParamsToDevice.copy, host_step_pipeline.PipelinedHostStep.step

    def counted_copy(self, *args, **kwargs):
        counts["copies"] += 1
        return copy(self, *args, **kwargs)

    def counted_step(self, *args, **kwargs):
        counts["sub_group_steps"] += 1
        return step(self, *args, **kwargs)

    host_copy.ParamsToDevice.copy, host_step_pipeline.PipelinedHostStep.step = counted_copy, counted_step
    try:
        result = _fuzz_workers._train(dict(spec, offload_pipeline=True), hierarchical=True)
    finally:
        host_copy.ParamsToDevice.copy, host_step_pipeline.PipelinedHostStep.step = copy, step
    return result, counts


def _same(a: dict, b: dict) -> list:
    """What differs, bit for bit, between two arms' results (every rank's losses, parameters, reads, norms)."""
    local = [a["losses"] != b["losses"],
             a["final"].keys() != b["final"].keys() or any(not torch.equal(a["final"][n], t)
                                                           for n, t in b["final"].items()),
             a["outside_reads"] != b["outside_reads"], a["grad_norms"] != b["grad_norms"]]
    flags = torch.tensor([float(x) for x in local])
    deepspeed.comm.all_reduce(flags, op=deepspeed.comm.ReduceOp.MAX)
    return [what for what, differs in zip(("losses", "parameters", "reads", "gradient norms"), flags.tolist())
            if differs]


@contextlib.contextmanager
def planted(name):
    """A defect the comparison must catch, in the pipelined arm only."""
    from ds_asynchzp.runtime import host_step_pipeline
    if not name:
        yield
        return
    if name == "unaligned_pieces":
        # Pieces cut exactly at the chunk edges, not at multiples of the vector width from the sub-group's start.
        original = host_step_pipeline.piece_edges
        host_step_pipeline.piece_edges = lambda start, end, ends, **kw: original(start, end, ends,
                                                                                 **dict(kw, alignment=1))
        try:
            yield
        finally:
            host_step_pipeline.piece_edges = original
    else:
        raise ValueError(f"unknown planted defect {name!r}")


def run_pipeline_cases(payload: dict) -> dict:
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=_fuzz_workers.WORLD_TIMEOUT_S))
    from ds_asynchzp.runtime import host_step_pipeline

    results = {}
    for spec in payload["cases"]:
        # The test's models are small: pieces as small as the chunks, so that a sub-group makes several.
        host_step_pipeline.MIN_PIECE_ELEMENTS = spec.get("min_piece_elements", host_step_pipeline.MIN_PIECE_ELEMENTS)
        stock = _fuzz_workers._train(spec, hierarchical=False)
        with planted(spec.get("plant")):
            pipelined, counts = _pieces_per_step(spec)
        serial = _fuzz_workers._train(dict(spec, offload_pipeline=False), hierarchical=True)
        results[spec["name"]] = {
            "pipelined_vs_serial": _same(pipelined, serial),
            "pipelined_vs_stock": _same(pipelined, stock),
            "max_loss_rel_diff_vs_stock": max(abs(a - b) / max(abs(b), 1e-30)
                                              for a, b in zip(pipelined["losses"], stock["losses"])),
            "host_optimizer": pipelined["host_optimizer"], "stock_host_optimizer": stock["host_optimizer"],
            **counts}
        print(f"pipeline case {spec['name']}: {results[spec['name']]}", flush=True)
    results["rank"] = int(os.environ["RANK"])
    return results
