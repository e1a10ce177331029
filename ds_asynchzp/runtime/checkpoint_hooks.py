"""The optimizer's side of a checkpoint load: the parameter shards quiet before Stage 3 rewrites their own rows,
refreshed after it as after a step, and the persistent parameters gathered again after a save or load, as stock
does. What a checkpoint holds and how it is written and checked is the engine's side (`checkpoint.py`).

A mixin of `HierarchicalZeroOptimizer` (placed before Stage 3 in its bases).
"""

from __future__ import annotations


class CheckpointHooks:
    def load_state_dict(self, *args, **kwargs):
        self.hzp_quiesce_params()
        result = super().load_state_dict(*args, **kwargs)
        self._hzp_refresh_loaded()
        return result

    def _load_universal_checkpoint(self, *args, **kwargs):
        self.hzp_quiesce_params()
        result = super()._load_universal_checkpoint(*args, **kwargs)
        self._hzp_refresh_loaded()
        return result

    def _hzp_refresh_loaded(self) -> None:
        """After a checkpoint load: the trainable shards refreshed as after a step (quantized where the step's
        refresh is), so a resumed run holds exactly what the saved run held; frozen ones exactly, as built."""
        for placement in self.hzp_placements:
            placement.shards.zero_padding()
            frozen = [b for b in placement.shards.buffers if b is not placement.trainable]
            if placement.trainable is not None:
                placement.boundary.start_refresh([placement.trainable])
            placement.boundary.refresh_params(frozen, exact=True)
        self.hzp_partition_watch.record()

    def checkpoint_event_epilogue(self):
        # As stock: persistent parameters come back gathered after a checkpoint save or load.
        self._hzp_regather_persistent(gather_missing=True)


__all__ = ["CheckpointHooks"]
