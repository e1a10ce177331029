"""The ledger's model labels (`model_scope`): a reference model's collectives are told apart from the trained
model's by the thread that runs its forward, not by group (stock ZeRO-3 gathers both over the world) or link."""

import threading

import torch

from ds_asynchzp.platform.ledger import CommLedger


class _World:
    """Rank 0 of 4 in nodes of 2: enough of a backend for the ledger's arithmetic."""

    def get_rank(self):
        return 0

    def get_world_size(self, group=None):
        return 4


def _gather(ledger: CommLedger, numel: int) -> None:
    ledger._record("all_gather_into_tensor", "all_gather", "output_tensor",
                   {"output_tensor": torch.empty(numel), "group": None})


def test_only_the_labelling_threads_collectives_count_for_the_model():
    ledger = CommLedger(node_size=2)
    ledger._backend = _World()
    _gather(ledger, 100)                                   # the trained model's, before the label
    with ledger.model_scope("reference"):
        _gather(ledger, 1000)
        # A communication thread's collective for the trained model, issued while the reference runs.
        other = threading.Thread(target=_gather, args=(ledger, 10))
        other.start()
        other.join()
        with ledger.model_scope("teacher"):
            _gather(ledger, 50)
        _gather(ledger, 1000)
    _gather(ledger, 100)
    by_model = ledger.summary()["by_model"]
    assert set(by_model) == {"reference", "teacher"}
    assert by_model["reference"]["calls"] == 2 and by_model["teacher"]["calls"] == 1
    # A world gather of 4000 bytes: 3/4 of it sent by each rank, across nodes; rank 0's ring successor (1) is in
    # its own node, so it puts nothing on a link.
    assert by_model["reference"]["inter_node"] == 2 * 0.75 * 4000 and by_model["reference"]["link_bytes"] == 0
    assert ledger.summary()["calls"] == 6


def test_the_training_threads_own_collectives_between_steps():
    """What a step record adds from between two steps: the training thread's collectives, not a communication
    thread's (a late refresh of the step before), and no barriers."""
    ledger = CommLedger(node_size=2)
    ledger._backend = _World()
    mark = ledger.mark()
    _gather(ledger, 100)
    late = threading.Thread(target=_gather, args=(ledger, 1000))
    late.start()
    late.join()
    ledger._record("barrier", "barrier", None, {"group": None})
    for record in ledger.records:
        record.thread = record.thread or threading.current_thread().name
    ledger.records[1].thread = late.name
    own = ledger.summary(mark, training_thread_only=True)
    assert own["calls"] == 1 and own["inter_node"] == 0.75 * 400
    assert ledger.summary(mark)["calls"] == 3


class _Engine:
    """Enough of an engine for an observer: forward gathers once, or raises."""

    def __init__(self, ledger: CommLedger):
        self.ledger, self.fail = ledger, False

    def forward(self):
        _gather(self.ledger, 100)
        if self.fail:
            raise RuntimeError("planted")

    def backward(self, loss):
        pass

    def step(self):
        pass


def test_a_reference_forward_is_labelled_in_the_forward_phase_and_a_failed_one_ends_its_label(monkeypatch):
    from ds_asynchzp.formulas import flows
    from ds_asynchzp.measure.recording import ReferenceLabel
    from ds_asynchzp.platform import ledger as ledger_module

    ledger = CommLedger(node_size=2)
    ledger._backend = _World()
    monkeypatch.setattr(ledger_module, "_LEDGER", ledger)
    engine = _Engine(ledger)
    ReferenceLabel(engine)
    ledger.set_phase("backward")
    engine.forward()
    assert ledger.phase == "backward", "the phase before the reference's forward is restored"
    engine.fail = True
    try:
        engine.forward()
    except RuntimeError:
        pass
    _gather(ledger, 100)                    # the trained model's, after the failed reference forward
    summary = ledger.summary()
    assert summary["by_model"]["reference"]["calls"] == 2 and summary["calls"] == 3
    assert summary["by_flow"][flows.FORWARD_GATHER]["calls"] == 2
