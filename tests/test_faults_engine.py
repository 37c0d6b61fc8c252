"""Engine faults of issue 34 and the properties no engine test asserted before it.

- Bad settings are refused naming the field and what it accepts (``SamplingParams`` fields of
  the wrong type or out of range, an unknown ``cache_dtype``), before anything is queued.
- A request of exactly the model's context (prompt + max_tokens = max_seq_len) is served to the
  end and finishes ``"length"``; one position more is refused.
- A stop token produced at the last allowed position finishes ``"stop"``, not ``"length"``.
- The int8 pages' pool view with transposed keys reads every token with its own scale.
- The tests' engine loops have a step limit: a request that never finishes fails the test.

One tiny engine (one layer, a 16-position context, pages of 5: the pool holds exactly the 15
positions a full-context request writes) serves every engine test here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, TINY, run_until_idle, step_until

from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.model.transformer import init_params
from transformer_jax.serving import Engine, SamplingParams
from transformer_jax.serving.paged_cache import PagedKVCache

# conftest: generate and the engine's step compile with FAST_COMPILE for the module.
pytestmark = pytest.mark.usefixtures("fast_generate_compiles", "fast_engine_compiles")

CONTEXT = 16
CONFIG = TINY.replace(n_layers=1, max_seq_len=CONTEXT)
# One slot, pages of 5 positions, 3 usable pages: a full-context request's 15 written
# positions exactly (its last token is never written); one page table width, one chunk bucket.
ENGINE = dict(num_slots=1, num_pages=4, page_size=5, token_budget=9, min_context=CONTEXT)



@pytest.fixture(scope="module")
def model():
    init = jax.jit(init_params, static_argnums=0, compiler_options=FAST_COMPILE)
    return CONFIG, decode.prepare(CONFIG, init(CONFIG, jax.random.key(0)))


@pytest.fixture(scope="module")
def shared_engine(model):
    engine = Engine(*model, **ENGINE)
    assert engine.scheduler.pool.capacity * engine.page_size == CONTEXT - 1
    return engine


@pytest.fixture
def engine(shared_engine):
    """The module's engine; after the test it must be idle with every page back."""
    yield shared_engine
    assert shared_engine.idle
    shared_engine.check_no_leaks()


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, n).tolist()


class Events:
    """Each request's events, in order."""

    def __init__(self):
        self.events = {}

    def __call__(self, event):
        self.events.setdefault(event.request_id, []).append(event)

    def reasons(self, rid):
        return [e.finish_reason for e in self.events[rid]]


# Bad settings ------------------------------------------------------------------------------------

BAD_PARAMS = {
    "stop_token_ids": [(2, "stop_token_ids must be a sequence of ints, got 2"),
                       (None, "stop_token_ids must be a sequence of ints"),
                       ("12", "stop_token_ids must be a sequence of ints"),
                       ((1.5,), r"stop_token_ids must be token ids in \[0, 64\), got 1.5"),
                       ([3, 64], r"stop_token_ids must be token ids in \[0, 64\), got 64"),
                       ((True,), "stop_token_ids must be token ids")],
    "temperature": [("0.5", "temperature must be a number >= 0"),
                    (None, "temperature must be a number >= 0"),
                    ([1.0, 0.5], "temperature must be a number >= 0"),
                    (-1.0, "temperature must be in")],
    "top_k": [(2.5, r"top_k must be None or an int in \[1, 64\]"),
              ("3", "top_k must be None or an int"), (0, "top_k must be in")],
    "top_p": [("x", r"top_p must be None or a number in \(0, 1\]"), (0.0, "top_p must be in")],
    "min_p": [("x", r"min_p must be None or a number in \[0, 1\]"), (1.5, "min_p must be in")],
    "max_tokens": [(2.0, "max_tokens must be a positive int, got 2.0")],
    "seed": [("1", r"seed must be an int in \[0, 2\*\*32\)")],
    "logprobs": [("yes", "logprobs must be a bool, got 'yes'"),
                 (None, "logprobs must be a bool")],
    "stop": [(None, "stop must be a sequence of non-empty strings, got None"),
             ("end", "stop must be a sequence of non-empty strings"),
             ((1,), "stop must be a sequence of non-empty strings"),
             (np.array(["end"]), "stop must be a sequence of non-empty strings")],
}


@pytest.mark.parametrize("field,value,message", [
    (field, value, message) for field, cases in BAD_PARAMS.items() for value, message in cases])
def test_bad_sampling_params_are_refused_naming_the_field(engine, field, value, message):
    """Each setting of the wrong type or range is a ValueError naming it and what it accepts
    (not a bare TypeError from deep inside), and nothing is queued."""
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=message):
        params.validate(CONFIG.vocab_size)
    with pytest.raises(ValueError, match=message):
        engine.add_request([1, 2, 3], params)
    assert engine.idle


