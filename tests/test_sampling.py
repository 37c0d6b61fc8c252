"""Property tests for transformer_jax.sampling.

Every jitted function below is built once at module scope and always called with the same
shapes, so hypothesis examples only feed new data (drawn from a seed) and never recompile.
Expected values come from independent float64 numpy implementations in this file.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from transformer_jax.decode import sampling

B = 8  # batch rows
V = 32  # vocab for the filter tests
N = 256  # draws per row (one key each) when sampling repeatedly
SCALES = [0.3, 1.0, 3.0, 8.0]  # logit spreads: near-flat to very peaked

SETTINGS = settings(max_examples=30, deadline=None)


def _sample_many(logits, keys, temperature, top_k, top_p, min_p):
    """[N] shared keys -> [N, B] tokens, one full-batch draw per key."""
    return jax.vmap(
        lambda key: sampling.sample(
            logits, key, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
        )
    )(keys)


sample_many = jax.jit(_sample_many, static_argnames=("top_k",))
top_k_mask = jax.jit(sampling.top_k_mask, static_argnums=1)
top_k_mask_rows = jax.jit(sampling.top_k_mask)
top_p_mask = jax.jit(sampling.top_p_mask)
min_p_mask = jax.jit(sampling.min_p_mask)
sample_rows = jax.jit(sampling.sample_with_logprobs)  # every setting traced, incl. per-row k
sample_rows_static_k = jax.jit(sampling.sample_with_logprobs, static_argnames=("top_k",))


def make_logits(seed: int, scale: float, *, rows: int = B, vocab: int = V, neg_inf_frac=0.0):
    """Random float32 logits [rows, vocab]; optionally some -inf entries (never a row's max)."""
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(rows, vocab)) * scale).astype(np.float32)
    if neg_inf_frac:
        drop = rng.random((rows, vocab)) < neg_inf_frac
        drop[np.arange(rows), logits.argmax(-1)] = False
        logits[drop] = -np.inf
    return logits


def make_keys(seed: int, n: int) -> jax.Array:
    return jax.random.split(jax.random.PRNGKey(seed), n)


def np_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    e = np.exp(row - row.max())
    return e / e.sum()


def np_top_k_keep(row: np.ndarray, k: int) -> np.ndarray:
    keep = np.zeros(row.shape, bool)
    keep[np.argsort(-row, kind="stable")[:k]] = True
    return keep


def np_top_p_keep(row: np.ndarray, p: float, margin: float = 1e-5) -> np.ndarray | None:
    """Smallest descending-probability prefix with mass >= p; None if p is too close to a
    cumulative sum for float32 to decide the same way."""
    probs = np_softmax(row)
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    if p >= 1.0:
        m = len(row)
    else:
        if np.min(np.abs(cumulative - p)) < margin:
            return None
        m = min(int(np.searchsorted(cumulative, p, side="left")) + 1, len(row))
    keep = np.zeros(row.shape, bool)
    keep[order[:m]] = True
    return keep & np.isfinite(row)


def np_min_p_keep(row: np.ndarray, min_p: float, margin: float = 1e-4) -> np.ndarray | None:
    probs = np_softmax(row)
    ratio = probs / probs.max()
    keep = ratio >= min_p
    if min_p > 0:
        others = np.arange(len(row)) != np.argmax(row)
        with np.errstate(divide="ignore"):
            gap = np.abs(np.log(ratio[others]) - np.log(min_p))
        if np.any(gap < margin):
            return None
    return keep & np.isfinite(row)


def np_sampling_distribution(row, temperature, top_k, top_p, min_p):
    """The filtered, renormalised distribution the sampler must draw from (None: ambiguous)."""
    scaled = row.astype(np.float64) / temperature
    keep = np_top_k_keep(scaled, top_k)
    scaled = np.where(keep, scaled, -np.inf)
    keep_p = np_top_p_keep(scaled, top_p, margin=1e-4)
    if keep_p is None:
        return None
    scaled = np.where(keep_p, scaled, -np.inf)
    keep_m = np_min_p_keep(scaled, min_p)
    if keep_m is None:
        return None
    return np_softmax(np.where(keep_m, scaled, -np.inf))


