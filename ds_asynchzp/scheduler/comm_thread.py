"""A communication thread: a FIFO of jobs, each issuing collectives on groups only this thread uses.

The training thread submits jobs in program order, which is the same on every rank, and each thread runs its
jobs in submission order: so every rank issues the same collectives in the same order on every group, which is
what gloo and NCCL match collectives by. Across threads, a job starts issuing only at its turn in the rank's one
issue order (`issue_order`), where that order is total. A job that fails poisons its thread: the later jobs are
not run (their collectives would no longer line up across ranks) and fail with the same error.

On a device with streams a job runs on its flow's stream. The submitter names what the job must come after:
events recorded where the job's inputs were last written, and where its outputs were last read (`after`); the
stream waits on them before the job starts. Nothing rests on the stream that happens to be current at submit
(inside DeepSpeed's hooks that is one of DeepSpeed's side streams, not compute). When the job ends an event is
recorded on its stream; every `Pending.wait` makes the waiting stream wait on it, also when the job's host
function has already returned (on the device that only means its kernels are enqueued). On CPU the collectives
are synchronous inside the job, so a completed job means the data is ready.

`InlineRunner` has the same interface and runs each job at once on the caller's thread (`async_comm: false`, or
the gather flow when nothing is gathered ahead),
on the same stream and with the same events: the same collectives, the same order, the same arithmetic.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Optional

from ..platform import ledger
from ..errors import AsyncHZPNotActiveError, CommThreadError, CommTimeoutError, GradientMismatchError
from ..platform import streams
from .issue_order import IssueOrder

# The package's own failures, raised inside jobs: passed on as they are, never read as a backend's.
OWN_ERRORS = (AsyncHZPNotActiveError, CommThreadError, CommTimeoutError, GradientMismatchError)

_STOP = object()

# Tools that time every job on its stream (the GPU check) register a callable here: called with the thread's name
# and stream as a job starts, it returns what to call when the job ends (or None). Empty while training.
_job_timers: list = []


def add_job_timer(timer: Callable) -> None:
    _job_timers.append(timer)


def remove_job_timer(timer: Callable) -> None:
    _job_timers.remove(timer)


class _Finished:
    """In place of a `threading.Event` for an inline job, which is done before anyone can ask (an Event costs more
    to build than a small gather's host work, and one is built per job)."""

    @staticmethod
    def is_set() -> bool:
        return True

    def set(self) -> None:
        pass


_FINISHED = _Finished()


def _run_on_stream(job: Callable[[], object], after, stream) -> tuple:
    """The contract of every job, on a thread or inline: `stream` (current) waits on the events in `after`, the
    job runs, and an event recorded on `stream` after it says when its device work is done. (value, event)."""
    streams.wait(list(after), stream)
    value = job()
    return value, streams.record(stream)


class Pending:
    """One submitted job. `wait()` blocks until it is done (at most `timeout` seconds), re-raises its failure on
    the waiting thread, and makes the waiting thread's stream wait for its result."""

    def __init__(self, what: str, group: str, timeout: float, diagnose: Optional[Callable[..., Optional[str]]] = None,
                 ticket: int = -1, inline: bool = False):
        self.what, self.group, self.timeout, self.ticket = what, group, timeout, ticket
        # Names a lost peer rank, when that is why a collective failed; else where every rank is in the order.
        self.diagnose = diagnose
        self.value = None
        self.error: Optional[BaseException] = None
        self.done_event = None                 # CUDA event recorded after the job, or None
        self._done = _FINISHED if inline else threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _cause(self, otherwise: str) -> str:
        lost = self.diagnose(self.ticket) if self.diagnose is not None else None
        return lost or otherwise

    def finish(self, value=None, error: Optional[BaseException] = None, done_event=None) -> None:
        self.value, self.error, self.done_event = value, error, done_event
        self._done.set()

    def wait(self, also=()):
        """The job's value, once done. The current stream (and each stream in `also`) waits on the job's event,
        whether or not the job was done already: host done is not device done."""
        self.wait_host()
        streams.wait(self.done_event)
        for stream in also:
            streams.wait(self.done_event, stream)
        return self.value

    def wait_host(self):
        """Block until the job's host function has returned (its failure re-raised); orders no stream."""
        if not self._done.is_set():
            started = time.perf_counter()
            finished = self._done.wait(self.timeout)
            ledger.note_wait(started, time.perf_counter(), self.what)
            if not finished:
                raise CommTimeoutError(
                    f"{self.what} on process group '{self.group}' did not complete within {self.timeout:.0f} s "
                    f"(async_hzp.comm_timeout_s); {self._cause('a peer rank is probably gone or stuck')}")
        if self.error is not None:
            raise CommThreadError(f"{self.what} on process group '{self.group}' failed on a communication thread "
                                  f"({self._cause('no peer rank is known to be lost')}): "
                                  f"{type(self.error).__name__}: {self.error}") from self.error
        return self.value


class CommThread:
    """A daemon thread running jobs in submission order; see the module docstring."""

    def __init__(self, name: str, timeout: float, order: Optional[IssueOrder] = None, stream=None, diagnose=None):
        self.name = name
        self.timeout = timeout
        self.order = order if order is not None else IssueOrder(total=False, timeout_s=timeout)
        self.stream = stream
        self.diagnose = diagnose
        self.busy_s = 0.0
        self._failure: Optional[BaseException] = None
        self._failed: Optional[Pending] = None   # the job whose failure poisoned the thread
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"asynchzp-{name}", daemon=True)
        self._thread.start()

    @property
    def is_async(self) -> bool:
        return True

    def submit(self, job: Callable[[], object], what: str, group: str, after=()) -> Pending:
        """Queue `job`; its stream first waits on the events in `after` (None entries skipped)."""
        if self._failure is not None:
            # Diagnosed as a wait on the failed job is (with its ticket: where every rank is, who went silent), so the
            # user reads the same cause whichever the training thread reaches first, this or that wait.
            failed = self._failed
            ticket = failed.ticket if failed is not None else None
            lost = self.diagnose(ticket) if self.diagnose is not None else None
            origin = (f"{failed.what} on process group '{failed.group}'" if failed is not None else "a job")
            raise CommThreadError(f"{origin} failed on a communication thread ('{self.name}') earlier, so {what} "
                                  f"was not issued ({lost or 'no peer rank is known to be lost'}): "
                                  f"{type(self._failure).__name__}: {self._failure}") from self._failure
        if not self._thread.is_alive():
            raise CommThreadError(f"the '{self.name}' communication thread is stopped; {what} was not issued")
        # The ticket is taken last: one taken by a job that never runs would hold up every later one.
        pending = Pending(what, group, self.timeout, self.diagnose, self.order.ticket())
        self._queue.put((job, pending, list(after)))
        return pending

    def _run(self) -> None:
        with streams.use(self.stream):
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                job, pending, after = item
                try:
                    with self.order.turn(pending.ticket, self.name, pending.what, pending.group):
                        self._run_one(job, pending, after)
                except CommTimeoutError as error:    # its turn never came: it issued nothing
                    if self._failure is None:
                        self._failure, self._failed = error, pending
                    pending.finish(error=error)

    def _run_one(self, job, pending: Pending, after) -> None:
        if self._failure is not None:    # skipped: its collectives would no longer line up across ranks
            pending.finish(error=self._failure)
            return
        started = time.perf_counter()
        timed = [timer(self.name, self.stream) for timer in _job_timers] if _job_timers else ()
        try:
            value, done = _run_on_stream(job, after, self.stream)
            pending.finish(value=value, done_event=done)
        except BaseException as error:  # noqa: BLE001 - handed to the training thread, with its traceback
            self._failure, self._failed = error, pending
            pending.finish(error=error)
        finally:
            self.busy_s += time.perf_counter() - started
            for end in timed:
                if end is not None:
                    end()

    def stop(self, timeout: float = 10.0) -> bool:
        """Let the queued jobs finish, then end the thread; True when it ended within `timeout`."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)
        return not self._thread.is_alive()


class InlineRunner:
    """`async_comm: false`, or a flow that needs no thread: every job runs at once on the submitting thread, on
    the flow's stream."""

    def __init__(self, name: str, timeout: float, order: Optional[IssueOrder] = None, stream=None, diagnose=None):
        self.name = name
        self.timeout = timeout
        # As for a thread's jobs: a failed collective names the lost peer (and lets the monitor publish it).
        self.diagnose = diagnose
        self.order = order if order is not None else IssueOrder(total=False, timeout_s=timeout)
        self.busy_s = 0.0
        self.stream = stream

    @property
    def is_async(self) -> bool:
        return False

    def submit(self, job: Callable[[], object], what: str, group: str, after=()) -> Pending:
        """Run `job` now, on the flow's stream, after the events in `after` (None entries skipped)."""
        pending = Pending(what, group, self.timeout, ticket=self.order.ticket(), inline=True)
        started = time.perf_counter()
        try:
            # Under the total order this waits until the other flows' threads have issued every earlier job.
            with self.order.turn(pending.ticket, self.name, what, group), streams.use(self.stream):
                value, done = _run_on_stream(job, after, self.stream)
            pending.finish(value=value, done_event=done)
        except RuntimeError as error:  # a backend's failure (gloo, NCCL): re-raised naming the lost peer if any
            if isinstance(error, OWN_ERRORS) or self.diagnose is None:
                raise
            lost = self.diagnose(pending.ticket)
            if lost is None:
                raise
            raise CommThreadError(f"{what} on process group '{group}' failed ({lost}): "
                                  f"{type(error).__name__}: {error}") from error
        finally:
            self.busy_s += time.perf_counter() - started
        return pending

    def stop(self, timeout: float = 10.0) -> bool:
        return True
