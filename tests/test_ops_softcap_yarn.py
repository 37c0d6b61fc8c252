"""Logit soft-capping (attention and LM head), traced sliding windows and YaRN RoPE.

Soft-capped attention: the einsum reference against a numpy loop, the chunked path (forward and
its hand-written backward) against the reference; the kernels that cannot cap refuse. A window
passed as a traced scalar gives the static window's result. The capped LM-head loss against the
unchunked loss on capped logits. YaRN's frequencies and attention factor against transformers'
own ``ROPE_INIT_FUNCTIONS["yarn"]``.
"""

import math
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE

from transformer_jax.model.config import RopeScaling
from transformer_jax.model.ops import attention as attn
from transformer_jax.model.ops import positions
from transformer_jax.model.ops.chunked_attention import chunked_attention
from transformer_jax.model.ops.layouts import OutFirst
from transformer_jax.model.ops.lm_loss import lm_head_cross_entropy_sums

CAP = 1.5


def _jit(fn, **kw):
    return jax.jit(fn, compiler_options=FAST_COMPILE, **kw)


@pytest.fixture(scope="module")
def inputs():
    """GQA (4 query heads on 2 kv heads), logits large enough (|x| up to ~6) that a cap of 1.5
    changes them, packed segments with padding, queries starting at position 3."""
    b, t, s, n, kv, h = 2, 9, 12, 4, 2, 8
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(b, t, n, h)) * 2.0, jnp.float32)
    k = jnp.asarray(r.normal(size=(b, kv, s, h)) * 2.0, jnp.float32)
    v = jnp.asarray(r.normal(size=(b, kv, s, h)), jnp.float32)
    qp = jnp.broadcast_to(jnp.arange(3, 3 + t), (b, t))
    kseg = jnp.asarray([[1] * 5 + [2] * 6 + [0], [1] * 12])
    qseg = kseg[:, 3:]
    weights = jnp.asarray(r.normal(size=(b, t, n, h)), jnp.float32)
    return dict(q=q, k=k, v=v, qp=qp, qseg=qseg, kseg=kseg, weights=weights)


