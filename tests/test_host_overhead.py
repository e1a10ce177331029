"""Host time per parameter: the benchmark preset that measures it, how the figure is computed, and the structure of
what keeps AsyncHZP's share of it small. Nothing here is timed (a busy machine must not fail a test); the figures
themselves come from `asynchzp-bench --model many-small` (docs/benchmarks.md).

* The `many-small` preset: hundreds of tiny parameter tensors, each counted once (the tied one too).
* The figure: median step time (slowest rank, steady steps) / parameter tensors, per arm and after repeats; in the
  table for that preset only; the bench refuses ZeRO-3 knobs under which parameters stay gathered.
* The replayed prefetch coalesces consecutive small requests into one gather (one job), never two requests that
  share a parameter; a departure gives back exactly the buffers of the requests nobody asked for.
* With nothing gathered ahead, the gathers run on the training thread: no thread hand-off per gather.
"""

import pytest
import torch

from ds_asynchzp.bench import cli
from ds_asynchzp.bench.aggregate import aggregate_arm, merge_repeats
from ds_asynchzp.models.gpt import HOST_OVERHEAD_PRESET, MODEL_PRESETS, build_model, count_parameters
from ds_asynchzp.bench.table import HOST_COLUMNS, format_table
from ds_asynchzp.comm.param_gather import COALESCE_NUMEL
from ds_asynchzp.scheduler import context as context_module
from ds_asynchzp.scheduler.comm_thread import CommThread, InlineRunner
from tests.test_bench_cli import _fake_rank
from tests.test_gather_dtypes import _fake_zero_param, _gather_over, _release


def test_the_host_overhead_preset_is_many_tiny_tensors_counted_once():
    assert HOST_OVERHEAD_PRESET in MODEL_PRESETS
    model = build_model(HOST_OVERHEAD_PRESET, seed=0)
    counts = count_parameters(model)
    # Every parameter tensor once: the embedding tied to the output head is one tensor.
    assert counts["tensors"] == len({id(p) for m in model.modules() for p in m.parameters(recurse=False)})
    assert counts["tensors"] >= 300 and counts["total"] / counts["tensors"] < 1000
    assert count_parameters(build_model("tiny", seed=0))["tensors"] < counts["tensors"] / 5


def _with_cpu(rank: dict, cpu: list, tensors: int = 400) -> dict:
    return dict(rank, parameter_tensors=tensors, steps=[dict(s, cpu_s=c) for s, c in zip(rank["steps"], cpu)])


def test_host_time_per_parameter_is_median_step_time_over_tensors():
    ranks = [_with_cpu(_fake_rank(1, [1.0] * 3, [9.0, 1.0, 3.0], [0.0] * 3, 1), [9.0, 0.5, 0.8]),
             _with_cpu(_fake_rank(0, [1.0] * 3, [5.0, 2.0, 2.0], [0.0] * 3, 1), [5.0, 0.6, 0.4])]
    entry = aggregate_arm(ranks, 1, 16)
    assert entry["median_step_time_s"] == 2.5 and entry["parameter_tensors"] == 400  # slowest rank, steady steps
    assert entry["host_us_per_param_per_step"] == pytest.approx(2.5e6 / 400)
    # CPU time: per step the largest over ranks (0.6, 0.8), then the median over steady steps.
    assert entry["cpu_s_per_step"] == pytest.approx(0.7)
    assert entry["host_cpu_us_per_param_per_step"] == pytest.approx(0.7e6 / 400)
    slower = aggregate_arm([dict(r, steps=[dict(s, time_s=2 * s["time_s"], cpu_s=2 * s["cpu_s"]) for s in r["steps"]])
                            for r in ranks], 1, 16)
    merged = merge_repeats([entry, slower, slower])   # the median of the repeats' medians: 5.0 s, 1.4 s
    assert merged["host_us_per_param_per_step"] == pytest.approx(5.0e6 / 400)
    assert merged["host_cpu_us_per_param_per_step"] == pytest.approx(1.4e6 / 400)
    older = aggregate_arm([_fake_rank(0, [1.0] * 2, [1.0] * 2, [0.0] * 2, 1)], 1, 16)
    # Workers that did not count their tensors or their CPU time.
    assert older["host_us_per_param_per_step"] is None and older["host_cpu_us_per_param_per_step"] is None


def test_the_table_shows_host_time_on_the_host_overhead_preset_only():
    entry = aggregate_arm([_with_cpu(_fake_rank(0, [1.0] * 2, [1.0] * 2, [0.0] * 2, 1), [1.0, 0.25], 500)], 1, 16)
    half = dict(entry, host_us_per_param_per_step=entry["host_us_per_param_per_step"] / 2)
    table = format_table({"config": {"model": HOST_OVERHEAD_PRESET}, "arms": {"zero3": entry, "asynchzp": half}})
    assert all(title in table for title in HOST_COLUMNS) and "(500)" in table
    row = next(line for line in table.splitlines() if line.startswith("| asynchzp"))
    assert "1000 (0.50x)" in row and "500 (1.00x)" in row   # wall, then CPU (0.25 s / 500)
    assert not any(title in format_table({"config": {"model": "small"}, "arms": {"zero3": entry}})
                   for title in HOST_COLUMNS)


