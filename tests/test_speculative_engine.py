"""Speculative decoding in the serving engine: every speculating request decodes what
``generate`` gives its prompt alone (greedy and seeded sampling, logprobs, stop ids, stop
strings, max_tokens) under concurrent load with arrivals, a cancellation and preemption; no page
is leaked after rejected tokens; the measured-cost rule stops a request where verification
cannot pay (one log line) and starts it again when its watched proposals are kept; compile
leaves a sampled load no verify program to compile; the budget leaves room for the target's own
token; bad specs and unsupported setups are refused in one line (by ``compile`` and ``serve``
before anything compiles)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, TINY, fast_everywhere, random_params, write_chatml_tokenizer

from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.decode.speculative import ngram_proposals
from transformer_jax.decode.speculative_loop import DraftModel
from transformer_jax.serving import Engine, SamplingParams, speculation
from transformer_jax.serving import draft as draft_lib
from transformer_jax.serving import step as step_lib
from transformer_jax.serving.step import Sampler

pytestmark = pytest.mark.usefixtures("fast_generate_compiles", "fast_engine_compiles")

N = 20
# 4 slots, pages of 4 positions, 24 usable pages: fewer than the load needs, so it preempts.
ENGINE = dict(num_slots=4, num_pages=25, page_size=4, token_budget=20, min_context=32)


@pytest.fixture(scope="module", autouse=True)
def fast_verify_compiles():
    if fast_everywhere():  # every program compiles so already
        yield
        return
    original = speculation.verify_jit
    speculation.verify_jit = speculation.jit_verify(compiler_options=FAST_COMPILE)
    yield
    speculation.verify_jit = original


def _params(config, seed: int) -> dict:
    """Drawn with numpy (helpers.random_params): no init program compiles."""
    return jax.tree.map(jnp.asarray, random_params(config, seed))


@pytest.fixture(scope="module")
def model():
    # Seed 1: a model whose greedy continuation of test_top_logprobs_are_the_plain_steps'
    # periodic prompt keeps some n-gram proposals (that test needs accepted ones; seed 0's
    # rejects them all).
    return TINY, decode.prepare(TINY, _params(TINY, 1))


@pytest.fixture(scope="module")
def engine(model):
    eng = Engine(*model, **ENGINE)
    yield eng
    assert eng.idle


def _prompts(seed: int, count: int) -> list[list[int]]:
    """Repetitive prompts (an n-gram proposer finds matches) of mixed lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        base = rng.integers(0, TINY.vocab_size, 3 + i % 4).tolist()
        out.append(base * (2 + i % 3) + rng.integers(0, TINY.vocab_size, i % 3).tolist())
    return out


_REF: dict = {}
#: A second row of the longest prompt length the module's references take: every reference
#: batch pads to one length, so the references run one compiled program per sampling setting
#: (a row's tokens and draws are its own, whatever the batch's other rows: test_decode).
FILLER = [1] * 32


def reference(model, prompt, p: SamplingParams):
    """``generate``'s (tokens, logprobs) for ``prompt`` under ``p``, cut at ``p``'s stop ids
    and max_tokens."""
    key = (tuple(prompt), p.temperature, p.seed, p.top_k)
    if key not in _REF:
        assert len(prompt) <= len(FILLER)
        out = generation.generate(*model, [prompt, FILLER], max_new_tokens=N,
                                  temperature=p.temperature, top_k=p.top_k, seed=[p.seed, 0])
        _REF[key] = (out.tokens[0], out.logprobs[0])
    tokens, logprobs = _REF[key]
    n = p.max_tokens
    for i, tok in enumerate(tokens[:n]):
        if tok in p.stop_token_ids:
            n = i + 1
            break
    return tokens[:n], logprobs[:n]


