"""The ledger's time figures, on hand-made intervals: busy time is the union of collective intervals and
injected delays (overlaps counted once, clipped to the step); exposed time counts only the training thread."""

import threading

import pytest

from ds_asynchzp.platform.ledger import CommLedger, CommRecord


def _record(started, ended, thread="asynchzp-gather"):
    return CommRecord(op="all_gather", method="all_gather_into_tensor", buffer_bytes=8, wire_bytes=4.0,
                      group_size=2, group_ranks=(0, 1), inter_node=False, tag="t", thread=thread,
                      started=started, ended=ended, seconds=ended - started)


def test_busy_time_is_the_union_of_intervals_clipped_to_the_step():
    ledger = CommLedger(node_size=2)
    ledger.records += [_record(1.0, 3.0), _record(2.0, 4.0), _record(6.0, 7.0), _record(9.5, 12.0)]
    ledger.note_delay(4.0, 4.5)       # touches the first run: [1, 4.5]
    assert ledger.busy_seconds(0.0, 10.0) == pytest.approx(3.5 + 1.0 + 0.5)
    assert ledger.busy_seconds(2.5, 6.5) == pytest.approx(2.0 + 0.5)
    # An interval still in flight (no end yet) counts up to the end of the window.
    ledger.records.append(_record(8.0, 0.0))
    assert ledger.busy_seconds(0.0, 10.0) == pytest.approx(3.5 + 1.0 + 2.0)


def test_exposed_time_counts_only_the_training_thread():
    ledger = CommLedger(node_size=2)
    ledger.note_wait(1.0, 2.0, "parameter all-gather")
    worker = threading.Thread(target=ledger.note_wait, args=(3.0, 5.0, "on a communication thread"))
    worker.start()
    worker.join()
    assert ledger.exposed_seconds(0.0, 10.0) == pytest.approx(1.0)
    assert ledger.exposed_seconds(1.5, 10.0) == pytest.approx(0.5)
    assert [w[2] for w in ledger.waits_between(0.0, 10.0)] == ["parameter all-gather"]
