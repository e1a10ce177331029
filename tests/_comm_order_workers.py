"""Rank-side code of tests/test_comm_order.py: the order in which a rank issues its collectives and the groups'
warm-up. (The stopped rank trains with `tests._dist_workers.train_until_killed`, sending SIGSTOP.)"""

from __future__ import annotations

import datetime
import os
import threading

import deepspeed

from tests._dist_workers import WORLD_TIMEOUT_S, _build_engine, train_step

# The backend calls that issue a collective, and the argument that names the group.
_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single", "broadcast",
                "all_gather_object", "broadcast_object_list")


class IssueRecorder:
    """Wraps DeepSpeed's backend object (where every collective of ours and DeepSpeed's ends) and records, at the
    moment each collective is issued, (group name, op, elements) and the issuing thread. Group names are the
    package's role names (`param_shard`, ...), the same on every rank; DeepSpeed's own groups are 'deepspeed'."""

    def __init__(self):
        from ds_asynchzp.platform.deepspeed_internals import comm_backend

        self.backend = comm_backend()
        self.names = {}
        self.issued = []
        self._lock = threading.Lock()
        self._saved = {}
        for op in _COLLECTIVES:
            original = getattr(self.backend, op)
            self._saved[op] = original
            setattr(self.backend, op, self._wrap(op, original))

    def _wrap(self, op, original):
        def issue(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if type(a).__name__ == "ProcessGroup"), None)
            tensor = next((a for a in list(args) + list(kwargs.values()) if hasattr(a, "numel")), None)
            with self._lock:
                self.issued.append((id(group), op, int(tensor.numel()) if tensor is not None else 0,
                                    threading.current_thread().name))
            return original(*args, **kwargs)
        return issue

    def name_groups(self, optimizer) -> None:
        for handle, _ranks, name in optimizer._hzp_created_groups:
            self.names[id(handle)] = name

    def named(self, start: int = 0, end: int = None) -> list:
        """The issued collectives from `start` to `end`, each group named (once `name_groups` ran)."""
        return [(self.names.get(group, "deepspeed"), op, numel, thread)
                for group, op, numel, thread in self.issued[start:end]]

    def uninstall(self) -> None:
        for op, original in self._saved.items():
            setattr(self.backend, op, original)


def record_issue_order(payload: dict) -> dict:
    """Train each case under random delays around every collective; per case, the sequence of collectives this
    rank issued after construction, and what construction did first."""
    from ds_asynchzp.comm import delay_injection
    from ds_asynchzp.ops import builder

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=WORLD_TIMEOUT_S))
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    loads = []
    load = builder._Loader._load

    def recording_load(self):
        loads.append(threading.current_thread().name)
        return load(self)
    builder._Loader._load = recording_load

    results = {"rank": rank}
    for case in payload["cases"]:
        os.environ["DS_ASYNCHZP_COMM_DELAY_MS"] = case.get("comm_delay", "")
        delay_injection.reset()
        recorder = IssueRecorder()
        started_threads = []
        from ds_asynchzp.scheduler import comm_thread
        original_start = comm_thread.CommThread.__init__

        def noting_start(self, *args, **kwargs):
            started_threads.append(len(recorder.issued))
            original_start(self, *args, **kwargs)
        comm_thread.CommThread.__init__ = noting_start
        try:
            engine = _build_engine(case)
        finally:
            comm_thread.CommThread.__init__ = original_start
        recorder.name_groups(engine.optimizer)
        mark = len(recorder.issued)
        losses = [train_step(engine, case, step, rank, world) for step in range(case["steps"])]
        member_groups = [name for handle, ranks, name in engine.optimizer._hzp_created_groups if rank in ranks]
        issued, construction = recorder.named(mark), recorder.named(0, mark)
        engine.destroy()
        recorder.uninstall()
        results[case["name"]] = {
            "losses": losses,
            "issued": issued,
            "threads": sorted({thread for *_, thread in issued}),
            "construction": construction,
            "threads_started_after": started_threads,
            "member_groups": member_groups,
        }
    os.environ["DS_ASYNCHZP_COMM_DELAY_MS"] = ""
    results["ops_loaded_on"] = loads
    deepspeed.comm.barrier()
    return results
