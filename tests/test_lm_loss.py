"""``ops.lm_loss``: the chunked LM-head loss equals the full one, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import FAST_COMPILE

from transformer_jax.model.ops.layouts import OutFirst
from transformer_jax.model.ops.lm_loss import lm_head_cross_entropy_sums


def _full_sums(x, head, targets, mask, z_loss, head_layout):
    """The full loss, written independently: [B, T, V] float32 logits, then optax."""
    w = head if head_layout == "DV" else head.T
    logits = jnp.einsum("BTD,DV->BTV", x, w, preferred_element_type=jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    weights = jnp.ones_like(ce) if mask is None else mask.astype(jnp.float32)
    z = z_loss * jnp.sum(weights * jax.nn.logsumexp(logits, axis=-1) ** 2)
    return jnp.sum(weights * ce), z, jnp.sum(weights)


def _inputs(b=3, t=7, d=16, v=50, seed=0):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=(b, t, d)), jnp.float32)
    head = jnp.asarray(r.normal(size=(d, v)) * 0.3, jnp.float32)
    targets = jnp.asarray(r.integers(0, v, (b, t)))
    mask = jnp.asarray(r.random((b, t)) < 0.7)
    return x, head, targets, mask


# chunk sizes along T = 7: a ragged last chunk (3 + 3 + 1), one exact chunk, one longer than T,
# one position per chunk
@pytest.mark.parametrize(("head_layout", "chunk_size", "masked"),
                         [("DV", 3, True), ("VD", 7, True), ("DV", 64, False), ("VD", 1, False)])
def test_chunked_loss_equals_full_loss_and_gradients(head_layout, chunk_size, masked):
    x, head, targets, mask = _inputs()
    mask = mask if masked else None
    head = head if head_layout == "DV" else head.T
    z_loss = 1e-2

    def total(fn):
        def f(x, head):
            ce, z, count = fn(x, head)
            return ce + z, (ce, z, count)
        grad_fn = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)
        return jax.jit(grad_fn, compiler_options=FAST_COMPILE)(x, head)

    (_, got), got_grads = total(lambda x, h: lm_head_cross_entropy_sums(  # VD: a tied table
        x, OutFirst(h) if head_layout == "VD" else h, targets, mask, chunk_size=chunk_size,
        z_loss=z_loss))
    (_, want), want_grads = total(lambda x, h: _full_sums(x, h, targets, mask, z_loss,
                                                          head_layout))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    if masked:  # a masked position contributes nothing, so its gradient is zero
        assert (np.asarray(got_grads[0])[~np.asarray(mask)] == 0).all()


def test_matches_training_cross_entropy_sums():
    from transformer_jax.train.loss import cross_entropy_sums  # noqa: PLC0415

    x, head, targets, mask = _inputs(seed=1)
    logits = jnp.einsum("BTD,DV->BTV", x, head)
    for z_loss in (0.0, 1e-4):
        want = cross_entropy_sums(logits, targets, mask.astype(jnp.float32), z_loss)
        got = lm_head_cross_entropy_sums(x, head, targets, mask, chunk_size=5, z_loss=z_loss)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_backward_does_not_store_the_logits():
    # Compile only: B*T = 4096 tokens, V = 8192: full float32 logits are 128 MiB.
    b, t, d, v = 4, 1024, 64, 8192
    x = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    head = jax.ShapeDtypeStruct((d, v), jnp.float32)
    targets = jnp.zeros((b, t), jnp.int32)

    def temp_bytes(fn):
        grad = jax.grad(lambda x, h: sum(fn(x, h)[:2]), argnums=(0, 1))
        return jax.jit(grad).lower(x, head).compile().memory_analysis().temp_size_in_bytes

    full = temp_bytes(lambda x, h: _full_sums(x, h, targets, None, 1e-4, "DV"))
    chunked = temp_bytes(lambda x, h: lm_head_cross_entropy_sums(
        x, h, targets, chunk_size=32, z_loss=1e-4))  # [4, 32] tokens a chunk
    logits = 4 * b * t * v
    assert full >= logits
    # Measured: 256 MiB full vs 12 MiB chunked ([4, 32, 8192] float32 chunk blocks).
    assert chunked < logits / 4 and chunked * 10 < full, (full, chunked)


def test_rejects_bad_arguments():
    x, head, targets, _ = _inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        lm_head_cross_entropy_sums(x, head, targets, chunk_size=0)
    with pytest.raises(AssertionError):
        lm_head_cross_entropy_sums(x, head.T, targets, chunk_size=4)
    with pytest.raises(AssertionError):  # a [D, V] head is no [V, D] table
        lm_head_cross_entropy_sums(x, OutFirst(head), targets, chunk_size=4)
