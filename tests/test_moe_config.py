"""The ``moe`` table: which layers are sparse, and every refusal naming its field."""

from __future__ import annotations

import pytest

from transformer_jax.model.config import ModelConfig, parse_override
from transformer_jax.model.fields import MoE

SMALL = dict(vocab_size=32, d_model=16, n_layers=4, n_heads=2, d_ff=32)


def test_sparse_layers_follow_the_step_and_the_dense_list():
    # HF's rule: layer i sparse iff (i + 1) % step == 0 and i not in mlp_only_layers.
    for step, dense in ((1, ()), (2, ()), (1, (0, 3)), (2, (1,)), (2, (3,)), (3, ())):
        config = ModelConfig(**SMALL, moe=MoE(4, 2, 8, sparse_step=step, dense_layers=dense))
        want = tuple(i for i in range(4) if (i + 1) % step == 0 and i not in dense)
        assert config.sparse_layers == want, (step, dense)
    assert ModelConfig(**SMALL).sparse_layers == ()


def test_a_toml_table_becomes_the_moe_fields():
    config = ModelConfig.from_dict({**SMALL, "moe": {"n_experts": 5, "top_k": 2, "d_ff": 8,
                                                     "dense_layers": [1]}})
    assert config.moe == MoE(5, 2, 8, dense_layers=(1,))
    assert ModelConfig.from_dict(config.to_dict()) == config  # a checkpoint's saved config
    with pytest.raises(ValueError, match="moe is a table"):
        parse_override(ModelConfig, "moe", "8")


@pytest.mark.parametrize("moe, message", [
    (dict(n_experts=0, top_k=1, d_ff=8), "moe.n_experts must be a positive int"),
    (dict(n_experts=4, top_k=5, d_ff=8), r"moe.top_k \(5\) must be at most moe.n_experts"),
    (dict(n_experts=4, top_k=1, d_ff=8, shared_d_ff=-1), "moe.shared_d_ff must be an int"),
    (dict(n_experts=4, top_k=1, d_ff=8, shared_gate=True), "moe.shared_gate needs"),
    (dict(n_experts=4, top_k=1, d_ff=8, renormalize="yes"), "moe.renormalize must be a bool"),
    (dict(n_experts=4, top_k=1, d_ff=8, correction_bias=1), "moe.correction_bias must be a"),
    (dict(n_experts=4, top_k=1, d_ff=8, scale_input="yes"), "moe.scale_input must be a bool"),
    (dict(n_experts=4, top_k=1, d_ff=8, sparse_step=0), "moe.sparse_step must be"),
    (dict(n_experts=4, top_k=1, d_ff=8, dense_layers=[-1]), "moe.dense_layers must be"),
    (dict(n_experts=4, top_k=1, d_ff=8, dense_layers=[0, 1, 2, 3]), "no layer is sparse"),
    (dict(n_experts=4, top_k=1, d_ff=8, expert_count=3), "expert_count"),
])
def test_bad_moe_fields_are_refused_by_name(moe, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ModelConfig(**SMALL, moe=moe)


def test_the_model_level_refusals():
    moe = MoE(4, 2, 8, dense_layers=(0,))
    with pytest.raises(ValueError, match="moe needs a gated ffn"):
        ModelConfig(**SMALL, ffn="relu", moe=moe)
    # Dense and sparse layers scan as separate layer groups (``test_layer_groups``).
    mixed = ModelConfig(**SMALL, scan_layers=True, moe=moe)
    assert [(g.period[0].ffn, g.repeats) for g in mixed.layer_groups()] == [
        ("dense", 1), ("moe", SMALL["n_layers"] - 1)]
    with pytest.raises(ValueError, match="moe_impl must be one of"):
        ModelConfig(**SMALL, moe_impl="fast")


def test_an_expert_axis_is_refused_for_a_dense_model_or_experts_it_does_not_divide():
    from transformer_jax.decode.weights import check_tensor_parallel

    check_tensor_parallel(ModelConfig(**SMALL, moe=MoE(4, 2, 8)), 1, 2)
    with pytest.raises(ValueError, match="this model has no moe layers"):
        check_tensor_parallel(ModelConfig(**SMALL), 1, 2)
    with pytest.raises(ValueError, match="moe.n_experts divisible by 2; got moe.n_experts=5"):
        check_tensor_parallel(ModelConfig(**SMALL, moe=MoE(5, 2, 8)), 2, 2)
    with pytest.raises(ValueError, match="expert axis size must be a positive int"):
        check_tensor_parallel(ModelConfig(**SMALL, moe=MoE(4, 2, 8)), 1, 0)