def test_speculating_requests_under_load_equal_generate_alone(model, engine):
    """Greedy and sampled requests, some speculating and some not, arrivals while others
    run, a cancellation, stop ids, and a pool that preempts: each decodes its reference."""
    prompts = _prompts(1, 8)
    params = []
    for i, prompt in enumerate(prompts):
        p = SamplingParams(max_tokens=N - 2 * (i % 3), temperature=0.9 if i % 4 == 3 else 0.0,
                           top_k=16 if i % 4 == 3 else None, seed=i, logprobs=True,
                           speculative=None if i % 5 == 4 else f"ngram:k={4 - i % 2}")
        if i == 2:  # stop at the token the reference has at index 5
            stop = reference(model, prompt, p)[0][5]
            p = SamplingParams(**{**p.__dict__, "stop_token_ids": (stop,)})
        params.append(p)
    ids = {engine.add_request(prompts[i], params[i]): i for i in range(6)}
    for _ in range(3):
        engine.step()
    cancelled = engine.add_request(prompts[0], params[0])
    ids.update({engine.add_request(prompts[i], params[i]): i for i in range(6, 8)})
    engine.step()
    engine.cancel(cancelled)
    before = engine.scheduler.preemptions
    done = engine.run_until_idle()
    assert done[cancelled].finish_reason == "cancelled"
    for rid, i in ids.items():
        tokens, logprobs = reference(model, prompts[i], params[i])
        assert done[rid].tokens == tokens, f"request {i}"
        np.testing.assert_allclose(done[rid].logprobs, logprobs, atol=1e-5)
        assert (done[rid].speculative is None) == (params[i].speculative is None)
    assert engine.scheduler.preemptions > before, "the load was meant to preempt"
    metrics = engine.speculation.metrics()
    assert metrics["accepted"] > 0 and metrics["proposed"] > metrics["accepted"]
    engine.check_no_leaks()


def _measured(monkeypatch, eng, verify_cost: float) -> None:
    """Every verify step measured at ``verify_cost`` plain steps (greedy steps), fresh."""
    monkeypatch.setattr(speculation.Speculation, "record", lambda *a: None)
    eng.speculation.times = {(w, t, c, Sampler()): (verify_cost if t > 1 else 1.0, 10 ** 9)
                             for w in eng.scheduler.widths for t in (1, 2, 3, 5, 9, 17)
                             for c in (False, True)}
    eng.steps = 10 ** 9


def test_back_off_engages_and_releases(model, engine, monkeypatch, caplog):
    """With verification measured as costly, the engine runs plain steps although rows
    propose, and says so once; measured as cheap, it verifies again. The tokens stay the
    reference's."""
    spec = engine.speculation
    prompt = [3, 4, 5, 6] * 4
    p = SamplingParams(max_tokens=16, speculative="ngram:k=4")

    def run(verify_cost: float):
        _measured(monkeypatch, engine, verify_cost)
        before = (spec.backed_off, spec.verify_steps)
        rid = engine.add_request(prompt, p)
        done = engine.run_until_idle()
        assert done[rid].tokens == reference(model, prompt, p)[0]
        return spec.backed_off - before[0], spec.verify_steps - before[1]

    monkeypatch.setattr(spec, "_stopped", False)
    with caplog.at_level(logging.INFO, "transformer_jax.serving.speculation"):
        backed_off, verified = run(verify_cost=100.0)
    assert backed_off > 0 and verified == 0
    stops = [r.message for r in caplog.records if "speculation stopped" in r.message]
    assert len(stops) == 1 and "costs 100.00 plain steps" in stops[0], stops
    backed_off, verified = run(verify_cost=1.0)
    assert verified > 0 and backed_off == 0
    spec.times, spec._recent = {}, {}  # the made-up times stay in this test
    engine.check_no_leaks()


def test_a_request_stops_where_it_cannot_pay_and_starts_again(model, small_draft,
                                                              monkeypatch):
    """A verify step measured at 2.5 plain steps: a request whose draft is the target stops
    after its prior (1.9 tokens expected from 4 proposals), watches its draft's proposals on
    plain steps, finds them kept and verifies again; one whose draft disagrees never does."""
    for draft, again in ((DraftModel(*model), True), (small_draft, False)):
        eng = Engine(*model, **ENGINE, draft=draft)
        _measured(monkeypatch, eng, verify_cost=2.5)
        prompt = _prompts(5, 1)[0]
        p = SamplingParams(max_tokens=N, speculative="draft:x:k=4")
        rid = eng.add_request(prompt, p)
        done = eng.run_until_idle()[rid]
        assert done.tokens == reference(model, prompt, p)[0]
        acc = done.speculative
        assert acc.declined > 0 and (acc.verifications > 0) == again
        if again:
            assert acc.acceptance_rate == 1.0
        eng.check_no_leaks()


