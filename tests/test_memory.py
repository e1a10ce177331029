"""Per-rank model-state bytes, measured from the tensors that hold them, against
ds_asynchzp.formulas.sizing.model_state_bytes_per_rank (docs/ARCHITECTURE.md, "Who owns which state")."""

import pytest

from ds_asynchzp.formulas.sizing import model_state_bytes_per_rank

WORLD, NODE = 8, 4
RTOL = 0.02
ROLES = ("param_shard", "grad_shard", "master", "optimizer_state")
# DeepSpeed's own partitions are views into the shards: they must add nothing.
VIEW_ROLES = ("param_primary", "param_secondary", "grad_primary")


@pytest.mark.parametrize("case, d_p, d_g, d_o", [
    ("asynchzp_gas2", NODE, NODE, WORLD),
    ("asynchzp_p2_g4_o4_gas2", 2, 4, 4),  # optimizer group inside a node, replicated over both nodes
])
def test_asynchzp_model_states_match_formula(launched, case, d_p, d_g, d_o):
    for rank_result in launched(WORLD, NODE):
        result = rank_result[case]
        measured = result["model_state_bytes"]
        # Padded per parameter to a multiple of the optimizer group (DeepSpeed's partition group).
        elements = result["elements_by_optimizer_group"]
        # fp32 run: 4-byte params and gradient accumulation in the model dtype; every parameter (frozen too) is
        # in the parameter shard, only trainable ones have gradients and optimizer states.
        predicted = model_state_bytes_per_rank(elements["all"], WORLD, d_p, d_g, d_o, param_bytes=4,
                                               grad_accum_bytes=4, num_trainable=elements["trainable"])
        for role in ROLES:
            assert measured[role] == pytest.approx(predicted[role], rel=RTOL), role
        for role in VIEW_ROLES:
            assert measured.get(role, 0) == 0, role
        assert measured["total"] == pytest.approx(predicted["total"], rel=RTOL)