@pytest.mark.parametrize("knobs", ["tuned", "no-overlap"])
def test_every_arm_regathers_every_parameter_on_the_host_overhead_preset(knobs):
    args = cli.parse_args(["--model", HOST_OVERHEAD_PRESET, "--zero3-knobs", knobs, "--arms",
                           "zero3,asynchzp-sync,asynchzp", "--nproc", "2", "--node-size", "2"])
    for arm in args.arms:
        zero = cli.ds_config_for(arm, args)["zero_optimization"]
        assert all(zero[key] == 0 for key in cli.KEEP_GATHERED_KEYS), (arm, zero)


def test_the_bench_refuses_knobs_that_keep_the_host_overhead_presets_parameters_gathered(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", HOST_OVERHEAD_PRESET, "--zero3-knobs", "deepspeed"])
    assert "keeps parameters gathered" in capsys.readouterr().err


class CountingThread(CommThread):
    """A gather thread that counts its jobs (each job issues one collective per family and dtype)."""

    def __init__(self):
        super().__init__("gather-test", timeout=30)
        self.jobs = 0

    def submit(self, *args, **kwargs):
        self.jobs += 1
        return super().submit(*args, **kwargs)


@pytest.fixture
def counting():
    runner = CountingThread()
    yield runner
    assert runner.stop()


def _micro_step(gather, params, values, order):
    gather.new_sequence()
    for i in order:
        gather.all_gather_coalesced([params[i]]).wait()
        assert torch.equal(params[i].data, values[i])
        _release(gather, [params[i]])


def test_replayed_small_requests_share_one_gather_but_never_a_parameter(counting):
    values = [torch.randn(5) for _ in range(6)]
    params = [_fake_zero_param(i, v) for i, v in enumerate(values)]
    gather = _gather_over(params, counting)
    order = [0, 1, 2, 3, 1, 4]                   # parameter 1 twice, as a module used twice would be
    _micro_step(gather, params, values, order)   # recorded: one job per request
    assert counting.jobs == 6
    _micro_step(gather, params, values, order)
    # Replayed: the first request, then requests 1-3 in one gather; the second request of parameter 1 cannot join
    # them (one buffer per parameter per gather), so it and request 4 follow in a second one.
    assert counting.jobs == 6 + 3 and gather.stats["prefetched"] == 5
    assert not gather.leases and not gather._prefetched


def test_a_departure_gives_back_exactly_the_requests_nobody_asked_for(counting):
    values = [torch.randn(7) for _ in range(8)]
    params = [_fake_zero_param(i, v) for i, v in enumerate(values)]
    gather = _gather_over(params, counting)
    _micro_step(gather, params, values, range(8))
    _micro_step(gather, params, values, range(8))
    assert counting.jobs == 8 + 2                 # replayed: the first request, then one gather for the other 7
    # Departs at the fourth request: request 5 is served from the coalesced gather, 3, 4, 6 and 7 go back.
    _micro_step(gather, params, values, [0, 1, 2, 5, 3])
    gather.new_sequence()
    assert not gather.leases and not gather._prefetched
    free = sum(len(entries) for entries in gather.pool._free.values())
    assert free == gather.pool.allocations       # every buffer back in the pool, none twice


def test_requests_past_the_coalescing_bound_are_gathers_of_their_own(counting):
    values = [torch.randn(COALESCE_NUMEL // 2 + 1) for _ in range(4)]
    params = [_fake_zero_param(i, v) for i, v in enumerate(values)]
    gather = _gather_over(params, counting)
    _micro_step(gather, params, values, range(4))
    _micro_step(gather, params, values, range(4))
    assert counting.jobs == 4 + 4                 # two of them would exceed the bound: no coalescing
    assert gather.stats["prefetched"] == 3


def test_gathers_run_on_the_training_thread_when_nothing_is_gathered_ahead(monkeypatch):
    assert context_module.flows_waited_at_once(prefetch_depth=0, coordinator_prefetches=False) == ("gather",)
    assert context_module.flows_waited_at_once(prefetch_depth=2, coordinator_prefetches=False) == ()
    assert context_module.flows_waited_at_once(prefetch_depth=0, coordinator_prefetches=True) == ()

    class NoMonitor:                            # one process, no rendezvous store
        def __init__(self, *args, **kwargs):
            pass

        start = close = explain = lambda self, *args: None
    monkeypatch.setattr(context_module, "PeerMonitor", NoMonitor)
    context = context_module.CommContext(async_comm=True, timeout_s=30, device="cpu", rank=0, world=1,
                                         inline_flows=("gather",))
    try:
        assert isinstance(context.gather, InlineRunner)
        assert isinstance(context.reduce, CommThread) and isinstance(context.boundary, CommThread)
    finally:
        context.close()
