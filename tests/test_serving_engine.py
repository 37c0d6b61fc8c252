"""The serving engine: every request served under concurrent load (mixed lengths, arrivals from
another thread while others run, cancellations, preemption forced by a small pool, prefix hits)
decodes what ``generate`` gives its prompt alone, token for token; seeded sampling is the same
alone and under load; cancelling frees everything; requests that can never fit are refused.
After every test the pool holds all its pages again."""

import threading
import time

import jax
import numpy as np
import pytest
from helpers import ENGINE_STEP_LIMIT, check_top_logprobs, run_until_idle, step_until
from helpers import random_params as numpy_params
from scipy.special import log_softmax

from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.serving import Engine, SamplingParams
from transformer_jax.serving.requests import State

# conftest: generate and the engine's step compile with FAST_COMPILE for the module.
pytestmark = pytest.mark.usefixtures("fast_generate_compiles", "fast_engine_compiles")

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
            d_ff=48, max_seq_len=64, init_std=0.2)
N_REF = 12  # new tokens of every reference generate (requests ask for at most this many)
# The seeded tests' sampling (every filter; their steps and references share programs).
SEEDED = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05)
# 4 slots, pages of 4 positions, 24 usable pages (96 positions: fewer than 4 long requests
# need, so the load preempts), chunks of at most 16 prompt tokens per step, page tables 8 or
# 16 pages wide.
ENGINE = dict(num_slots=4, num_pages=25, page_size=4, token_budget=20, min_context=32)


@pytest.fixture(scope="module")
def raw_params():
    """The module model's weights (before ``decode.prepare``), drawn with numpy (no init)."""
    return jax.device_put(numpy_params(ModelConfig(**TINY)))


@pytest.fixture(scope="module")
def model(raw_params):
    config = ModelConfig(**TINY)
    return config, decode.prepare(config, raw_params)


@pytest.fixture(scope="module")
def shared_engine(model):
    return Engine(*model, **ENGINE)


@pytest.fixture
def engine(shared_engine):
    """The module's engine; after the test it must be idle with every page back."""
    yield shared_engine
    assert shared_engine.idle
    shared_engine.check_no_leaks()


_REFERENCE: dict = {}
# A row beside each reference prompt: every batch one shape (2 rows, bucket 64), one program per
# sampling setting (a row's greedy or seeded draws do not depend on the rows beside it, nor on N).
_PAD_ROW = [1] * 33


def reference(model, prompt, params: SamplingParams) -> tuple[list[int], list[float]]:
    """``generate``'s N_REF tokens of the prompt, cut at max_tokens and after a stop token."""
    config, weights = model
    key = (config, tuple(prompt), params.temperature, params.top_k, params.top_p, params.min_p,
           params.seed)
    if key not in _REFERENCE:
        out = generation.generate(config, weights, [prompt, _PAD_ROW], max_new_tokens=N_REF,
                                  temperature=params.temperature, top_k=params.top_k,
                                  top_p=params.top_p, min_p=params.min_p, seed=[params.seed, 0])
        _REFERENCE[key] = (out.tokens[0], out.logprobs[0])
    tokens, logprobs = _REFERENCE[key]
    n = params.max_tokens
    for i, tok in enumerate(tokens[:n]):
        if tok in params.stop_token_ids:
            n = i + 1
            break
    return tokens[:n], logprobs[:n]


def _prompts(lengths, seed=0, prefix=()):
    rng = np.random.default_rng(seed)
    return [list(prefix) + rng.integers(0, TINY["vocab_size"], n).tolist() for n in lengths]


class Collector:
    """Each request's events, in the order its consumer got them."""

    def __init__(self):
        self.events = {}
        self.lock = threading.Lock()

    def __call__(self, event):
        with self.lock:
            self.events.setdefault(event.request_id, []).append(event)

    def tokens(self, rid):
        return [e.token for e in self.events[rid] if e.token is not None]


def _check_events(events, tokens, reason):
    assert [e.index for e in events if e.token is not None] == list(range(len(tokens)))
    assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1].finish_reason == reason


