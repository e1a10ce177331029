"""The ledger's quantization-scale split, on a fake backend with two nodes of one rank: what AsyncHZP's packed
rows say is scales, stock ZeRO++'s separate fp32 scale collectives, and everything else as payload."""

import pytest
import torch

from ds_asynchzp.platform.ledger import CommLedger
from ds_asynchzp.comm.quantized import row_layout
from ds_asynchzp.quantization import QuantFormat


class _TwoNodes:
    """Rank 0 of a world of 2 with one rank per node: every collective crosses nodes."""

    def get_rank(self, group=None):
        return 0

    def get_world_size(self, group=None):
        return 2

    def get_global_rank(self, group, index):
        return index


def _ledger():
    ledger = CommLedger(node_size=1)
    ledger._backend = _TwoNodes()
    noop = lambda *args, **kwargs: None  # noqa: E731 - the collective itself does not matter here
    return ledger, ledger._wrap("all_gather_into_tensor", noop), ledger._wrap("all_to_all_single", noop), \
        ledger._wrap("reduce_scatter_tensor", noop)


def _scales(ledger):
    flow = ledger.summary()["by_flow"]["other"]
    return flow["inter_node"], flow["inter_node_scales"]


def test_packed_rows_count_their_scales_by_the_layout():
    ledger, all_gather, _, _ = _ledger()
    layout = row_layout(QuantFormat(bits=8, block_size=512), (1000, 24))
    # 1000 values: 1000 bytes + 2 scales; 24 values: 24 bytes + 1 scale; each padded to 4 bytes before its scales.
    assert layout.row_bytes == 1000 + 8 + 24 + 4
    packed = torch.zeros(layout.row_bytes, dtype=torch.uint8)
    with ledger.carrying_scales(layout.scale_share):
        all_gather(torch.zeros(2 * layout.row_bytes, dtype=torch.uint8), packed)
    total, scales = _scales(ledger)
    assert total == pytest.approx(layout.row_bytes) and scales == pytest.approx(12.0)
    # Outside the block nothing is scales.
    all_gather(torch.zeros(2 * layout.row_bytes, dtype=torch.uint8), packed)
    assert _scales(ledger)[1] == pytest.approx(12.0)


def test_stock_scales_are_the_floating_point_collectives_of_the_quantized_ops():
    ledger, all_gather, all_to_all, reduce_scatter = _ledger()
    ints, floats = torch.zeros(64, dtype=torch.int8), torch.zeros(4, dtype=torch.float32)
    # Wire bytes of one rank of two: half the gathered output, half the exchanged or reduced input.
    # Before the switch a floating-point gather is payload (a run without stock quantization).
    all_gather(torch.zeros(8, dtype=torch.float32), floats)
    assert _scales(ledger) == (pytest.approx(16.0), 0.0)
    ledger.count_floating_as_scales(("all_gather", "all_to_all"))
    all_gather(torch.zeros(128, dtype=torch.int8), ints)                 # qwZ payload: 64 bytes
    all_gather(torch.zeros(8, dtype=torch.float32), floats)              # its scales: 16 bytes
    all_to_all(torch.zeros(64, dtype=torch.int8), ints)                  # qgZ payload: 32 bytes
    all_to_all(torch.zeros(4, dtype=torch.float32), floats)              # its scales: 8 bytes
    reduce_scatter(torch.zeros(4, dtype=torch.float32), torch.zeros(8))  # the fp32 fallback: payload, 16 bytes
    all_gather(torch.zeros(8, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16))  # a frozen bf16 weight: 8
    total, scales = _scales(ledger)
    assert total == pytest.approx(16 + 64 + 16 + 32 + 8 + 16 + 8) and scales == pytest.approx(16 + 8)
