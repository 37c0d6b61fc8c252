"""Several prompts prefilled in one engine step (the scheduler's [R, C] chunk rows): every
request decodes what the same engine prefilling one prompt at a time gives it, and what
``generate`` gives its prompt alone, token for token, seeded draws included; forks of several
prompts share one step; a small pool (pages owed to the prompts in prefill, preemption) still
serves everything without a leak; the compiled chunk shapes are the few (R, C) within the budget,
and a load after ``compile`` compiles nothing more."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, random_params, run_until_idle

from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.model import lora
from transformer_jax.serving import Engine, SamplingParams
from transformer_jax.serving import step as step_lib
from transformer_jax.serving.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("fast_generate_compiles", "fast_engine_compiles")

CONFIG = TINY.replace(max_seq_len=128)  # room for a prompt of two 64-token chunks

N_REF = 8
# 8 slots, pages of 4 positions, prompt chunks of up to 64 tokens a step (buckets 16, 32, 64):
# up to 4 prompts of <= 16 tokens, or 2 of <= 32, in one step; page tables of one width, 32
# pages (min_context = max_seq_len: each step shape compiles once, not once per width).
ENGINE = dict(num_slots=8, num_pages=96, page_size=4, token_budget=8 + 64, min_context=128)
# A small pool (24 pages and the null one: a 78-position request's 20 fit) and page tables 16
# or 32 pages wide: the small-pool test (whose loads cross widths) and the compile test run the
# same 14 greedy programs.
SMALL_POOL = {**ENGINE, "num_pages": 25, "min_context": 64}


@pytest.fixture(scope="module")
def params():
    """Drawn with numpy (``helpers.random_params``): no init program compiles."""
    return jax.device_put(random_params(CONFIG))


@pytest.fixture(scope="module")
def model(params):
    return CONFIG, decode.prepare(CONFIG, params)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY.vocab_size, n).tolist() for n in lengths]


# ``generate``'s batches: every request's prompt in one batch per sampling setting, padded to
# REF_ROWS rows with a prompt of REF_LEN tokens, so that the module's references (greedy or top-p)
# run 2 compiled programs; a prompt's draws follow its own seed in any batch.
REF_ROWS, REF_LEN = 12, 70


def _references(model, prompts, params, pad=True):
    """``generate``'s (tokens, logprobs) of each prompt under its request's sampling params."""
    config, weights = model
    out = [None] * len(prompts)
    groups = {}
    for i, p in enumerate(params):
        groups.setdefault((p.temperature, p.top_p), []).append(i)
    for (temperature, top_p), rows in groups.items():
        batch = [prompts[i] for i in rows]
        seeds = [params[i].seed for i in rows]
        if pad:
            assert len(batch) <= REF_ROWS and max(map(len, batch)) <= REF_LEN
            batch += [[1] * REF_LEN] * (REF_ROWS - len(batch))
            seeds += [0] * (REF_ROWS - len(seeds))
        got = generation.generate(config, weights, batch, max_new_tokens=N_REF,
                                  temperature=temperature, top_p=top_p, seed=seeds)
        for row, i in enumerate(rows):
            n = params[i].max_tokens
            out[i] = got.tokens[row][:n], got.logprobs[row][:n]
    return out


def _serve(engine, prompts, params):
    """Runs the requests to the end; (completions in order, the chunks of each step)."""
    chunks = []
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        if plan is not None:
            chunks.append(len(plan.chunks))
        return plan

    engine.scheduler.schedule = recording
    try:
        ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
        done = run_until_idle(engine)
    finally:
        del engine.scheduler.schedule
    engine.check_no_leaks()
    return [done[i] for i in ids], chunks


def _params(n):
    """Greedy and seeded top-p draws, with logprobs, of varied lengths."""
    return [SamplingParams(max_tokens=N_REF - i % 3, logprobs=True) if i % 2 else
            SamplingParams(max_tokens=N_REF - i % 3, temperature=0.9, top_p=0.9, seed=100 + i,
                           logprobs=True) for i in range(n)]


def test_several_prompts_per_step_equal_one_at_a_time_and_generate(model):
    # short prompts (several per step), a long one in 2 chunks, and one of 33 (a 64 bucket)
    prompts = _prompts([3, 9, 16, 5, 12, 70, 2, 33, 7, 14, 1], seed=1)
    params = _params(len(prompts))
    many, per_step = _serve(Engine(*model, **ENGINE), prompts, params)
    one, one_per_step = _serve(Engine(*model, **ENGINE, max_prefill_rows=1), prompts, params)
    assert max(per_step) == 4 and max(one_per_step) == 1
    assert sum(per_step) < sum(one_per_step) or len(per_step) < len(one_per_step)
    refs = _references(model, prompts, params)
    for prompt, a, b, (want, want_logprobs) in zip(prompts, many, one, refs, strict=True):
        assert a.tokens == b.tokens, len(prompt)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        assert a.tokens == want, len(prompt)
        np.testing.assert_allclose(a.logprobs, want_logprobs, atol=1e-4, rtol=0)


def test_forks_of_several_prompts_share_one_step(model):
    """G requests of each of 4 prompts (GRPO's rollouts, ``n`` choices): one step prefills the
    4 prompts and forks the other 3 x (G - 1) requests from their logits."""
    base = _prompts([6, 11, 4, 14], seed=2)
    prompts = [p for p in base for _ in range(2)]
    params = [SamplingParams(max_tokens=N_REF, temperature=0.9, top_p=0.9, seed=7 + i,
                             logprobs=True)
              for i in range(len(prompts))]
    engine = Engine(*model, **ENGINE)
    done, per_step = _serve(engine, prompts, params)
    assert per_step[0] == 4 and engine.scheduler.forked == 4
    alone, _ = _serve(Engine(*model, **ENGINE, max_prefill_rows=1), prompts, params)
    for a, b, ref in zip(done, alone, _references(model, prompts, params), strict=True):
        assert a.tokens == b.tokens == ref[0]
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_a_small_pool_serves_every_prompt_without_leaks(model):
    """24 pages of 4 positions for 8 slots: admissions leave the pages the prompts in prefill
    still need, decodes preempt, and everything still equals generate."""
    prompts = _prompts([20, 3, 60, 9, 50, 12, 6, 17, 56, 4], seed=3)
    params = [SamplingParams(max_tokens=N_REF) for _ in prompts]
    engine = Engine(*model, **SMALL_POOL)
    done, per_step = _serve(engine, prompts, params)
    assert max(per_step) >= 2 and engine.scheduler.preemptions > 0
    for prompt, a, ref in zip(prompts, done, _references(model, prompts, params), strict=True):
        assert a.tokens == ref[0], len(prompt)


def test_chunk_shapes_are_few_and_compile_covers_a_load(model):
    sched = Scheduler(8, 96, 4, 128, max_chunk=64)
    assert sched.chunk_shapes() == [(1, 16), (2, 16), (4, 16), (1, 32), (2, 32), (1, 64)]
    assert Scheduler(8, 96, 4, 128, max_chunk=64, max_prefill_rows=3).chunk_shapes() == \
        sched.chunk_shapes()
    assert Scheduler(8, 96, 4, 128, max_chunk=64, max_prefill_rows=1).chunk_shapes() == [
        (1, 16), (1, 32), (1, 64)]
    # the load's 70-token prompt takes the page tables of 32 pages, the others those of 16
    engine = Engine(*model, **SMALL_POOL)
    assert engine.scheduler.widths == (16, 32)
    assert engine.compile() == 2 * (1 + 6)
    compiled = step_lib.step_jit._cache_size()
    prompts = _prompts([3, 9, 16, 5, 12, 70, 2, 33, 7, 14], seed=4)
    _serve(engine, prompts, [SamplingParams(max_tokens=N_REF) for _ in prompts])
    assert step_lib.step_jit._cache_size() == compiled


def test_sliding_window_rings_with_several_prompts_per_step():
    """A model whose local layers keep per-slot rings: each chunk row writes its own slot's
    rings (idle rows none), so prompts prefilled together equal generate alone."""
    config = TINY.replace(scan_layers=True, sliding_window=6)
    model = config, decode.prepare(config, jax.device_put(random_params(config, 1)))
    prompts = _prompts([5, 13, 9, 3, 30, 11], seed=5)
    params = [SamplingParams(max_tokens=N_REF) for _ in prompts]
    done, per_step = _serve(Engine(*model, num_slots=4, num_pages=40, page_size=8,
                                   token_budget=4 + 64, min_context=64), prompts, params)
    assert max(per_step) == 4
    refs = _references(model, prompts, params, pad=False)
    for prompt, a, ref in zip(prompts, done, refs, strict=True):
        assert a.tokens == ref[0], len(prompt)


def test_rows_of_different_adapters_prefill_together(model, params):
    config, _ = model

    def adapter(seed):
        """``init_adapters``' layout (traced, not run: no program compiles), every factor
        drawn with numpy (B far from zero: an initialised adapter changes nothing)."""
        cfg = lora.LoraConfig(rank=4, alpha=8.0)
        tree = jax.eval_shape(lambda: lora.init_adapters(config, cfg, params,
                                                         jax.random.key(seed)))
        rng = np.random.default_rng(seed)
        return jax.tree.map(lambda x: jnp.asarray(0.2 * rng.standard_normal(
            x.shape, np.float32)), tree), cfg

    adapters = {"a": adapter(1), "b": adapter(2)}
    prompts = _prompts([4, 9, 4, 12, 6, 15], seed=6)
    prompts[2] = prompts[0]  # the same tokens under another adapter: no fork, no shared pages
    params = [SamplingParams(max_tokens=6, logprobs=True, adapter=(None, "a", "b")[i % 3])
              for i in range(len(prompts))]
    many, per_step = _serve(Engine(*model, **ENGINE, adapters=adapters), prompts, params)
    one, _ = _serve(Engine(*model, **ENGINE, adapters=adapters, max_prefill_rows=1), prompts,
                    params)
    assert max(per_step) == 4
    for a, b in zip(many, one, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert len({tuple(c.tokens) for c in many}) > 2
