"""Chunked attention's block skipping at the causal edge.

A key block whose first position equals the last query position of a query block holds that
query's own key (``n <= m``): it must be computed, not skipped. That happens for one query at a
block boundary (a decode step at position 8 over key blocks of 8) and for query and key blocks of
different sizes (queries 0-3 in a block, keys 3-5 in another).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE

from transformer_jax.model.ops import attention as attn

# name: (T, S, first query position, block_q, block_k)
CASES = {
    "decode_query_at_a_key_block_start": (1, 16, 8, 1, 8),
    "query_and_key_blocks_of_different_sizes": (12, 12, 0, 4, 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_key_block_starting_at_the_last_query_of_a_block_is_not_skipped(case):
    t, s, p, block_q, block_k = CASES[case]
    b, n, kv, h = 2, 4, 2, 8
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32)
    k = jax.random.normal(ks[1], (b, kv, s, h), jnp.float32)
    v = jax.random.normal(ks[2], (b, kv, s, h), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(p, p + t), (b, t))
    # The case happens: some query block's last position is some key block's first.
    last_q = np.asarray(positions[0]).reshape(-1, block_q)[:, -1]
    assert set(last_q) & set(range(0, s, block_k))
    weights = jnp.linspace(-1.0, 1.0, h)  # every output feature matters to the gradients

    def outputs_and_grads(fn):
        def loss(q, k, v):
            out = fn(q, k, v)
            return (out * weights).sum(), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True),
                                  compiler_options=FAST_COMPILE)(q, k, v)
        return [np.asarray(x) for x in (out, *grads)]

    got = outputs_and_grads(lambda q, k, v: attn.chunked_attention(
        q, k, v, q_positions=positions, block_q=block_q, block_k=block_k))
    want = outputs_and_grads(lambda q, k, v: attn.attention(q, k, v, q_positions=positions,
                                                            impl="xla"))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)