def test_sampling_params_of_other_accepted_types_still_serve(engine):
    """Lists, sets and numpy values are sequences and numbers as well as tuples and floats."""
    SamplingParams(stop_token_ids={7}, top_k=np.int64(3), temperature=np.float32(0.5),
                   top_p=1, min_p=0, seed=np.uint32(5), logprobs=np.True_).validate(
                       CONFIG.vocab_size)
    for params in (SamplingParams(max_tokens=2, stop_token_ids=[1, 2]),
                   SamplingParams(max_tokens=2, stop_token_ids=np.array([5, 6]), stop=[])):
        params.validate(CONFIG.vocab_size)
        engine.add_request([1, 2, 3], params)
    assert len(run_until_idle(engine)) == 2
    with pytest.raises(TypeError, match="params must be a SamplingParams, got dict"):
        engine.add_request([1, 2, 3], {"max_tokens": 2})
    assert engine.idle


@pytest.mark.parametrize("cache_dtype", ["int3", "int32", "uint8", "bool", 3, "Bfloat16"])
def test_unknown_cache_dtypes_are_refused_naming_the_field(model, cache_dtype):
    message = (r"cache_dtype must be a floating dtype name \(e.g. 'bfloat16', 'float32'\) or "
               rf"'int8', got {cache_dtype!r}")
    with pytest.raises(ValueError, match=message):
        Engine(*model, **ENGINE, cache_dtype=cache_dtype)
    with pytest.raises(ValueError, match=message):
        PagedKVCache.init(CONFIG, 4, 4, dtype=cache_dtype)
    for good in ("int8", "bfloat16", jnp.float32, np.dtype("float16")):
        assert PagedKVCache.init(CONFIG, 2, 2, dtype=good).v[0].size > 0


def test_unknown_view_is_refused_before_the_weights_are_prepared(model):
    with pytest.raises(ValueError, match=r"view must be one of .*'pool'.*got 'fast'"):
        Engine(*model, **ENGINE, view="fast")


@pytest.mark.parametrize("sizes, message", [
    (dict(num_pages=1), r"num_pages must be at least 2 \(page 0 is the null page\), got 1"),
    (dict(page_size=0), "page_size must be a positive int, got 0"),
    (dict(view="fast"), r"view must be one of .*'blocks'.*got 'fast'"),
    (dict(batch=0), "batch must be a positive int, got 0"),
    (dict(num_slots=2.0), "num_slots must be a positive int, got 2.0"),
    (dict(min_context=True), "min_context must be a positive int, got True")])
def test_sizes_out_of_range_are_refused_naming_the_field(model, sizes, message):
    """The engine's and the paged cache's sizes (``check_sizes``), where each is one."""
    if "batch" not in sizes:
        with pytest.raises(ValueError, match=message):
            Engine(*model, **{**ENGINE, **sizes})
    if not {"num_slots", "min_context"} & sizes.keys():
        with pytest.raises(ValueError, match=message):
            PagedKVCache.init(CONFIG, **{"num_pages": 4, "page_size": 5, **sizes})


# The edge of the context -------------------------------------------------------------------------

# (prompt length, max_tokens) of exactly the context: from the prompt filling all but the one
# new token to a one-token prompt decoding the rest.
EXACT = [(12, 4), (15, 1), (1, 15)]


def test_a_request_of_exactly_the_context_is_served_and_one_more_is_refused(model, engine):
    events = Events()
    ids = {engine.add_request(_prompt(n, seed=n), SamplingParams(max_tokens=m), events): (n, m)
           for n, m in EXACT}
    done = run_until_idle(engine)
    config, weights = model
    for rid, (n, m) in ids.items():
        assert done[rid].finish_reason == "length", (n, m)
        assert len(done[rid].tokens) == m
        assert events.reasons(rid) == [None] * (m - 1) + ["length"]
    # The longest decode equals generate's for its prompt alone, to the last position.
    rid = next(r for r, nm in ids.items() if nm == (1, 15))
    want = generation.generate(config, weights, [_prompt(1, seed=1)], max_new_tokens=15)
    assert done[rid].tokens == want.tokens[0]

    for n, m in [(12, 5), (13, 4), (16, 1), (1, 16)]:
        with pytest.raises(ValueError, match=rf"needs {n + m} positions \(prompt {n} \+ "
                                             rf"max_tokens {m}\), more than the model's "
                                             rf"max_seq_len {CONTEXT}"):
            engine.add_request(_prompt(n, seed=0), SamplingParams(max_tokens=m))
    assert engine.idle


def _greedy(engine, prompt, max_tokens, **params):
    events = Events()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, **params), events)
    return run_until_idle(engine)[rid], events.reasons(rid)