def chi2_upper(df: int, z: float = 4.75) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at ~1e-6 upper tail."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * np.sqrt(c)) ** 3


# ---------------------------------------------------------------------------------------------
# top-k


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from(SCALES), k=st.sampled_from([1, 3, 8]))
def test_top_k_keeps_and_emits_only_k_most_likely(seed, scale, k):
    logits = make_logits(seed, scale)
    masked = np.asarray(top_k_mask(logits, k))
    expected = np.stack([np_top_k_keep(r, k) for r in logits])
    np.testing.assert_array_equal(np.isfinite(masked), expected)
    np.testing.assert_array_equal(masked[expected], logits[expected])

    tokens = np.asarray(sample_many(logits, make_keys(seed, N), 2.0, k, None, None))
    chex.assert_shape(tokens, (N, B))
    assert tokens.dtype == np.int32
    assert expected[np.arange(B)[None, :], tokens].all()
    if k > 1 and scale <= 1.0:
        # At temperature 2 on a flat-ish row, more than one of the k tokens must show up.
        assert all(len(np.unique(tokens[:, b])) > 1 for b in range(B))


def test_top_k_tie_rule_keeps_all_tied_with_kth():
    logits = np.array([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]], np.float32)
    kept = np.isfinite(np.asarray(sampling.top_k_mask(logits, 2)))
    np.testing.assert_array_equal(kept[0], logits[0] >= 2.0)


# ---------------------------------------------------------------------------------------------
# top-p

p_values = st.one_of(st.floats(1e-3, 1.0), st.just(1.0))


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from(SCALES),
    ps=st.lists(p_values, min_size=B, max_size=B),
    neg_inf_frac=st.sampled_from([0.0, 0.3]),
)
def test_top_p_keeps_smallest_prefix_reaching_p(seed, scale, ps, neg_inf_frac):
    logits = make_logits(seed, scale, neg_inf_frac=neg_inf_frac)
    p = np.asarray(ps, np.float32)
    masked = np.asarray(top_p_mask(logits, p))
    kept = np.isfinite(masked)
    for b in range(B):
        row, keep = logits[b], kept[b]
        probs = np_softmax(row)
        # Properties that hold regardless of float32 rounding at the boundary.
        assert keep[np.argmax(row)]
        assert not keep[~np.isfinite(row)].any()
        assert row[keep].min() >= row[~keep].max(initial=-np.inf)  # a descending prefix
        assert probs[keep].sum() >= p[b] - 1e-5
        assert probs[keep].sum() - probs[keep].min() < p[b] + 1e-5 or p[b] >= 1.0
        np.testing.assert_array_equal(masked[b][keep], row[keep])
        expected = np_top_p_keep(row, float(p[b]))
        if expected is not None:
            np.testing.assert_array_equal(keep, expected, err_msg=f"row {b}, p={p[b]}")


def test_top_p_one_is_identity_and_tiny_p_keeps_top_token():
    logits = make_logits(0, 8.0)
    np.testing.assert_array_equal(np.asarray(sampling.top_p_mask(logits, 1.0)), logits)
    kept = np.isfinite(np.asarray(sampling.top_p_mask(logits, 1e-9)))
    np.testing.assert_array_equal(kept, logits == logits.max(-1, keepdims=True))


# ---------------------------------------------------------------------------------------------
# min-p