def test_bad_speculative_settings_are_refused(model, engine):
    with pytest.raises(ValueError, match="unknown method 'medusa'") as e:
        engine.add_request([1, 2, 3], SamplingParams(speculative="medusa:k=2"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="the engine has no draft model"):
        engine.add_request([1, 2, 3], SamplingParams(speculative="draft:/x:k=2"))
    assert engine.idle


def test_the_budget_leaves_room_for_the_targets_own_token(model, engine, monkeypatch):
    """A verification keeps its accepted proposals and adds the target's own token, so a row
    with r tokens to go proposes at most r - 1: a max_tokens=2 request (one token left after
    the prefill's) proposes nothing and runs no verify step, and a request's accepted +
    verifications never exceed its tokens after the first."""
    _verify_always(monkeypatch, engine)  # every step with proposals verifies
    spec = engine.speculation
    prompt = list(range(TINY.vocab_size - 2))  # nearly every token: the lookup finds its first
    plain = engine.add_request(prompt, SamplingParams(max_tokens=2))
    plain = engine.run_until_idle()[plain].tokens
    before = spec.verify_steps, spec.total.proposed
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, speculative="ngram:k=4"))
    got = engine.run_until_idle()[rid]
    assert got.tokens == plain
    assert ngram_proposals([prompt + got.tokens[:1]], [4])[0], "no proposal to withhold"
    assert (spec.verify_steps, spec.total.proposed) == before
    assert (got.speculative.proposed, got.speculative.verifications) == (0, 0)
    for max_tokens in (5, 7, 12):  # a periodic prompt: proposals kept up to the last token
        p = SamplingParams(max_tokens=max_tokens, speculative="ngram:k=4")
        prompt = [9, 8, 7, 6, 5] * 3
        rid = engine.add_request(prompt, p)
        got = engine.run_until_idle()[rid]
        assert got.tokens == reference(model, prompt, p)[0]
        acc = got.speculative
        assert acc.accepted + acc.verifications <= len(got.tokens) - 1, (max_tokens, acc)
    spec.times, spec._recent = {}, {}  # the made-up times stay in this test
    engine.check_no_leaks()


def test_an_engine_that_cannot_speculate_refuses_before_compiling(model, monkeypatch):
    """Sliding-window (ring) layers: ``compile(speculative=k)`` refuses in one line before
    any step program runs (it used to compile, then fail with an IndexError), as
    ``add_request`` does."""
    def compiled(*args, **kwargs):
        raise AssertionError("a step program ran")

    config = TINY.replace(sliding_window=8, layer_pattern=("local", "global"))
    eng = Engine(config, decode.prepare(config, _params(config, 2)), **ENGINE)
    monkeypatch.setattr(step_lib, "step_jit", compiled)
    monkeypatch.setattr(speculation, "verify_jit", compiled)
    with pytest.raises(ValueError, match="sliding-window") as e:
        eng.compile(speculative=4)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="sliding-window"):
        eng.add_request([1, 2, 3], SamplingParams(speculative="ngram:k=4"))


