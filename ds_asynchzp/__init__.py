"""AsyncHZP: hierarchical ZeRO for DeepSpeed.

Parameters and gradients are sharded inside a node, optimizer states over a larger group (by default the whole
data-parallel world), so per-micro-step traffic stays on the fast intra-node links and only one gradient
reduction and one parameter refresh per optimizer step cross nodes.

* ``ds_asynchzp.initialize(...)``: same arguments and return value as ``deepspeed.initialize``; honours the
  top-level ``"async_hzp"`` section of the ds_config.
* ``ds_asynchzp.register()``: makes plain ``deepspeed.initialize`` (HF Trainer, Accelerate) honour it.
* ``ds_asynchzp.sequence_parallel_loss(loss_sum, num_tokens, group)``: the loss of a sequence split over a Ulysses
  sequence-parallel group (ALST), through ``deepspeed.comm``.
* ``ds_asynchzp.ledger``: bytes of every collective, intra- vs inter-node.
* ``ds_asynchzp.add_observer(observer)``: a tool's callbacks around engine construction, forward, backward and
  step (``runtime/observers.py``; also named by the ``DS_ASYNCHZP_OBSERVERS`` environment variable).
* ``ds_asynchzp.install_cpu_zeropp_quantizer()``: lets stock ZeRO++ (qwZ, qgZ) run on CPU ranks (call it before
  ``deepspeed.initialize``).

The runtime (and with it DeepSpeed) is imported on first use of one of those names, so that the tooling
(``asynchzp-plan``, the emulated-network cleanup, the config checker) starts without importing DeepSpeed.
"""

from __future__ import annotations

import importlib

from .config import ResolvedLayout, resolve_layout, section_from_ds_config
from .errors import AsyncHZPConfigError, AsyncHZPNotActiveError, GradientReadMismatch, PartitionWriteError

__version__ = "0.1.0"

# name -> module that defines it (imported lazily: each of these imports DeepSpeed).
_LAZY = {
    "initialize": "ds_asynchzp.runtime.api",
    "register": "ds_asynchzp.runtime.api",
    "unregister": "ds_asynchzp.runtime.api",
    "is_registered": "ds_asynchzp.runtime.api",
    "resolve_for_initialize": "ds_asynchzp.runtime.api",
    "AsyncHZPEngine": "ds_asynchzp.runtime.engine",
    "HierarchicalZeroOptimizer": "ds_asynchzp.runtime.optimizer",
    "SUPPORTED_DEEPSPEED_VERSION": "ds_asynchzp.platform.deepspeed_internals",
    "install_cpu_zeropp_quantizer": "ds_asynchzp.platform.deepspeed_internals",
    "sequence_parallel_loss": "ds_asynchzp.runtime.sp_loss",
    "add_observer": "ds_asynchzp.runtime.observers",
    "remove_observer": "ds_asynchzp.runtime.observers",
}


def __getattr__(name: str):
    if name == "ledger":
        return importlib.import_module("ds_asynchzp.platform.ledger")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ds_asynchzp' has no attribute {name!r}")


__all__ = [
    "initialize", "register", "unregister", "is_registered", "resolve_for_initialize", "ledger",
    "AsyncHZPConfigError", "AsyncHZPNotActiveError", "GradientReadMismatch", "PartitionWriteError", "AsyncHZPEngine",
    "HierarchicalZeroOptimizer",
    "ResolvedLayout", "resolve_layout", "section_from_ds_config", "SUPPORTED_DEEPSPEED_VERSION", "__version__",
    "install_cpu_zeropp_quantizer", "sequence_parallel_loss", "add_observer", "remove_observer",
]
