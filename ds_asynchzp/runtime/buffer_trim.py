"""Once per optimizer step: the package's own buffers shrink to what the last step used (docs/ARCHITECTURE.md,
"Memory beyond model states").

Called by the optimizer's `step()` on the training thread, once every flow is quiet: the window's reductions are
drained, the cross-node sums and the previous refresh waited for, and the prefetched gathers given back. Each
owner trims where it is safe:

* the gather pool (`BufferPool.trim`) here: its buffers are taken and given back on this thread;
* each staging ring (`StagingRing.end_step`) here: its slots are taken on this thread, and their jobs are waited
  for before a slot is freed;
* each flow's scratch (`Scratch.trim`) as a job of that flow, submitted like the others: it runs on the flow's
  thread (or inline) after every job submitted before it and before any submitted after, so it never races a job
  that uses the scratch, and what counts as "the last step" is fixed by the order of submission on every rank.
"""

from __future__ import annotations


def _trim_scratch(runner, scratch) -> None:
    # Not waited for: the next job of the flow runs after it, and nobody else reads the flow's scratch.
    runner.submit(scratch.trim, "scratch trim", "none")


def trim_buffers(optimizer) -> None:
    owners = optimizer.hzp_buffer_owners()
    owners.pool.trim(readers_stream=owners.gather.compute)
    _trim_scratch(owners.gather_runner, owners.gather.scratch)
    for placement in owners.trainable:
        placement.reduce.staging.end_step()
        _trim_scratch(placement.reduce.runner, placement.reduce.scratch)
    for placement in owners.families:
        _trim_scratch(placement.boundary.runner, placement.boundary.scratch)