def test_greedy_under_load_equals_generate_alone(model, engine):
    """Mixed prompt lengths (some sharing a 16-token prefix), stop tokens, arrivals from another
    thread while others run, one cancellation mid-decode, and a pool small enough to preempt."""
    shared = _prompts([16], seed=1)[0]
    first = _prompts([41, 50, 3, 30], seed=2) + _prompts([9, 20], seed=3, prefix=shared)
    later = _prompts([17, 5], seed=4) + _prompts([12], seed=5, prefix=shared)
    params = {}
    for i, (prompt, n) in enumerate(zip(first + later, (12, 12, 10, 12, 7, 9, 8, 11, 6),
                                        strict=True)):
        p = SamplingParams(max_tokens=n, logprobs=True)
        if i in (5, 7):  # stop at the token the reference has at index 2
            stop = reference(model, prompt, p)[0][2]
            p = SamplingParams(max_tokens=p.max_tokens, stop_token_ids=(stop,), logprobs=True)
        params[tuple(prompt)] = p
    collect = Collector()
    ids = {engine.add_request(p, params[tuple(p)], collect): p for p in first}
    cancelled = list(ids)[2]  # the 3-token prompt, cancelled after 2 tokens
    added = threading.Event()

    def arrive():
        for p in later:
            ids[engine.add_request(p, params[tuple(p)], collect)] = p
        added.set()

    engine.step()
    thread = threading.Thread(target=arrive)
    thread.start()
    preemptions = engine.scheduler.preemptions

    def finished():
        if len(collect.events.get(cancelled, [])) == 2:
            engine.cancel(cancelled)
        return added.is_set() and engine.idle

    try:
        step_until(engine, finished, what="every request finished")
    finally:
        thread.join()

    for rid, prompt in ids.items():
        events = collect.events[rid]
        want, want_logprobs = reference(model, prompt, params[tuple(prompt)])
        got = collect.tokens(rid)
        if rid == cancelled:
            assert got == want[:2] and events[-1].finish_reason == "cancelled"
            continue
        assert got == want, (rid, len(prompt))
        np.testing.assert_allclose([e.logprob for e in events], want_logprobs, atol=1e-4)
        stops = params[tuple(prompt)].stop_token_ids
        _check_events(events, got, "stop" if stops and got[-1] in stops else "length")
    assert engine.scheduler.preemptions > preemptions
    assert engine.scheduler.prefix.hits > 0


def test_preemption_takes_the_newest_and_recomputes_it(model, engine):
    """Two long requests outgrow the pool while decoding: the newer one is preempted (its pages
    freed), recomputed from its prompt and its tokens, and both still equal generate."""
    prompts = _prompts([40, 40], seed=6)
    params = SamplingParams(max_tokens=N_REF)
    old, new = (engine.add_request(p, params) for p in prompts)
    done = run_until_idle(engine)
    assert done[old].preemptions == 0 and done[new].preemptions >= 1
    for rid, prompt in zip((old, new), prompts, strict=True):
        assert done[rid].tokens == reference(model, prompt, params)[0]
        assert done[rid].finish_reason == "length"


def test_prefix_reuse_prefills_only_the_rest(model, engine):
    """A prompt that extends a served one finds its full pages (6 pages of 4 = 24 positions)
    and decodes what generate gives it."""
    first = _prompts([24], seed=7)[0]
    second = first + _prompts([10], seed=8)[0]
    params = SamplingParams(max_tokens=6)
    a = engine.add_request(first, params)
    done = run_until_idle(engine)
    b = engine.add_request(second, params)
    done.update(run_until_idle(engine))
    assert done[b].prefix_hit_tokens == 24
    assert done[a].tokens == reference(model, first, params)[0]
    assert done[b].tokens == reference(model, second, params)[0]


