"""Per-rank model-state bytes, measured from the tensors that hold them, against
ds_asynchzp.sizing.model_state_bytes_per_rank (docs/ARCHITECTURE.md, "Memory")."""

import pytest

from ds_asynchzp.sizing import model_state_bytes_per_rank

WORLD, NODE = 8, 4
RTOL = 0.02
PARAM_ROLES = ("param_primary", "param_shard")  # these also hold frozen parameters


def test_asynchzp_model_states_match_formula(launched):
    for rank_result in launched(WORLD, NODE):
        result = rank_result["asynchzp_gas4"]
        measured, elements = result["model_state_bytes"], result["elements"]
        # fp32 run: 4-byte params; all parameters (frozen too) are partitioned, only trainable ones have
        # gradients and optimizer states.
        by_trainable = model_state_bytes_per_rank(elements["trainable"], WORLD, NODE, NODE, WORLD, param_bytes=4)
        by_all = model_state_bytes_per_rank(elements["all"], WORLD, NODE, NODE, WORLD, param_bytes=4)
        predicted = {role: (by_all if role in PARAM_ROLES else by_trainable)[role]
                     for role in ("param_primary", "param_shard", "grad_shard", "grad_primary", "master",
                                  "optimizer_state")}
        for role, value in predicted.items():
            assert measured[role] == pytest.approx(value, rel=RTOL), role
        assert measured["total"] == pytest.approx(sum(predicted.values()), rel=RTOL)
