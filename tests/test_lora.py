"""LoRA adapters: shapes, a zero B leaves the model unchanged, training moves only the adapters,
merging equals applying, and the optimizer keeps moments for the adapters only."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import TINY, random_params

from transformer_jax.model import lora
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import Transformer, stack_blocks
from transformer_jax.train.loss import cross_entropy

CONFIG = TINY.replace(max_seq_len=32)
D, N, K, H, F, L = 32, 4, 2, 8, 48, 2
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)


@functools.cache
def _forward(config: ModelConfig):
    """The config's forward of TOKENS, jitted (flax op by op compiles each of its ops)."""
    return jax.jit(lambda params: Transformer(config).apply({"params": params}, TOKENS).logits)


def _logits(config: ModelConfig, params) -> np.ndarray:
    return np.asarray(_forward(config)(params))


def _leaves(tree) -> dict[str, np.ndarray]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}


@pytest.fixture(scope="module")
def base():
    """Drawn with numpy (helpers.random_params): init_params op by op compiles each op."""
    return jax.device_put(random_params(CONFIG))


def test_config_validates_targets():
    assert lora.LoraConfig(targets="q, v").targets == ("q", "v")
    assert lora.LoraConfig(rank=4, alpha=8).scale == 2.0
    with pytest.raises(ValueError, match="did you mean 'gate'"):
        lora.LoraConfig(targets=("q", "gat"))
    with pytest.raises(ValueError, match="rank"):
        lora.LoraConfig(rank=0)
    with pytest.raises(ValueError, match="repeat"):
        lora.LoraConfig(targets=("q", "q"))
    cfg = lora.LoraConfig(rank=2, alpha=4.0, targets=("o", "down"))
    assert lora.LoraConfig.from_dict(cfg.to_dict()) == cfg


def test_adapter_shapes_unrolled_and_scanned(base):
    cfg = lora.LoraConfig(rank=3)
    expected = {  # (module, name): (A shape, B shape)
        ("attn", "q_proj"): ((D, 3), (3, N, H)), ("attn", "k_proj"): ((D, 3), (3, K, H)),
        ("attn", "v_proj"): ((D, 3), (3, K, H)), ("attn", "o_proj"): ((N, H, 3), (3, D)),
        ("mlp", "gate"): ((D, 3), (3, F)), ("mlp", "up"): ((D, 3), (3, F)),
        ("mlp", "down"): ((F, 3), (3, D)),
    }
    unrolled = lora.init_adapters(CONFIG, cfg, base, jax.random.key(1))
    stacked = lora.init_adapters(CONFIG.replace(scan_layers=True), cfg,
                                 stack_blocks(base, CONFIG), jax.random.key(1))
    assert sorted(unrolled) == ["blocks_0", "blocks_1"] and list(stacked) == ["blocks"]
    for (module, name), (a, b) in expected.items():
        got = unrolled["blocks_1"][module][name]
        assert (got["a"].shape, got["b"].shape) == (a, b)
        assert not np.any(np.asarray(got["b"])) and np.std(np.asarray(got["a"])) > 0
        got = stacked["blocks"][module][name]
        assert (got["a"].shape, got["b"].shape) == ((L, *a), (L, *b))
    assert lora.adapter_count(unrolled) == lora.adapter_count(stacked)


def test_zero_b_leaves_the_logits_unchanged(base):
    cfg = lora.LoraConfig(rank=4)
    adapters = lora.init_adapters(CONFIG, cfg, base, jax.random.key(1))
    np.testing.assert_array_equal(_logits(CONFIG, lora.apply_adapters(base, adapters, cfg)),
                                  _logits(CONFIG, base))


def test_scanned_layout_applies_the_same_update(base):
    cfg = lora.LoraConfig(rank=2, targets=("q", "o", "down"))
    adapters = lora.init_adapters(CONFIG, cfg, base, jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.1, adapters)  # nonzero B
    unrolled = lora.apply_adapters(base, adapters, cfg)
    scanned = lora.apply_adapters(stack_blocks(base, CONFIG), stack_blocks(adapters, CONFIG), cfg)
    for name, value in _leaves(stack_blocks(unrolled, CONFIG)).items():
        np.testing.assert_allclose(_leaves(scanned)[name], value, rtol=1e-6, atol=1e-6)
    assert not np.array_equal(unrolled["blocks_0"]["attn"]["q_proj"],
                              base["blocks_0"]["attn"]["q_proj"])
    scanned_logits = _logits(CONFIG.replace(scan_layers=True), scanned)
    np.testing.assert_allclose(scanned_logits, _logits(CONFIG, unrolled), atol=1e-5)