min_p_values = st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 1.0]))


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from(SCALES),
    mps=st.lists(min_p_values, min_size=B, max_size=B),
    neg_inf_frac=st.sampled_from([0.0, 0.3]),
)
def test_min_p_keeps_exactly_tokens_above_fraction_of_max(seed, scale, mps, neg_inf_frac):
    logits = make_logits(seed, scale, neg_inf_frac=neg_inf_frac)
    min_p = np.asarray(mps, np.float32)
    masked = np.asarray(min_p_mask(logits, min_p))
    kept = np.isfinite(masked)
    for b in range(B):
        assert kept[b][np.argmax(logits[b])]
        expected = np_min_p_keep(logits[b], float(min_p[b]))
        if expected is not None:
            np.testing.assert_array_equal(kept[b], expected, err_msg=f"row {b}, min_p={min_p[b]}")
        np.testing.assert_array_equal(masked[b][kept[b]], logits[b][kept[b]])


# ---------------------------------------------------------------------------------------------
# temperature / greedy


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from(SCALES))
def test_temperature_zero_is_argmax_and_tiny_temperature_matches_it(seed, scale):
    logits = make_logits(seed, scale)
    argmax = logits.argmax(-1)
    keys = make_keys(seed, N)
    greedy = np.asarray(sampling.sample(logits, None, temperature=0))
    np.testing.assert_array_equal(greedy, argmax)

    zeros = np.zeros(B, np.float32)
    tokens = np.asarray(sample_many(logits, keys, zeros, 4, 0.5, 0.2))
    np.testing.assert_array_equal(tokens, np.broadcast_to(argmax, (N, B)))

    top2 = np.sort(logits, -1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-3  # rows whose argmax is unambiguous at t=1e-6
    tiny = np.full(B, 1e-6, np.float32)
    tokens = np.asarray(sample_many(logits, keys, tiny, 4, 0.5, 0.2))
    np.testing.assert_array_equal(tokens[:, clear], np.broadcast_to(argmax, (N, B))[:, clear])


def test_apply_temperature_divides_and_leaves_zero_rows():
    logits = make_logits(1, 2.0, rows=3)
    t = np.array([0.5, 0.0, 2.0], np.float32)
    out = np.asarray(sampling.apply_temperature(logits, t))
    np.testing.assert_allclose(out, logits / np.array([[0.5], [1.0], [2.0]], np.float32))


# ---------------------------------------------------------------------------------------------
# determinism

FLAT_V = 1024
flat_sample = jax.jit(functools.partial(sampling.sample, temperature=1.0))


@SETTINGS
@given(seeds=st.lists(st.integers(0, 2**31 - 1), min_size=2, max_size=2, unique=True))
def test_same_key_same_tokens_different_keys_differ(seeds):
    flat = np.zeros((B, FLAT_V), np.float32)
    k0, k1 = (jax.random.PRNGKey(s) for s in seeds)
    a, a2, b = (np.asarray(flat_sample(flat, k)) for k in (k0, k0, k1))
    np.testing.assert_array_equal(a, a2)
    assert not np.array_equal(a, b)  # all 8 rows equal by chance: probability 1024**-8
    assert len(np.unique(a)) > 1  # one shared key still gives independent rows

    rows0, rows1 = jax.random.split(k0, B), jax.random.split(k1, B)
    c, c2, d = (np.asarray(flat_sample(flat, k)) for k in (rows0, rows0, rows1))
    np.testing.assert_array_equal(c, c2)
    assert not np.array_equal(c, d)


# ---------------------------------------------------------------------------------------------
# the sampler draws from the filtered, renormalised distribution

DIST_V = 6
DIST_ROWS = 4
DIST_DRAWS = 6000
DIST_TOP_K = 5


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    temps=st.lists(st.sampled_from([0.5, 1.0, 1.7]), min_size=DIST_ROWS, max_size=DIST_ROWS),
    ps=st.lists(st.sampled_from([0.6, 0.9, 1.0]), min_size=DIST_ROWS, max_size=DIST_ROWS),
    mps=st.lists(st.sampled_from([0.0, 0.05, 0.3]), min_size=DIST_ROWS, max_size=DIST_ROWS),
)
def test_sampling_frequencies_match_filtered_distribution(seed, temps, ps, mps):
    logits = make_logits(seed, 1.5, rows=DIST_ROWS, vocab=DIST_V)
    t, p, m = (np.asarray(x, np.float32) for x in (temps, ps, mps))
    expected = [
        np_sampling_distribution(logits[b], float(t[b]), DIST_TOP_K, float(p[b]), float(m[b]))
        for b in range(DIST_ROWS)
    ]
    assume(all(e is not None for e in expected))
    tokens = np.asarray(sample_many(logits, make_keys(seed, DIST_DRAWS), t, DIST_TOP_K, p, m))
    for b in range(DIST_ROWS):
        counts = np.bincount(tokens[:, b], minlength=DIST_V)
        want = expected[b] * DIST_DRAWS
        assert counts[expected[b] == 0].sum() == 0, (b, counts, expected[b])
        # Pool rare tokens so every chi-square bin has a reasonable expected count.
        big = want >= 5
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(want[big], want[~big].sum())
        obs, exp = obs[exp > 0], exp[exp > 0]
        if len(exp) < 2:
            continue
        stat = float(((obs - exp) ** 2 / exp).sum())
        assert stat < chi2_upper(len(exp) - 1), (b, stat, counts, want)


