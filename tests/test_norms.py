"""Tests for transformer_jax.ops norms against an independent numpy formula.

Inputs of small magnitude make ``eps`` dominate the statistics, so a norm that drops or
misplaces ``eps`` (outside the square root, added to the RMS instead of the mean square)
fails here even though it passes on unit-scale inputs.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.model.ops import layer_norm, rms_norm

D = 8


def numpy_rms_norm(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def numpy_layer_norm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, eps: float
                     ) -> np.ndarray:
    x = x.astype(np.float64)
    centred = x - x.mean(axis=-1, keepdims=True)
    return centred / np.sqrt(np.mean(centred**2, axis=-1, keepdims=True) + eps) * scale + bias


@pytest.fixture
def inputs():
    rng = np.random.default_rng(0)
    scale = (1 + 0.5 * rng.standard_normal(D)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(D)).astype(np.float32)
    # Rows from tiny (eps dominates: the output shrinks with the input) to unit scale.
    magnitudes = np.array([1e-4, 1e-3, 3e-3, 1e-2, 1.0], np.float32)[:, None]
    x = (rng.standard_normal((5, D)) * magnitudes).astype(np.float32)
    return x, scale, bias


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 1e-2])
def test_rms_norm_matches_the_formula_where_eps_dominates(inputs, eps):
    x, scale, _ = inputs
    got = np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(scale), eps=eps))
    np.testing.assert_allclose(got, numpy_rms_norm(x, scale, eps), rtol=2e-5, atol=1e-7)


def test_rms_norm_of_a_tiny_row_is_small_not_unit_scale(inputs):
    """With mean(x^2) << eps the output is about x / sqrt(eps): a norm without eps would
    rescale the row to unit RMS."""
    x, scale, _ = inputs
    row = x[:1]  # RMS about 1e-4, mean square 1e-8 << eps = 1e-5
    out = np.asarray(rms_norm(jnp.asarray(row), jnp.ones(D), eps=1e-5))
    rms = float(np.sqrt(np.mean(out.astype(np.float64) ** 2)))
    assert rms < 0.05, rms
    np.testing.assert_allclose(out, row / np.sqrt(np.mean(row.astype(np.float64) ** 2) + 1e-5),
                               rtol=2e-5)


@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_layer_norm_matches_the_formula_where_eps_dominates(inputs, eps):
    x, scale, bias = inputs
    got = np.asarray(layer_norm(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(bias), eps=eps))
    np.testing.assert_allclose(got, numpy_layer_norm(x, scale, bias, eps), rtol=2e-5,
                               atol=1e-6)


def test_zero_rows_give_exactly_zero_and_bias():
    scale = jnp.linspace(0.5, 2.0, D)
    bias = jnp.linspace(-1.0, 1.0, D)
    zeros = jnp.zeros((3, D))
    out = np.asarray(rms_norm(zeros, scale))
    assert np.all(np.isfinite(out)) and np.array_equal(out, np.zeros((3, D), np.float32))
    # A constant row has zero variance: layer norm gives exactly the bias.
    const = jnp.full((2, D), 3.0)
    out = np.asarray(layer_norm(const, scale, bias))
    np.testing.assert_array_equal(out, np.broadcast_to(np.asarray(bias), (2, D)))
    np.testing.assert_array_equal(np.asarray(layer_norm(zeros, scale, bias)),
                                  np.broadcast_to(np.asarray(bias), (3, D)))


def test_bfloat16_inputs_use_float32_statistics():
    x = jnp.full((1, D), 1e-3, jnp.bfloat16)
    out = rms_norm(x, jnp.ones(D, jnp.bfloat16), eps=1e-6)
    assert out.dtype == jnp.bfloat16
    expected = numpy_rms_norm(np.asarray(x, np.float32), np.ones(D), 1e-6)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=1e-2)