def test_serve_refuses_speculation_it_cannot_run_at_start_up(model, tmp_path, capsys):
    """``serve --speculative`` with ``--tensor``/``--expert`` above 1 (checked before the
    checkpoint loads), or on a sliding-window model: exit 1 with one line, never a server
    that reports healthy and answers 400 to every request."""
    from transformer_jax import hf
    from transformer_jax.cli import serve as cli

    for flags in (["--tensor", "2"], ["--expert", "2"]):
        args = cli.build_parser().parse_args(["--checkpoint", "x", "--speculative",
                                              "ngram:k=4", *flags])
        with pytest.raises(ValueError, match="needs one device") as e:
            cli._check(args)
        assert "\n" not in str(e.value)
    config = TINY.replace(sliding_window=8)  # Mistral's window (Gemma 2's: the test above)
    path = tmp_path / "windowed"
    hf.save(config, random_params(config, 3), path)
    write_chatml_tokenizer(path, [f"w{i}" for i in range(TINY.vocab_size - 5)])
    code = cli.main(["--checkpoint", str(path), "--speculative", "ngram:k=4", "--port", "0",
                     "--slots", "2", "--compilation-cache", ""])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 1 and "Traceback" not in err and len(lines) == 1, err
    assert "sliding-window" in lines[0], lines[0]


