"""Which `mpu` AsyncHZP accepts: Ulysses sequence parallelism's state (ALST), and nothing else.

ALST (`UlyssesSPAttentionHF.register_with_transformers`, HF Trainer and Accelerate with `sp_size`) passes
DeepSpeed's `parallel_state_sp` module as the `mpu`. Under it stock ZeRO-3 partitions and reduces over the
sequence-data-parallel group, which that module makes the whole world, so AsyncHZP's layout over the world applies
unchanged; SP groups are consecutive ranks, inside one node whenever `sp` divides the node size. DeepSpeed tells
this kind of mpu from a Megatron-style one by `initialize_sequence_parallel` (`deepspeed.utils.groups`); so do we.

Refused by name, before any collective: a Megatron-style mpu (tensor or pipeline groups), an SP state whose
sequence-data-parallel group is not the world, and DeepSpeed's other SP path (a device mesh from `mesh_param`, or
`data_parallel_size` with `sequence_parallel_size` in the ds_config), where ZeRO spans one mesh dimension only.
"""

from __future__ import annotations

from ..errors import AsyncHZPConfigError

_SUPPORTED = ("the one mpu async_hzp accepts is Ulysses sequence parallelism's state (DeepSpeed's "
              "deepspeed.runtime.sequence_parallel.parallel_state_sp, which "
              "UlyssesSPAttentionHF.register_with_transformers returns)")


def is_sequence_parallel_state(mpu) -> bool:
    """DeepSpeed's own test (`deepspeed.utils.groups`): an SP state module has `initialize_sequence_parallel`."""
    return mpu is not None and hasattr(mpu, "initialize_sequence_parallel")


def sequence_parallel_size(mpu, world_size: int) -> int:
    """Ulysses SP's degree for `deepspeed.initialize(mpu=...)`: 1 without an mpu; raises for any mpu AsyncHZP
    cannot train with."""
    if mpu is None:
        return 1
    if not is_sequence_parallel_state(mpu):
        raise AsyncHZPConfigError("mpu", "is a Megatron-style model-parallel unit (tensor or pipeline groups); model "
                                  f"parallelism is not supported with async_hzp: {_SUPPORTED}.",
                                  "remove the async_hzp section to train with this mpu, or train without it.")
    sp = int(mpu.get_sequence_parallel_world_size())
    sdp = int(mpu.get_sequence_data_parallel_world_size())
    if sdp != world_size:
        raise AsyncHZPConfigError("mpu", f"is Ulysses sequence parallelism's state with a sequence-data-parallel group "
                                  f"of {sdp} ranks, not the world ({world_size}); async_hzp places its shards over "
                                  "the whole world, as DeepSpeed's parallel_state_sp builds it.",
                                  "set up sequence parallelism with parallel_state_sp.initialize_sequence_parallel "
                                  "(register_with_transformers does), or remove the async_hzp section.")
    return sp


def refuse_device_mesh(ds_config: dict, mesh_param) -> None:
    """DeepSpeed's mesh SP path makes ZeRO's group the mesh's data-parallel dimension, not the world."""
    if mesh_param:
        raise AsyncHZPConfigError("mesh_param", f"is {mesh_param!r}: DeepSpeed's device-mesh sequence parallelism "
                                  "partitions ZeRO over the mesh's data-parallel dimension only; async_hzp supports "
                                  "Ulysses sequence parallelism through ALST's mpu, over the whole world.",
                                  "pass mpu= from UlyssesSPAttentionHF.register_with_transformers instead of "
                                  "mesh_param, or remove the async_hzp section.")
    if "data_parallel_size" in ds_config and "sequence_parallel_size" in ds_config:
        raise AsyncHZPConfigError("sequence_parallel_size", "with data_parallel_size in the ds_config builds "
                                  "DeepSpeed's device-mesh sequence parallelism, which partitions ZeRO over the "
                                  "mesh's data-parallel dimension only; async_hzp supports Ulysses sequence "
                                  "parallelism through ALST's mpu, over the whole world.",
                                  "remove data_parallel_size and sequence_parallel_size from the ds_config and pass "
                                  "mpu= from UlyssesSPAttentionHF.register_with_transformers, or remove the "
                                  "async_hzp section.")
