"""A gradient read inside an accumulation window needs the window's cross-node sum, a collective: done on every
rank it works; done on one rank only, every rank ends with an error naming the read and the fix at once (at the
peers' next forward), not at comm_timeout_s (`scheduler/read_agreement.py`)."""

import threading
import time

import pytest

from ds_asynchzp.bench.launch import launch_local
from ds_asynchzp.errors import GradientReadMismatch
from ds_asynchzp.scheduler.read_agreement import ReadAgreement
from tests.dist_harness import REPO_ROOT

COMM_TIMEOUT_S = 300   # the section's default would be DeepSpeed's 600 s; a hang would show as either


@pytest.mark.usefixtures("deepspeed_cpu_ops")
def test_a_read_on_one_rank_ends_every_rank_with_the_read_named(tmp_path):
    results = launch_local("tests._read_agreement_workers:read_in_the_window", 2, 1, {"readers": [0]},
                           timeout_s=240, workdir=str(tmp_path),
                           env={"PYTHONPATH": str(REPO_ROOT), "GLOO_SOCKET_IFNAME": "lo"})
    for seen in results:
        assert seen["every_rank_read"] == "done"
        error = seen["some_ranks_read"]
        assert "optimizer.averaged_gradients" in error and "read them after engine.step()" in error, error
        # Bound: the peer's next forward (a micro-step here), far below comm_timeout_s.
        assert seen["seconds"] < 30, seen
    assert "1 of 2 ranks did the read, and ranks went on to their next forward" in results[0]["some_ranks_read"]
    assert "rank 1 started a forward where another rank read" in results[1]["some_ranks_read"]


class FakeStore:
    def __init__(self):
        self.values = {}

    def add(self, key, amount):
        self.values[key] = int(self.values.get(key, 0)) + amount
        return self.values[key]

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.values[key]

    def check(self, keys):
        return all(k in self.values for k in keys)

    def delete_key(self, key):
        return self.values.pop(key, None) is not None


def test_the_agreement_refuses_a_peer_that_went_on_and_waits_for_one_that_reads():
    """Two ranks on one store, as two ReadAgreements of the same engine."""
    store = FakeStore()
    reader, peer = ReadAgreement(store, 0, 2, 0, 5.0), ReadAgreement(store, 1, 2, 0, 5.0)
    for agreement in (reader, peer):
        agreement.forward_started()
    # Both read after their first forward: agreed.
    waiting = threading.Thread(target=reader.read_starts_window_sum, args=("a read",))
    waiting.start()
    peer.read_starts_window_sum("a read")
    waiting.join(timeout=5)
    assert not waiting.is_alive()
    # Next window: the reader reads again, the peer goes on to its next forward, and both raise.
    for agreement in (reader, peer):
        agreement.window_sum_started()
        agreement.forward_started()
    failure = []

    def read():
        try:
            reader.read_starts_window_sum("optimizer.averaged_gradients")
        except GradientReadMismatch as error:
            failure.append(str(error))

    waiting = threading.Thread(target=read)
    waiting.start()
    while not store.values.get(f"{reader.prefix}/w1/read1"):
        time.sleep(0.001)
    with pytest.raises(GradientReadMismatch, match="rank 1 started a forward where another rank read the gradients "
                                                   r"\(optimizer.averaged_gradients\)"):
        peer.forward_started()
    waiting.join(timeout=5)
    assert failure and "1 of 2 ranks did the read" in failure[0], failure


def test_a_windows_keys_are_deleted_two_windows_later_and_one_rank_uses_none():
    store = FakeStore()
    agreement = ReadAgreement(store, 0, 2, 7, 5.0)
    for _ in range(6):
        for _ in range(3):
            agreement.forward_started()
        agreement.window_sum_started()
    windows = {key.split("/")[3] for key in store.values}
    assert windows == {"w4", "w5"}, sorted(store.values)   # the two last windows; the next one adds its own
    alone = FakeStore()
    single = ReadAgreement(alone, 0, 1, 8, 5.0)
    single.forward_started()
    single.read_starts_window_sum("a read")
    assert alone.values == {}