def test_training_moves_only_the_adapters_and_merge_equals_apply(base):
    cfg = lora.LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "gate", "down"))
    frozen = lora.freeze_base(base, jnp.bfloat16)
    tree = {lora.BASE: frozen, lora.ADAPTERS: lora.init_adapters(CONFIG, cfg, frozen,
                                                                 jax.random.key(1))}
    tx = lora.optimizer(optax.adam(3e-2))
    state = tx.init(tree)
    sizes = sum(x.size for x in jax.tree.leaves(state) if x.ndim > 0)
    assert sizes == 2 * lora.adapter_count(tree[lora.ADAPTERS])  # Adam's mu and nu only

    def loss_fn(tree):
        logits = Transformer(CONFIG).apply({"params": lora.model_params(tree, cfg)},
                                           TOKENS[:, :-1]).logits
        return cross_entropy(logits, TOKENS[:, 1:])

    @jax.jit
    def step(tree, state):
        loss, grads = jax.value_and_grad(loss_fn)(tree)
        updates, state = tx.update(grads, state, tree)
        return optax.apply_updates(tree, updates), state, loss

    start = tree
    losses = []
    for _ in range(4):
        tree, state, loss = step(tree, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    for name, value in _leaves(start[lora.BASE]).items():  # bit-identical base, still bf16
        got = _leaves(tree[lora.BASE])[name]
        assert got.dtype == value.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, value)
    b = tree[lora.ADAPTERS]["blocks_0"]["mlp"]["down"]["b"]
    assert np.any(np.asarray(b) != 0)

    applied = lora.apply_adapters(tree[lora.BASE], tree[lora.ADAPTERS], cfg)
    merged = lora.merge(tree[lora.BASE], tree[lora.ADAPTERS], cfg, dtype=jnp.float32)
    assert {x.dtype for x in jax.tree.leaves(applied["blocks_0"]["attn"])} == {
        jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}  # adapted float32, k_proj bf16
    np.testing.assert_allclose(_logits(CONFIG, merged), _logits(CONFIG, applied), atol=1e-5)
    assert not np.allclose(_logits(CONFIG, applied),
                           _logits(CONFIG, jax.tree.map(lambda x: x.astype(jnp.float32),
                                                        frozen)), atol=1e-3)


def test_missing_target_param_is_named(base):
    cfg = lora.LoraConfig(rank=2, targets=("q",))
    adapters = lora.init_adapters(CONFIG, cfg, base, jax.random.key(0))
    with pytest.raises(ValueError, match="blocks_1"):
        lora.apply_adapters(base, {"blocks_0": adapters["blocks_0"]}, cfg)
    with pytest.raises(ValueError, match="no blocks"):
        lora.init_adapters(CONFIG, cfg, {"embed": base["embed"]}, jax.random.key(0))


def test_adapter_shardings_follow_the_target_matrices(base):
    from transformer_jax.parallel import sharding

    mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
    config = CONFIG.replace(scan_layers=True)
    cfg = lora.LoraConfig(rank=2)
    adapters = lora.init_adapters(config, cfg, stack_blocks(base, CONFIG), jax.random.key(0))
    shardings = lora.adapter_shardings(adapters, sharding.param_shardings(config, mesh))
    specs = jax.tree.map(lambda s: tuple(s.spec), shardings)["blocks"]
    # q_proj [L, D, N, H] is (layers, embed, heads, head_dim) -> (None, fsdp, tensor, None).
    assert specs["attn"]["q_proj"] == {"a": (None, "fsdp", None),
                                       "b": (None, None, "tensor", None)}
    assert specs["attn"]["o_proj"] == {"a": (None, "tensor", None, None),
                                       "b": (None, None, "fsdp")}
    assert specs["mlp"]["down"] == {"a": (None, "tensor", None), "b": (None, None, "fsdp")}
    placed = jax.device_put(adapters, shardings)
    assert lora.adapter_count(placed) == lora.adapter_count(adapters)
