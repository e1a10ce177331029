"""A shard buffer: `rows` atoms of many parameters, one flat tensor, one column range per parameter.

The buffer is a [rows, columns] matrix. Column range [offset, offset + atom) belongs to one parameter (its atom
size: DeepSpeed's partition size), and row t holds atom number `atoms[t]` of every parameter in it. One row is
the rank's own atom of every parameter; DeepSpeed's own flat partition buffer is a view of that row, so the
state exists once.

A buffer also keeps, per stream, an event recorded after the training thread's latest access to it on that
stream (`note_host_access`): the optimizer's step into the own row, a checkpoint load, zeroing. Every
communication job that touches the buffer waits on them (`host_events`), whatever the layout: nothing else
would order the job's stream after those kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, Sequence, Tuple

import torch

from ..platform import streams


@dataclass(frozen=True)
class Columns:
    offset: int
    atom: int   # elements per atom (DeepSpeed's partition size of the parameter)


class ShardedBuffer:
    def __init__(self, name: str, params: Sequence[torch.nn.Parameter], rows: int, own_row: int,
                 dtype: torch.dtype, device, atom_of):
        self.name = name
        self.params = list(params)
        self.rows = rows
        self.own_row = own_row
        self.columns: Dict[int, Columns] = {}
        offset = 0
        for param in self.params:
            atom = int(atom_of(param))
            self.columns[param.ds_id] = Columns(offset, atom)
            offset += atom
        self.width = offset
        self.data = torch.zeros(rows, max(offset, 0), dtype=dtype, device=device)
        # stream -> event after the latest access there. Keyed by the stream's identity on the device (streams
        # compare equal by it), not by the Python object: CUDA hands out a new wrapper at every current_stream().
        self._host_events: Dict[object, object] = {}
        self.note_host_access()

    # ------------------------------------------------------------------------ ordering on the device
    def note_host_access(self) -> None:
        """The calling (training) thread has just enqueued reads or writes of this buffer on its current stream."""
        stream = streams.current()
        if stream is not None:
            self._host_events[streams.key(stream)] = streams.record(stream)

    def host_events(self) -> list:
        """What a communication job touching this buffer waits on (empty where there are no streams)."""
        return list(self._host_events.values())

    # ---------------------------------------------------------------------------------- views
    @property
    def own(self) -> torch.Tensor:
        """The rank's own atoms, contiguous: the flat buffer DeepSpeed's step and checkpoints use."""
        return self.data[self.own_row]

    def own_atom(self, param) -> torch.Tensor:
        c = self.columns[param.ds_id]
        return self.data[self.own_row].narrow(0, c.offset, c.atom)

    def atoms(self, param) -> torch.Tensor:
        """[rows, atom] strided view of one parameter's shard."""
        c = self.columns[param.ds_id]
        return self.data[:, c.offset:c.offset + c.atom]

    def column_chunks(self, max_elements: int) -> Iterator[Tuple[int, int]]:
        """Column ranges [start, end) whose all-row block holds at most `max_elements` (at least one column),
        so that a once-per-step flow over the whole buffer needs scratch of one bucket, not one shard."""
        step = max(1, max_elements // max(self.rows, 1))
        for start in range(0, self.width, step):
            yield start, min(self.width, start + step)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def __contains__(self, param) -> bool:
        return getattr(param, "ds_id", None) in self.columns