@pytest.mark.parametrize("prompt_len,max_tokens", [(12, 4), (1, 15), (3, 5)],
                         ids=["context-end", "context-end-long-decode", "max-tokens"])
def test_a_stop_token_at_the_last_allowed_position_ends_with_stop(engine, prompt_len,
                                                                  max_tokens):
    """The token greedy decoding gives at the last position max_tokens (and, for the first two
    cases, the context) allows, taken as the stop token: the request ends "stop" with the same
    tokens, not "length"."""
    for seed in range(20):  # a prompt whose last token does not come earlier
        prompt = _prompt(prompt_len, seed=100 + seed)
        first, _ = _greedy(engine, prompt, max_tokens)
        assert first.finish_reason == "length" and len(first.tokens) == max_tokens
        if first.tokens[-1] not in first.tokens[:-1]:
            break
    else:
        pytest.fail("no prompt's last greedy token is new")
    last = first.tokens[-1]
    got, reasons = _greedy(engine, prompt, max_tokens, stop_token_ids=(last,))
    assert got.tokens == first.tokens
    assert got.finish_reason == "stop"
    assert reasons == [None] * (max_tokens - 1) + ["stop"]
    # And a stop token one position earlier still stops there.
    if max_tokens > 1 and first.tokens[-2] not in first.tokens[:-2]:
        early, _ = _greedy(engine, prompt, max_tokens, stop_token_ids=(first.tokens[-2],))
        assert (early.tokens, early.finish_reason) == (first.tokens[:-1], "stop")


# int8 pages: the pool view ----------------------------------------------------------------------

def test_int8_pool_view_reads_each_tokens_own_scale():
    """Tokens whose rows differ by up to six orders of magnitude, written into int8 pages ([K,
    P, ps, H + 2]) through a table of out-of-order pages: the pool the
    ``"pool"`` view reads gives every token's key and value within half a step of its own
    scale (max|row| / 127). Pages of H + 2 positions and P = H + 2 pages make every axis of
    the key pool the same size, so reading the scales along the wrong axis (another token's
    bytes) gives wrong values rather than a shape error."""
    h = TINY.head_dim
    config = TINY.replace(n_kv_heads=2)
    ps = num_pages = h + 2
    b, t = 2, 2 * ps
    table = np.array([[7, 2], [4, 9]], np.int32)
    cache = PagedKVCache.init(config, num_pages, ps, batch=b, pages_per_row=2, dtype="int8",
                              view="pool").with_table(table, np.zeros(b, np.int32))
    assert cache.k[1].shape == (2, num_pages, ps, h + 2) and cache.int8
    rng = np.random.default_rng(0)

    def rows():
        magnitude = 10.0 ** rng.integers(-4, 3, (b, t, 2, 1))
        return (rng.standard_normal((b, t, 2, h)) * magnitude).astype(np.float32)

    k, v = rows(), rows()
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))

    @jax.jit
    def write_and_read(cache, k, v):
        return cache.write(1, k, v, positions).pool(1, jnp.float32)

    keys, values = (np.asarray(x) for x in write_and_read(cache, k, v))
    assert keys.shape == values.shape == (2, num_pages, ps, h)
    for row in range(b):
        for pos in range(t):
            page, offset = table[row, pos // ps], pos % ps
            for name, got, want in (("key", keys[:, page, offset], k[row, pos]),
                                    ("value", values[:, page, offset], v[row, pos])):
                step_size = np.abs(want).max(-1, keepdims=True) / 127  # [K, 1]: its own
                err = np.abs(got - want)
                assert np.all(err <= 0.51 * step_size), (name, row, pos, err.max(), step_size)


# The step limit ----------------------------------------------------------------------------------

class _StuckEngine:
    """An engine whose request never finishes: every step makes a token, none is the last."""

    idle = False
    steps = 0

    class scheduler:  # noqa: N801 (stands for the engine's scheduler)
        @staticmethod
        def describe():
            return "1 waiting, 1 running"

    def step(self):
        self.steps += 1
        return []

    def run_until_idle(self, max_steps=None):
        assert max_steps is not None, "an unbounded run would never end"
        self.steps += max_steps
        return {}


def test_engine_loops_fail_at_their_step_limit_instead_of_hanging():
    stuck = _StuckEngine()
    with pytest.raises(AssertionError, match=r"step limit: 3 tokens not reached in 50 engine "
                                             r"steps \(1 waiting, 1 running\)"):
        step_until(stuck, lambda: False, max_steps=50, what="3 tokens")
    assert stuck.steps == 50
    with pytest.raises(AssertionError, match="step limit: an idle engine not reached"):
        run_until_idle(stuck, max_steps=20)