def test_top_logprobs_are_the_plain_steps(engine):
    """The kept tokens' top alternatives (taken at every verified position) are what the
    plain decode reports for the same request."""
    prompt = [9, 8, 7, 6, 5] * 3
    done = {}
    for spec in (None, "ngram:k=4"):
        rid = engine.add_request(prompt, SamplingParams(max_tokens=12, logprobs=True,
                                                        top_logprobs=2, speculative=spec))
        done[spec] = engine.run_until_idle()[rid]
    plain, spec = done[None], done["ngram:k=4"]
    assert spec.tokens == plain.tokens and spec.speculative.accepted > 0
    for a, b in zip(spec.top_logprobs, plain.top_logprobs, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        np.testing.assert_allclose([x for _, x in a], [x for _, x in b], atol=1e-5)
    engine.check_no_leaks()


def test_metrics_expose_the_acceptance(engine):
    from transformer_jax.serve.metrics import Metrics

    metrics = Metrics()
    metrics.observe_engine(engine, 0)
    text = metrics.text().decode()
    m = engine.speculation.metrics()
    assert m["proposed"] > 0  # the earlier tests of the module speculated
    assert f"transformer_jax_speculative_proposed {float(m['proposed'])}" in text
    assert "transformer_jax_speculative_acceptance_rate " in text
    assert "transformer_jax_speculative_mean_accepted_length " in text


# A draft model ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_draft():
    """A 1-layer model of the target's vocabulary, other random weights."""
    config = TINY.replace(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32)
    return DraftModel(config, decode.prepare(config, _params(config, 7)))


def _verify_always(monkeypatch, eng):
    """Verification never measured (nor anything else), so every step with proposals runs it
    to measure it."""
    monkeypatch.setattr(speculation.Speculation, "record", lambda *a: None)
    eng.speculation.times = {}


def _load(model, eng, prompts, params):
    """Runs the requests (a third added while the first ones run, one cancelled) and checks
    each against ``generate`` alone; returns the engine's speculation metrics."""
    ids = {eng.add_request(prompts[i], params[i]): i for i in range(len(prompts) * 2 // 3)}
    for _ in range(3):
        eng.step()
    cancelled = eng.add_request(prompts[0], params[0])
    ids.update({eng.add_request(prompts[i], params[i]): i
                for i in range(len(prompts) * 2 // 3, len(prompts))})
    eng.step()
    eng.cancel(cancelled)
    before = eng.scheduler.preemptions
    done = eng.run_until_idle(max_steps=1000)
    assert eng.idle and done[cancelled].finish_reason == "cancelled"
    for rid, i in ids.items():
        tokens, logprobs = reference(model, prompts[i], params[i])
        assert done[rid].tokens == tokens, f"request {i}"
        np.testing.assert_allclose(done[rid].logprobs, logprobs, atol=1e-5)
    assert eng.scheduler.preemptions > before, "the load was meant to preempt"
    eng.check_no_leaks()
    return eng.speculation.metrics()


def test_a_draft_model_speculates_under_load_as_generate_alone(model, small_draft,
                                                                monkeypatch):
    """Draft and n-gram rows, greedy and sampled, repeated prompts (forks, prefix hits),
    arrivals, a cancel and preemption in one engine: each request decodes its reference."""
    eng = Engine(*model, **ENGINE, draft=small_draft)
    _verify_always(monkeypatch, eng)
    prompts = _prompts(3, 6)
    prompts = prompts + prompts[:3]  # twins: forks or prefix hits
    params = [SamplingParams(max_tokens=N - 2 * (i % 3), temperature=0.9 if i % 3 == 1 else 0.0,
                             top_k=16 if i % 3 == 1 else None, seed=i, logprobs=True,
                             speculative="ngram:k=3" if i % 4 == 3 else "draft:any:k=4")
              for i in range(len(prompts))]
    metrics = _load(model, eng, prompts, params)
    assert metrics["verify_steps"] > 0 and metrics["proposed"] > 0


def test_compile_leaves_a_greedy_draft_load_nothing_to_compile(model, small_draft, monkeypatch):
    """``Engine.compile(speculative=k)`` runs every program a greedy draft load uses, the
    draft's prefill chunk at each chunk shape among them: prompts of many lengths (chunks of
    every shape), then decoding with verification, compile nothing more."""
    eng = Engine(*model, **ENGINE, draft=small_draft)
    eng.compile(speculative=4)
    programs = {"step": step_lib.step_jit, "forward": step_lib.forward_jit,
                "draft_rows": draft_lib.draft_rows, "draft_more": draft_lib.draft_more,
                "verify": speculation.verify_jit}
    before = {name: p._cache_size() for name, p in programs.items()}
    _verify_always(monkeypatch, eng)
    rng = np.random.default_rng(8)
    for length in (1, 3, 6, 11, 17, 26):
        eng.add_request(rng.integers(0, TINY.vocab_size, length).tolist(),
                        SamplingParams(max_tokens=6, speculative="draft:any:k=4"))
    eng.run_until_idle(max_steps=500)
    assert eng.idle and eng.speculation.metrics()["verify_steps"] > 0
    assert {name: p._cache_size() for name, p in programs.items()} == before
    # a sampled request (a server's by default) finds its verify programs compiled
    verify_steps = eng.speculation.metrics()["verify_steps"]
    eng.add_request([5, 6, 7] * 4, SamplingParams(max_tokens=12, temperature=1.0,
                                                  speculative="ngram:k=4"))
    eng.run_until_idle(max_steps=500)
    assert eng.speculation.metrics()["verify_steps"] > verify_steps
    assert speculation.verify_jit._cache_size() == before["verify"]


def test_a_draft_equal_to_the_target_has_its_proposals_kept(model, monkeypatch):
    """The target as its own draft: the draft's pages must hold what the target's hold
    (prefill chunks, fork copies, preemption's recompute, prefix hits, and the last proposal
    of a fully kept verification), or its greedy proposals would be rejected."""
    eng = Engine(*model, **ENGINE, draft=DraftModel(model[0], model[1]))
    _verify_always(monkeypatch, eng)
    prompts = _prompts(4, 6)
    prompts = prompts + prompts[:3]
    params = [SamplingParams(max_tokens=N, seed=i, logprobs=True, speculative="draft:x:k=4")
              for i in range(len(prompts))]
    metrics = _load(model, eng, prompts, params)
    assert metrics["verify_steps"] > 5 and metrics["proposed"] > 50
    assert metrics["acceptance_rate"] > 0.97, metrics


def test_draft_setups_that_cannot_work_are_refused(model, small_draft, tmp_path):
    other = small_draft.config.replace(vocab_size=TINY.vocab_size + 1)
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(*model, **ENGINE, draft=DraftModel(other, small_draft.weights))
    eng = Engine(*model, **ENGINE, draft=small_draft)
    eng.speculation.draft.path = str(tmp_path / "draft")
    with pytest.raises(ValueError, match="the engine's draft model is"):
        eng.add_request([1, 2, 3], SamplingParams(speculative="draft:/elsewhere:k=2"))
    eng.add_request([1, 2, 3], SamplingParams(speculative=f"draft:{tmp_path}/draft/:k=2"))
    eng.run_until_idle(max_steps=100)
    eng.check_no_leaks()