@pytest.mark.parametrize("length", [22, 24])  # the last page partial (22 = 5 pages + 2), or full
def test_identical_prompts_fork_from_one_prefill(model, engine, length):
    """Requests waiting with the tokens of a prompt whose last chunk runs (``n`` choices) take
    the free slots (3 of 4), share its full pages, copy its partial page and draw their first
    token from its logits; each still decodes what generate gives it alone, and the one left
    without a slot prefills as before (its full pages found in the prefix cache)."""
    prompt = _prompts([length], seed=30 + length)[0]
    params = [SamplingParams(max_tokens=N_REF - i, **SEEDED, seed=50 + i, logprobs=True)
              for i in range(5)]
    params[1] = SamplingParams(max_tokens=N_REF, logprobs=True)  # a greedy fork
    forked = engine.scheduler.forked
    ids = [engine.add_request(prompt, p) for p in params]
    done = run_until_idle(engine)
    assert engine.scheduler.forked - forked == 3
    assert [done[i].prefix_hit_tokens for i in ids] == [0, length, length, length,
                                                       length // 4 * 4 - 4 * (length % 4 == 0)]
    for rid, p in zip(ids, params, strict=True):
        want, want_logprobs = reference(model, prompt, p)
        assert done[rid].tokens == want, rid
        np.testing.assert_allclose(done[rid].logprobs, want_logprobs, atol=1e-4)


def test_seeded_sampling_is_the_same_alone_and_under_load(model, engine):
    prompt = _prompts([13], seed=9)[0]
    params = SamplingParams(max_tokens=N_REF, **SEEDED, seed=1234)
    rid = engine.add_request(prompt, params)
    alone = run_until_idle(engine)[rid].tokens
    others = [engine.add_request(p, SamplingParams(max_tokens=8, temperature=t, seed=s))
              for p, t, s in zip(_prompts([7, 25, 18], seed=10), (0.0, 1.0, 0.7), (1, 2, 3),
                                 strict=True)]
    rid = engine.add_request(prompt, params)
    done = run_until_idle(engine)
    assert done[rid].tokens == alone
    assert alone == reference(model, prompt, params)[0]
    assert len(done) == 1 + len(others)
    assert len(set(map(tuple, (done[o].tokens for o in others)))) > 1


def test_cancel_mid_prefill_waiting_and_mid_decode_frees_everything(engine):
    long_prompt, short = _prompts([50, 6], seed=11)
    collect = Collector()
    rid = engine.add_request(long_prompt, SamplingParams(max_tokens=4), collect)
    engine.step()  # its first 16-token chunk
    (req,) = engine.scheduler.prefilling
    assert req is not None and req.id == rid and 0 < req.cached < len(long_prompt)
    assert engine.pages_in_use > 0
    waiting = engine.add_request(short, SamplingParams(max_tokens=4), collect)
    engine.cancel(rid)
    engine.cancel(waiting)
    engine.step()
    assert [e.finish_reason for e in collect.events[rid]] == ["cancelled"]
    assert [e.finish_reason for e in collect.events[waiting]] == ["cancelled"]
    assert engine.idle and engine.pages_in_use == 0

    rid = engine.add_request(short, SamplingParams(max_tokens=10), collect)
    step_until(engine, lambda: len(collect.events.get(rid, [])) >= 3, what="3 tokens")
    assert engine.scheduler.running[0].state == State.RUNNING
    engine.cancel(rid)
    engine.cancel(rid)  # twice is harmless, as is an unknown id
    engine.cancel(10 ** 6)
    assert engine.step() == [collect.events[rid][-1]]
    assert collect.events[rid][-1].finish_reason == "cancelled"
    assert len(collect.tokens(rid)) == 3 and engine.idle


def test_requests_that_can_never_fit_are_refused_naming_both_numbers(model, engine):
    with pytest.raises(ValueError, match=r"70 positions .*max_seq_len 64"):
        engine.add_request(list(range(60)), SamplingParams(max_tokens=10))
    small = Engine(*model, num_slots=2, num_pages=4, page_size=4, token_budget=10)
    with pytest.raises(ValueError, match=r"needs 4 pages .* pool's 3 pages"):
        small.add_request(list(range(10)), SamplingParams(max_tokens=5))
    small.add_request(list(range(8)), SamplingParams(max_tokens=5))  # 12 positions fit
    with pytest.raises(ValueError, match="token id 64"):
        engine.add_request([1, 64], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1], SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request([1], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="token_budget"):
        Engine(*model, num_slots=4, num_pages=8, page_size=4, token_budget=4)
    assert engine.idle


def test_scanned_model_with_a_sliding_window_equals_generate():
    """Stacked [L, ...] pages (a scanned model) and a sliding window shorter than the prompts:
    a chunked long prompt and two short ones decode what generate gives each alone."""
    config = ModelConfig(**{**TINY, "scan_layers": True, "sliding_window": 6})
    model = config, decode.prepare(config, jax.device_put(numpy_params(config, 1)))
    engine = Engine(*model, num_slots=2, num_pages=12, page_size=8, token_budget=18,
                    min_context=16)
    assert engine.scheduler.widths == (2, 4, 8) and engine.scheduler.buckets == (16,)
    assert engine.compile() == 3 * 2  # decode alone and with the chunk, at each width
    engine.check_no_leaks()
    long, short, other = _prompts([37, 4, 11], seed=12)
    prompts = [short, short, long, other]  # the repeat must not fork: its rings are the slot's
    params = SamplingParams(max_tokens=N_REF)
    ids = [engine.add_request(p, params) for p in prompts]
    done = run_until_idle(engine)
    for rid, prompt in zip(ids, prompts, strict=True):
        assert done[rid].tokens == reference(model, prompt, params)[0]
    assert engine.scheduler.forked == 0
    engine.check_no_leaks()


def test_top_logprobs_are_the_top_k_of_each_steps_full_softmax(model, raw_params, engine):
    # Under load (a long prompt beside, chunks and decode rows in the same steps): each
    # token's K alternatives are the K most likely of the forward's softmax at its position,
    # most likely first, whatever else shares the step; rows that do not ask get none.
    config, weights = model
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 64, n).tolist() for n in (5, 23, 9)]
    asks = [SamplingParams(max_tokens=7, logprobs=True, top_logprobs=5),
            SamplingParams(max_tokens=6, logprobs=True),
            SamplingParams(max_tokens=6, temperature=0.9, seed=3, logprobs=True, top_logprobs=2)]
    ids = [engine.add_request(p, s) for p, s in zip(prompts, asks, strict=True)]
    done = run_until_idle(engine)
    forward = jax.jit(lambda p, t: Transformer(config).apply({"params": p}, t).logits)
    for i, prompt, ask in zip(ids, prompts, asks, strict=True):
        got = done[i]
        if not ask.top_logprobs:
            assert got.top_logprobs is None
            continue
        seq = prompt + got.tokens
        # One shape (one program): padded after the sequence, unseen by its causal logits.
        logits = np.asarray(forward(raw_params, np.asarray(
            [seq[:-1] + [0] * (32 - len(seq))], np.int32)), np.float64)[0, :len(seq) - 1]
        logp = log_softmax(logits, -1)[len(prompt) - 1:]
        check_top_logprobs(got, logp, ask.top_logprobs)
        if ask.temperature == 0:  # greedy: the drawn token is the most likely one
            assert [top[0][0] for top in got.top_logprobs] == got.tokens


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_logprobs=3), "top_logprobs needs logprobs=True"),
    (dict(logprobs=True, top_logprobs=21), r"top_logprobs must be an int in \[0, 20\]"),
    (dict(logprobs=True, top_logprobs=2.0), "top_logprobs must be an int"),
])
def test_bad_top_logprobs_are_refused_by_name(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request([1, 2], SamplingParams(**kwargs))


def _steady(engine, params: SamplingParams, n: int = 3) -> None:
    """Starts ``n`` requests and steps until they all decode (none waiting or in prefill)."""
    for i in range(n):
        engine.add_request([5, 6, 7 + i], params)
    sched = engine.scheduler
    step_until(engine, lambda: len(sched.running) == n and not sched.prefilling,
               what="every request decoding")
    engine.step()  # one more: the decode program has run on these inputs' shapes


@pytest.mark.parametrize("overlap", [True, False], ids=["lagged", "synchronous"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_steady_decode_step_uploads_its_inputs_and_downloads_once(engine, capfd,
                                                                    monkeypatch, sampled,
                                                                    overlap):
    """A decode step with no request to admit makes only the transfers its design needs:
    uploads of the inputs that change every step (tokens, positions, page table; with sampled
    rows also their keys, token indices and temperatures: the other settings are compiled
    out) as the program's arguments, and one download: the sampled tokens and log-probs, fetched
    together. A lagged step (``serving.overlap``) takes its tokens from the previous step on the
    device: one upload fewer. Uploads are counted by JAX's transfer guard (its log), downloads
    by counting arrays fetched to the host (the CPU backend's guard does not see them)."""
    monkeypatch.setattr(engine.overlap, "enabled", overlap)
    params = SamplingParams(max_tokens=10, temperature=0.8 if sampled else 0.0, seed=3)
    _steady(engine, params)
    cls = type(jax.numpy.zeros(()))
    value, get, fetched, gets = cls._value, jax.device_get, [], []

    def counted(arr):
        if arr._npy_value is None:  # not on the host yet
            fetched.append(arr.shape)
        return value.fget(arr)

    monkeypatch.setattr(cls, "_value", property(counted))
    monkeypatch.setattr(jax, "device_get", lambda x: gets.append(1) or get(x))
    with jax.transfer_guard("log_explicit"):
        capfd.readouterr()
        jax.device_put(np.zeros(2, np.int32))  # the log's control: one upload, one line
        control = capfd.readouterr().err.count("host-to-device transfer")
        events = engine.step()
        uploads = capfd.readouterr().err.count("host-to-device transfer")
    monkeypatch.undo()
    assert control == 1, "JAX's transfer guard log is not visible (TF_CPP_MIN_LOG_LEVEL?)"
    assert len(events) == 3 and all(e.finish_reason is None for e in events)
    assert uploads == (6 if sampled else 3) - overlap
    assert len(gets) == 1 and fetched == [(4,), (4,)]  # [B] tokens and log-probs, once
    run_until_idle(engine)


def test_step_times_account_for_each_steps_time(engine):
    """Every step's phases are timed: their laps add up to the step's time as measured around
    it, each phase non-negative; the summary's host share is host / (host + device)."""
    engine.step_times.reset()
    _steady(engine, SamplingParams(max_tokens=8))
    walls = []
    while not engine.idle:
        assert len(walls) < ENGINE_STEP_LIMIT, "step limit: the engine never went idle"
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    times = engine.step_times
    assert times.count == len(times.steps) > len(walls)
    steps = np.asarray(times.steps)[-len(walls):]
    assert (steps >= 0).all()
    assert np.all(steps.sum(1) <= np.asarray(walls))
    # Every phase is timed: the laps hold nearly all of the steps' time (what they miss is the
    # call into step() and a context switch there, which may take a few ms on a busy machine).
    assert steps.sum() >= 0.9 * sum(walls)
    s = times.summary()
    host = s["host"]["mean"] * s["steps"]
    device = s["device"]["mean"] * s["steps"]
    assert s["host_share"] == pytest.approx(host / (host + device))
    assert s["host_share"] == pytest.approx(times.host_share)
    assert s["phases"]["device"]["mean"] > 0
    assert any(times.prefill) and not any(list(times.prefill)[-len(walls):])
    assert s["decode_only"]["steps"] == len(times.prefill) - sum(times.prefill)


# Multi-step rounds (``serving.multistep``) -------------------------------------------------------

def _run_load(engine, prompts, params):
    """Serves the requests, all added at once; each request's events, and each step's."""
    collect, steps = Collector(), []
    ids = [engine.add_request(p, q, collect) for p, q in zip(prompts, params, strict=True)]
    while not engine.idle:
        assert len(steps) < ENGINE_STEP_LIMIT, "step limit: the engine never went idle"
        steps.append(engine.step())
    return [collect.events[i] for i in ids], steps


def test_multi_step_rounds_equal_single_steps_and_generate(model, engine, monkeypatch):
    """Under a steady load (every slot decoding, none waiting) the engine runs multi-step
    rounds; with rows stopping on a stop token and by length inside a round, every request's
    tokens and log-probs equal generate's alone and the single-step engine's, and its consumer
    gets one event per token, in order."""
    monkeypatch.setattr(engine.multistep, "max_steps", 8)
    prompts = _prompts([5, 9, 3, 7], seed=40)
    params = [SamplingParams(max_tokens=N_REF, logprobs=True),
              SamplingParams(max_tokens=5, logprobs=True, temperature=0.8, seed=7),
              SamplingParams(max_tokens=N_REF, logprobs=True, temperature=0.9, seed=8),
              SamplingParams(max_tokens=N_REF, logprobs=True)]
    for i in (2, 3):  # stop at the token the reference has at index 7
        stop = reference(model, prompts[i], params[i])[0][7]
        params[i] = params[i].__class__(**{**params[i].__dict__, "stop_token_ids": (stop,)})
    rounds = engine.multistep.rounds
    got, steps = _run_load(engine, prompts, params)
    assert engine.multistep.rounds > rounds
    ended_inside = set()  # requests whose last token came before their round's last step
    for events in steps:
        count = {}
        for e in events:
            count[e.request_id] = count.get(e.request_id, 0) + 1
        ended_inside |= {e.request_id for e in events if e.finish_reason is not None
                         and count[e.request_id] < max(count.values())}
    monkeypatch.setattr(engine.multistep, "max_steps", 1)
    single, single_steps = _run_load(engine, prompts, params)
    assert len(steps) < len(single_steps)
    for events, alone, prompt, p in zip(got, single, prompts, params, strict=True):
        tokens = [e.token for e in events]
        want, want_logprobs = reference(model, prompt, p)
        assert tokens == want
        np.testing.assert_allclose([e.logprob for e in events], want_logprobs, atol=1e-4)
        assert [(e.token, e.logprob) for e in events] == [(e.token, e.logprob) for e in alone]
        stopped = p.stop_token_ids and tokens[-1] in p.stop_token_ids
        _check_events(events, tokens, "stop" if stopped else "length")
    reasons = {e[-1].request_id: e[-1].finish_reason for e in got}
    assert {reasons[i] for i in ended_inside} == {"stop", "length"}


# Lagged steps (``serving.overlap``) --------------------------------------------------------------

def test_lagged_steps_discard_one_token_at_a_stop_and_none_at_max_tokens(model, engine):
    """In a steady decode each step is dispatched before the previous one's tokens are read
    (its input tokens taken on the device); a request that draws its stop token at step t has
    had a row in step t+1, whose token is discarded (exactly one), and one ending by
    ``max_tokens`` none (known on the host); every token and log-prob is generate's (a sampled
    row checks the lagged rows' token index), and every page comes back."""
    prompts = _prompts([5, 7, 6], seed=50)
    params = [SamplingParams(max_tokens=N_REF, logprobs=True),
              SamplingParams(max_tokens=6, logprobs=True),
              SamplingParams(max_tokens=N_REF, logprobs=True, temperature=0.8, seed=5)]
    # stop at the reference's first new token from index 5 on (its 6th token or later)
    free = reference(model, prompts[0], params[0])[0]
    last = next(i for i in range(5, N_REF) if free[i] not in free[:i])
    params[0] = SamplingParams(max_tokens=N_REF, logprobs=True, stop_token_ids=(free[last],))
    lag = engine.overlap
    lagged, discarded = lag.lagged, lag.discarded
    collect, in_flight = Collector(), []
    ids = [engine.add_request(p, q, collect) for p, q in zip(prompts, params, strict=True)]
    while not engine.idle:
        assert len(in_flight) < ENGINE_STEP_LIMIT, "step limit: the engine never went idle"
        engine.step()
        in_flight.append(lag.flight is not None)
    assert lag.lagged - lagged >= 5 and any(in_flight) and not in_flight[-1]
    assert lag.discarded - discarded == 1
    assert engine.pages_in_use == 0
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        events = collect.events[rid]
        want, want_logprobs = reference(model, prompt, p)
        assert [e.token for e in events] == want
        np.testing.assert_allclose([e.logprob for e in events], want_logprobs, atol=1e-4)
    assert [collect.events[i][-1].finish_reason for i in ids] == ["stop", "length", "length"]
    assert len(collect.events[ids[0]]) == last + 1