# ---------------------------------------------------------------------------------------------
# per-row settings


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from(SCALES),
    temps=st.lists(st.sampled_from([0.0, 0.3, 1.0, 2.0]), min_size=B, max_size=B),
    ps=st.lists(p_values, min_size=B, max_size=B),
    mps=st.lists(min_p_values, min_size=B, max_size=B),
    ks=st.lists(st.integers(1, V), min_size=B, max_size=B),
)
def test_per_row_settings_match_running_each_row_alone(seed, scale, temps, ps, mps, ks):
    logits = make_logits(seed, scale)
    t, p, m = (np.asarray(x, np.float32) for x in (temps, ps, mps))
    k = np.asarray(ks, np.int32)
    keys = make_keys(seed, B)

    np.testing.assert_array_equal(
        np.isfinite(np.asarray(top_k_mask_rows(logits, k))),
        np.stack([np_top_k_keep(logits[b], int(k[b])) for b in range(B)]),
    )
    tokens, _ = sample_rows(logits, keys, temperature=t, top_k=k, top_p=p, min_p=m)
    tokens = np.asarray(tokens)
    for b in range(B):
        alone, _ = sample_rows(
            logits[b : b + 1],
            keys[b : b + 1],
            temperature=t[b : b + 1],
            top_k=k[b : b + 1],
            top_p=p[b : b + 1],
            min_p=m[b : b + 1],
        )
        assert int(alone[0]) == tokens[b], (b, t[b], k[b], p[b], m[b])
    # Python-scalar settings (trace-time filter skipping, scalar greedy path) agree as well.
    for b in range(2):
        alone = sampling.sample(
            logits[b : b + 1],
            keys[b : b + 1],
            temperature=float(t[b]),
            top_k=int(k[b]),
            top_p=float(p[b]),
            min_p=float(m[b]),
        )
        assert int(alone[0]) == tokens[b], (b, t[b], k[b], p[b], m[b])
    np.testing.assert_array_equal(tokens[t == 0], logits.argmax(-1)[t == 0])


def test_typed_keys_match_raw_keys():
    logits = make_logits(3, 1.0)
    raw = make_keys(3, B)
    typed = jax.random.wrap_key_data(raw)
    chex.assert_trees_all_equal(
        sampling.sample(logits, raw, temperature=1.0, top_p=0.9),
        sampling.sample(logits, typed, temperature=1.0, top_p=0.9),
    )
    chex.assert_trees_all_equal(
        sampling.sample(logits, raw[0], temperature=1.0),
        sampling.sample(logits, typed[0], temperature=1.0),
    )