def _numpy_capped_attention(q, k, v, mask, cap):
    """Textbook attention with capped logits, one query and head at a time (float64)."""
    b, t, n, h = q.shape
    g = n // k.shape[1]
    out = np.zeros((b, t, n, h))
    for bi in range(b):
        for r in range(n):
            for ti in range(t):
                if not mask[bi, ti].any():
                    continue
                x = k[bi, r // g] @ q[bi, ti, r] / math.sqrt(h)
                x = np.where(mask[bi, ti], cap * np.tanh(x / cap), -np.inf)
                w = np.exp(x - x.max())
                out[bi, ti, r] = (w / w.sum()) @ v[bi, r // g]
    return out


def _outputs_and_grads(fns, d, *args):
    """For each fn(q, k, v, *args): its output and the gradients of ``sum(out * weights)`` with
    respect to q, k and v; all in one compiled program."""
    def run(q, k, v, *args):
        results = []
        for fn in fns:
            out, vjp = jax.vjp(lambda q, k, v, fn=fn: fn(q, k, v, *args), q, k, v)
            results.append((out, vjp(d["weights"])))
        return results

    return _jit(run)(d["q"], d["k"], d["v"], *args)


@pytest.fixture(scope="module")
def capped(inputs):
    """Outputs and gradients, window 5, of: chunked attention with blocks of 4 queries x 3 keys
    (3 x 4 blocks, some skipped by the causal edge and the window), the reference, the entry
    point's chunked path (one block each way), and the reference without the cap."""
    structure = dict(q_positions=inputs["qp"], q_segments=inputs["qseg"],
                     k_segments=inputs["kseg"], window=5)
    return dict(zip(("chunked", "xla", "entry", "uncapped"), _outputs_and_grads([
        lambda q, k, v: chunked_attention(q, k, v, **structure, softcap=CAP, block_q=4,
                                          block_k=3),
        lambda q, k, v: attn.attention(q, k, v, **structure, softcap=CAP, impl="xla"),
        lambda q, k, v: attn.attention(q, k, v, **structure, softcap=CAP, impl="chunked"),
        lambda q, k, v: attn.attention(q, k, v, **structure, impl="xla")], inputs), strict=True))


def test_capped_reference_matches_numpy(inputs, capped):
    d = inputs
    kp = jnp.broadcast_to(jnp.arange(12), (2, 12))
    mask = attn.attention_mask(d["qp"], kp, q_segments=d["qseg"], k_segments=d["kseg"], window=5)
    want = _numpy_capped_attention(*map(np.asarray, (d["q"], d["k"], d["v"], mask)), CAP)
    np.testing.assert_allclose(capped["xla"][0], want, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(capped["uncapped"][0]) - want).max() > 0.1  # the cap matters here
    np.testing.assert_allclose(attn.softcap(jnp.asarray([-100.0, 0.3, 100.0]), 2.0),
                               2.0 * np.tanh(np.array([-50.0, 0.15, 50.0])), rtol=1e-6)


@pytest.mark.parametrize("impl", ["chunked", "entry"])
def test_capped_chunked_matches_reference_outputs_and_gradients(capped, impl):
    for g, w in zip(jax.tree.leaves(capped[impl]), jax.tree.leaves(capped["xla"]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def _raises_softcap(**kw):
    q = jnp.zeros((1, 4, 2, 8), jnp.float32)
    k = jnp.zeros((1, 1, 4, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"softcap.*impl='xla' or 'chunked'"):
        attn.attention(q, k, k, q_positions=jnp.arange(4)[None], softcap=CAP, **kw)


def test_kernels_without_a_cap_refuse_it_and_auto_avoids_them(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    _raises_softcap(impl="cudnn")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    _raises_softcap(impl="pallas")
    monkeypatch.undo()
    q = jnp.zeros((1, 128, 4, 64), jnp.bfloat16)
    k = jnp.zeros((1, 2, 128, 64), jnp.bfloat16)
    assert attn.choose_impl(q, k, "gpu") == "cudnn"
    assert attn.choose_impl(q, k, "gpu", softcap=CAP) == "xla"
    monkeypatch.setitem(sys.modules, "tokamax", types.SimpleNamespace())  # as if installed
    assert attn.choose_impl(q, k, "tpu", softcap=CAP) == "mosaic"  # tokamax caps
    monkeypatch.setitem(sys.modules, "tokamax", None)  # JAX's TPU kernel cannot cap
    assert attn.choose_impl(q, k, "tpu", softcap=CAP) == "xla"
    assert attn.choose_impl(q, k, "cpu", softcap=CAP) == "xla"


def test_tokamax_kernels_get_the_cap(monkeypatch):
    """tokamax is not installed here: a stand-in module records what the kernel path passes."""
    seen = {}

    def fake_kernel(q, k, v, *, mask, scale, logits_soft_cap, implementation):
        seen.update(cap=logits_soft_cap, impl=implementation, k=k.shape)
        return jnp.ones_like(q)

    monkeypatch.setitem(sys.modules, "tokamax",
                        types.SimpleNamespace(dot_product_attention=fake_kernel))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q = jnp.zeros((1, 4, 2, 8), jnp.float32)
    k = jnp.zeros((1, 1, 4, 8), jnp.float32)
    for impl, name in (("mosaic", "mosaic"), ("pallas", "triton")):
        out = attn.attention(q, k, k, q_positions=jnp.arange(4)[None], softcap=CAP, impl=impl)
        assert seen == dict(cap=CAP, impl=name, k=(1, 4, 1, 8))
        assert (np.asarray(out) == 1).all()


def test_traced_window_equals_static_window(inputs):
    d = inputs
    structure = dict(q_positions=d["qp"], q_segments=d["qseg"], k_segments=d["kseg"],
                     softcap=CAP)
    kp = jnp.broadcast_to(jnp.arange(12), (2, 12))
    traced = [  # window a traced argument: one compilation for both values
        lambda q, k, v, w: attn.attention(q, k, v, **structure, window=w, impl="xla"),
        lambda q, k, v, w: chunked_attention(q, k, v, **structure, window=w, block_q=4,
                                             block_k=3)]
    static = _outputs_and_grads([
        lambda q, k, v, w=w: attn.attention(q, k, v, **structure, window=w, impl="xla")
        for w in (4, None)], d)
    for w, want in ((4, static[0]), (2 ** 30, static[1])):  # window 2**30 is no window
        for name, got in zip(("xla", "chunked"), _outputs_and_grads(traced, d, jnp.int32(w)),
                             strict=True):
            for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5, err_msg=name)
    assert np.abs(np.asarray(static[0][0]) - np.asarray(static[1][0])).max() > 1e-2
    mask = _jit(lambda w: attn.attention_mask(d["qp"], kp, window=w))(jnp.int32(4))
    np.testing.assert_array_equal(mask, attn.attention_mask(d["qp"], kp, window=4))


# LM-head loss ------------------------------------------------------------------------------------

def test_capped_lm_loss_equals_unchunked_capped_loss():
    """A ragged last chunk (T = 7 in chunks of 4), a tied [V, D] head."""
    b, t, dm, vocab, cap, z_loss = 3, 7, 16, 50, 5.0, 1e-2
    head_layout, chunk_size = "VD", 4
    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(b, t, dm)), jnp.float32)
    head = jnp.asarray(r.normal(size=(dm, vocab)), jnp.float32)  # logits ~ +-4 sigma: capped
    head = head if head_layout == "DV" else head.T
    targets = jnp.asarray(r.integers(0, vocab, (b, t)))
    mask = jnp.asarray(r.random((b, t)) < 0.7)

    def full(x, head):
        w = head if head_layout == "DV" else head.T
        logits = cap * jnp.tanh((x @ w) / cap)
        lse = jax.scipy.special.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(mask * (lse - target)) + z_loss * jnp.sum(mask * lse ** 2)

    def chunked(x, head, cap=cap):
        table = OutFirst(head) if head_layout == "VD" else head  # a tied [V, D] table
        ce, z, _ = lm_head_cross_entropy_sums(x, table, targets, mask, chunk_size=chunk_size,
                                              z_loss=z_loss, logit_softcap=cap)
        return ce + z

    (want, want_grads), (got, got_grads), uncapped = _jit(lambda x, head: (
        jax.value_and_grad(full, argnums=(0, 1))(x, head),
        jax.value_and_grad(chunked, argnums=(0, 1))(x, head), chunked(x, head, None)))(x, head)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert abs(float(uncapped) - float(want)) > 1.0  # the cap matters here


# YaRN --------------------------------------------------------------------------------------------

# name: (base, original length, RopeScaling yarn fields); one head size, so one compilation.
YARN_HEAD_DIM = 32
YARN_CASES = {
    "defaults": (10000.0, 64, dict(factor=4.0)),
    "betas_no_truncate": (1e6, 4096, dict(factor=8.0, beta_fast=16.0, beta_slow=2.0,
                                          truncate=False)),
    "mscale": (10000.0, 64, dict(factor=40.0, mscale=0.707, mscale_all_dim=1.0)),
    "given_attention_factor": (5e5, 2048, dict(factor=2.0, attention_factor=1.3)),
    # the ramp's ends fall outside [0, H - 1] and are clipped
    "ramp_clipped": (10.0, 4096, dict(factor=4.0, beta_fast=1000.0, beta_slow=1.0)),
}


@pytest.fixture(scope="module")
def hf_yarn():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def compute(base, original, fields, head_dim=YARN_HEAD_DIM):
        params = {"rope_type": "yarn", "rope_theta": base,
                  "original_max_position_embeddings": original}
        params.update(fields)
        config = transformers.Qwen3Config(head_dim=head_dim, hidden_size=2 * head_dim,
                                          num_attention_heads=2, num_key_value_heads=1,
                                          max_position_embeddings=4 * original,
                                          rope_parameters=params)
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        return inv_freq.numpy(), factor

    return compute


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_frequencies_and_attention_factor_match_transformers(case, hf_yarn):
    head_dim, (base, original, fields) = YARN_HEAD_DIM, YARN_CASES[case]
    want_freqs, want_factor = hf_yarn(base, original, fields)
    scaling = RopeScaling("yarn", original_max_len=original, **fields)
    got, plain = _jit(lambda: [positions.rope_frequencies(head_dim, base, sc)
                               for sc in (scaling, None)])()
    np.testing.assert_allclose(got, want_freqs, rtol=1e-6)
    assert positions.rope_attention_factor(scaling) == pytest.approx(want_factor, rel=1e-12)
    assert not np.allclose(got, plain)  # yarn rescales some frequencies


def test_yarn_rope_scales_cos_and_sin_and_takes_given_frequencies(hf_yarn):
    head_dim, (base, original, fields) = YARN_HEAD_DIM, YARN_CASES["mscale"]
    inv_freq, factor = hf_yarn(base, original, fields)
    scaling = RopeScaling("yarn", original_max_len=original, **fields)
    r = np.random.default_rng(2)
    x = r.normal(size=(2, 5, 3, head_dim)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4], [7, 100, 250, 3, 0]])
    # HF's rotation: cos/sin of [H/2] angles repeated twice, times the attention factor.
    angles = np.concatenate([pos[..., None] * inv_freq] * 2, axis=-1)[:, :, None]
    rotated_half = np.concatenate([-x[..., head_dim // 2:], x[..., :head_dim // 2]], axis=-1)
    want = x * np.cos(angles) * factor + rotated_half * np.sin(angles) * factor
    # and with frequencies and factor given as traced arrays (one layer of a scan)
    got, given = _jit(lambda x, f, a: (
        positions.apply_rope(x, jnp.asarray(pos), base=base, scaling=scaling),
        positions.apply_rope(x, jnp.asarray(pos), freqs=f, attention_factor=a)))(
        jnp.asarray(x), jnp.asarray(inv_freq), jnp.float32(factor))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(given, want, rtol=1e-5, atol=1e-5)
    assert positions.rope_attention_factor(None) == 1.0
    assert positions.rope_attention_factor(RopeScaling("llama3", 8.0)) == 1.0
