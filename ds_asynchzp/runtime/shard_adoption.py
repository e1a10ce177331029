"""Stage 3's construction hooks: each family re-cut over its optimizer group, and Stage 3's flat parameter and
gradient buffers made views of the own rows of the family's shard buffers, so that every state exists once.

Stage 3's constructor calls these while it runs, after the optimizer has built every family's groups and
parameter shards (`Placement`) and before it has built the flows: they create the trainable shard (`trainable`)
and the gradient shard (`grads`) of each family with trainable parameters on this rank.

A mixin of `HierarchicalZeroOptimizer` (placed before Stage 3 in its bases).
"""

from __future__ import annotations

from ..platform.deepspeed_internals import (is_zero_param, partition_group_of, rehome_stage3_grad_partitions,
                                            rehome_stage3_param_flats, repartition, stage3_sub_groups)
from ..state.grad_shards import GradShards


class ShardAdoption:
    def initialize_ds_offload(self, *args, **kwargs):
        offload = super().initialize_ds_offload(*args, **kwargs)
        module = args[0] if args else kwargs["module"]
        for placement in self.hzp_placements:
            group = placement.groups.optimizer
            if group.size < placement.family.layout.world:
                # zero.Init (or the conversion above) partitioned over the whole data-parallel world, from rank 0's
                # weights; re-cut every parameter of the family over its optimizer group.
                params = [p for p in module.parameters() if is_zero_param(p) and placement.owns(p)]
                for param in params:
                    placement.repartitioned_from[param.ds_id] = partition_group_of(param)
                repartition(params, group.handle)
        return offload

    def _create_fp16_partitions_with_defragmentation(self, fp16_param_groups):
        super()._create_fp16_partitions_with_defragmentation(fp16_param_groups)
        # Each sub-group holds one partition group's parameters, hence one family's; a family's buffer takes its
        # sub-groups in Stage 3's order, so each sub-group's flat buffer is a column range of one own row.
        sub_groups = stage3_sub_groups(self)
        for placement in self.hzp_placements:
            params = [p for group in sub_groups for p in group if placement.owns(p)]
            if params:
                placement.trainable = placement.shards.adopt_trainable(params)
        flats = []
        for group in sub_groups:
            placement = next(p for p in self.hzp_placements if p.owns(group[0]))
            first = placement.trainable.columns[group[0].ds_id].offset
            flats.append(placement.trainable.own.narrow(0, first, sum(p.partition_numel() for p in group)))
        trainable = self._hzp_trainable_placements()
        rehome_stage3_param_flats(self, flats, trainable[0].trainable.own if len(trainable) == 1 else None)

    def _setup_for_real_optimizer(self):
        super()._setup_for_real_optimizer()
        trainable, views = self._hzp_trainable_placements(), {}
        for placement in trainable:
            params = placement.trainable.params
            # With optimizer replicas, the first one alone carries a gradient kept from the last step into the
            # window (the cross-node sum all-reduces the replicas' own atoms). The shard lives on the device also
            # with optimizer offload (where Stage 3 would put its gradient partitions on the host).
            placement.grads = GradShards(placement.family.layout, placement.groups.dp_rank, params,
                                         self.gradient_accumulation_dtype, placement.trainable.data.device,
                                         carries_previous=placement.groups.outer_replica.rank == 0)
            for param in params:
                views[param.ds_id] = placement.grads.buffer.own_atom(param)
        # Stage 3 reads its flat gradient buffer only in the fp16 overflow check, which `has_overflow` replaces
        # when the gradients live in several shards.
        rehome_stage3_grad_partitions(self, views, trainable[0].grads.own if len(trainable) == 1 else None)


__all__ = ["ShardAdoption"]