# ---------------------------------------------------------------------------------------------
# log-probs


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from(SCALES))
def test_logprobs_are_raw_log_softmax_of_chosen_tokens(seed, scale):
    logits = make_logits(seed, scale)
    keys = make_keys(seed, B)
    t = np.full(B, 0.7, np.float32)
    tokens, logprobs = sample_rows_static_k(
        logits, keys, temperature=t, top_k=5, top_p=np.float32(0.8)
    )
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    x = logits.astype(np.float64)
    log_softmax = x - x.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    np.testing.assert_allclose(logprobs, log_softmax[np.arange(B), tokens], rtol=1e-5, atol=1e-5)
    plain = sampling.sample(logits, keys, temperature=t, top_k=5, top_p=np.float32(0.8))
    np.testing.assert_array_equal(tokens, np.asarray(plain))


# ---------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": None}, "temperature"),
        ({"temperature": np.array([1.0, -1.0])}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -3}, "top_k"),
        ({"top_k": V + 1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": np.array([1, 0])}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.2}, "top_p"),
        ({"top_p": np.array([0.5, 1.01])}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"min_p": np.array([[0.1]])}, "min_p"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_validate_sampling_args_rejects(kwargs, name):
    args = {"temperature": 1.0, "top_k": None, "top_p": None, "min_p": None, "vocab_size": V}
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        sampling.validate_sampling_args(**args)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0},
        {"temperature": 2, "top_k": V, "top_p": 1e-6, "min_p": 1.0},
        {
            "temperature": np.array([0.0, 1.0]),
            "top_k": np.array([1, V]),
            "top_p": jnp.array([0.1, 1.0]),
            "min_p": np.array([0.0, 1.0]),
        },
    ],
)
def test_validate_sampling_args_accepts(kwargs):
    sampling.validate_sampling_args(vocab_size=V, **kwargs)


def test_functions_reject_bad_python_scalars_and_shapes():
    logits = make_logits(0, 1.0)
    key = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match="top_k"):
        sampling.top_k_mask(logits, V + 1)
    with pytest.raises(ValueError, match="top_p"):
        sampling.top_p_mask(logits, 0.0)
    with pytest.raises(ValueError, match="min_p"):
        sampling.min_p_mask(logits, 2.0)
    with pytest.raises(ValueError, match="temperature"):
        sampling.apply_temperature(logits, -1.0)
    with pytest.raises(ValueError, match="temperature"):
        sampling.sample(logits, key, temperature=-1.0)
    with pytest.raises(ValueError, match="key"):
        sampling.sample(logits, None, temperature=1.0)
    with pytest.raises(ValueError, match="key"):
        sampling.sample(logits, make_keys(0, B + 1), temperature=1.0)
    with pytest.raises(ValueError, match="top_p"):
        sampling.sample(logits, key, temperature=1.0, top_p=np.full(B + 1, 0.5, np.float32))
    with pytest.raises(ValueError, match="logits"):
        sampling.sample(logits[0], key, temperature=1.0)


def test_sequence_keys_of_seeds_are_jax_random_keys():
    """Per-sequence seeds take a numpy path (no device program per serving request): the same
    raw key data as ``jax.random.key(seed)``, at the ends of the uint32 range too."""
    from transformer_jax.decode.prompts import sequence_keys

    seeds = [0, 1, 7, 12345, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1]
    got = sequence_keys(seeds, len(seeds))
    want = np.stack([np.asarray(jax.random.key_data(jax.random.key(np.uint32(s))))
                     for s in seeds])
    assert got.dtype == np.uint32 and got.shape == (len(seeds), 2)
    np.testing.assert_array_equal(got, want)
    # An int seed folds in the sequence index, unchanged (uint32 seeds through one cached
    # program, others eagerly).
    for seed in (0, 3, 2 ** 31, 2 ** 32 - 1, 2 ** 32 + 5, -2):
        got = sequence_keys(seed, 3)
        assert got.dtype == np.uint32 and got.shape == (3, 2)
        for b in range(3):
            np.testing.assert_array_equal(got[b], np.asarray(jax.random.key_data(
                jax.random.fold_in(jax.random.key(seed), b))), err_msg=f"seed {seed}, row {b}")
