"""Speculative decoding: proposers, the verification forward, the acceptance rule and
``generate(..., speculative=...)``.

Verification of k + 1 positions in one forward equals k + 1 decode steps (logits and cache);
the general rejection rule and the point-mass rule keep the target's distribution (chi-square
at fixed seeds); speculative ``generate`` gives the tokens and log-probabilities of the plain
one, greedy and sampled, with the n-gram proposer and with a draft model; bad specs and a draft
with another vocabulary are one-line errors; the cost rule stops proposing where a verify
round cannot pay and starts again when the acceptance rises, and the round's cost is timed on
the program itself.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, TINY, fast_everywhere, random_params

from transformer_jax.decode import generation, speculative, speculative_loop
from transformer_jax.decode import loop as decode
from transformer_jax.decode.speculative import (
    Acceptance,
    SpeculativeConfig,
    accepted_length,
    forward_chunk,
    ngram_proposals,
    parse_spec,
    rejection_sample,
)
from transformer_jax.decode.speculative_loop import DraftModel

pytestmark = pytest.mark.usefixtures("fast_generate_compiles")


@pytest.fixture(scope="module", autouse=True)
def fast_speculative_compiles():
    if fast_everywhere():  # every program compiles so already
        yield
        return
    original = dict(speculative_loop.PROGRAMS)
    speculative_loop.PROGRAMS.update(speculative_loop.jit_programs(compiler_options=FAST_COMPILE))
    yield
    speculative_loop.PROGRAMS.update(original)


MEASURED_ROUND_COST = speculative_loop.round_cost


@pytest.fixture(scope="module", autouse=True)
def cheap_verification():
    """A verify round costs one plain round: every row with proposals verifies them (the
    exactness tests' subject). Tests of the cost rule set their own cost."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(speculative_loop, "round_cost", lambda *a: 1.0)
        yield


def _weights(config, seed):
    """Prepared weights drawn with numpy (``helpers.random_params``): no init program compiles
    (a jitted ``init_params`` is a compile per config)."""
    return decode.prepare(config, jax.device_put(random_params(config, seed)))


@pytest.fixture(scope="module")
def target():
    return TINY, _weights(TINY, TARGET_SEED)


@pytest.fixture(scope="module")
def draft():
    """A smaller draft (1 layer): the sampled runs' and the device loop's stop-free batch's."""
    config = TINY.replace(n_layers=1)
    return DraftModel(config, _weights(config, 1))


@pytest.fixture(scope="module")
def twin_draft():
    """A draft of the target's config, other random weights: the greedy runs' with a stop
    token, whose program (the draft's config is static) the target as its own draft shares."""
    return DraftModel(TINY, _weights(TINY, 1))


#: The stop token of the greedy and sampled ``generate`` tests (their first row never emits it,
#: the second does) and of the device loop's stop batches (some rows, not all; its stop-free
#: batch none), which so share their plain and draft programs with the greedy test (compiled
#: once): a token the target of seed TARGET_SEED emits so (the tests assert it).
TARGET_SEED, STOP = 8, 10


def _prompts():
    rng = np.random.default_rng(0)
    base = rng.integers(0, TINY.vocab_size, 6).tolist()
    return [base * 3, rng.integers(0, TINY.vocab_size, 9).tolist(), base[:3] * 5 + [7]]


# Proposers and specs -----------------------------------------------------------------------------

def ngram_lookup(context, k, n=3, min_n=1):
    """The engine's host lookup of one sequence."""
    return ngram_proposals([context], [k], n, min_n)[0]


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    seq = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert ngram_lookup(seq, 3, n=3) == [4, 5, 6]  # the latest earlier "1 2 3", not the first
    # past the end of the context the match goes on with its own period (6 tokens here)
    assert ngram_lookup(seq, 8, n=3) == [4, 5, 6, 1, 2, 3, 4, 5]
    assert ngram_lookup([5, 6, 7, 8, 6], 2, n=3) == [7, 8]  # falls back to n = 1
    assert ngram_lookup([5, 6, 7, 8, 6], 2, n=3, min_n=2) == []
    assert ngram_lookup([1, 2, 3], 4) == []
    assert ngram_lookup([4, 4, 4], 3, n=2) == [4, 4, 4]  # the match may overlap the suffix
    assert ngram_lookup([1, 7, 8, 7, 8], 4, n=2) == [7, 8, 7, 8]
    # the bytes of 7 and 256 hold a 0's across their boundary: the lookup matches whole tokens
    assert ngram_lookup([0, 7, 256, 1, 0], 3, n=1) == [7, 256, 1]


@pytest.mark.parametrize("spec, message", [
    ("", "speculative spec must be"),
    ("eagle:k=4", "unknown method 'eagle'"),
    ("ngram:k=0", "k must be a positive int"),
    ("ngram:k=four", "k must be an int"),
    ("ngram:k=99", "k must be at most 16"), ("ngram:n=17", "n must be at most 16"),
    ("ngram:q=3", "bad option 'q=3'"),
    ("ngram:n=2:k", "bad option 'k'"),
    ("draft", "'draft' needs a path"),
    ("draft:k=4", "'draft' needs a path"),
    ("draft:/x:n=2", "bad option 'n=2'"),
])
def test_bad_specs_are_one_line_errors(spec, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_spec(spec)
    assert "\n" not in str(e.value)


def test_specs_parse():
    assert parse_spec("ngram") == SpeculativeConfig("ngram", 4, 3)
    assert parse_spec("ngram:k=6:n=2") == SpeculativeConfig("ngram", 6, 2)
    assert parse_spec("draft:/ckpt/run:k=3") == SpeculativeConfig("draft", 3, draft="/ckpt/run")
    assert parse_spec(str(parse_spec("draft:/a:k=2"))) == parse_spec("draft:/a:k=2")


def test_draft_with_another_vocabulary_is_refused(target, draft):
    config, weights = target
    other = DraftModel(draft.config.replace(vocab_size=65), draft.weights)
    with pytest.raises(ValueError, match=r"vocabulary \(65\) differs from the target's \(64\)"):
        generation.generate(config, weights, [[1, 2, 3]], max_new_tokens=4,
                            speculative="draft:x:k=2", draft=other)
    with pytest.raises(ValueError, match="not supported together with constraints"):
        generation.generate(config, weights, [[1, 2]], max_new_tokens=2, speculative="ngram",
                            constraints=[None])
    with pytest.raises(ValueError, match="sliding-window"):
        speculative_loop.check_no_rings(config.replace(sliding_window=8), "the model")


# Verification ------------------------------------------------------------------------------------

def test_verification_equals_sequential_decode_steps(target):
    """k + 1 positions in one forward: the logits and the cache of k + 1 decode steps."""
    config, weights = target

    @functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
    def both_ways(config, params, tokens, lengths, chunk, start):
        """One program (op by op, the model's many small operations would each compile): the
        verification forward of ``chunk`` and, from the same cache, one decode step per
        position (a scan: one step's code)."""
        _, cache = decode.prefill(config, params, tokens, lengths, 24)
        out = forward_chunk(decode.decode_model(config), params, cache, chunk, start)

        def step(cache, i):
            logits, cache = decode.decode_step(config, params, cache, chunk[:, i], start + i)
            return cache, logits

        steps, step_logits = jax.lax.scan(step, cache, jnp.arange(chunk.shape[1]))
        return out.logits, out.cache, jnp.swapaxes(step_logits, 0, 1), steps

    rng = np.random.default_rng(3)
    tokens = rng.integers(0, config.vocab_size, (2, 8)).astype(np.int32)
    lengths = np.asarray([8, 5], np.int32)
    chunk = rng.integers(0, config.vocab_size, (2, 5)).astype(np.int32)
    logits, one, step_logits, steps = both_ways(config, weights.params, tokens, lengths, chunk,
                                                lengths - 1)
    for i in range(5):
        np.testing.assert_allclose(logits[:, i], step_logits[:, i], atol=2e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves((one.k, one.v)), jax.tree.leaves((steps.k, steps.v)),
                    strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)


def test_accepted_length_is_the_leading_agreement():
    targets = np.asarray([[1, 2, 3, 4], [1, 9, 3, 4], [5, 5, 5, 5], [1, 2, 3, 4]])
    drafts = np.asarray([[1, 2, 3], [1, 2, 3], [0, 5, 5], [1, 2, 3]])
    np.testing.assert_array_equal(  # one program (op by op: one per operation)
        jax.jit(accepted_length)(targets, drafts, np.asarray([3, 3, 3, 2])), [3, 1, 0, 2])


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    from scipy import stats

    probs = np.asarray(probs, np.float64)
    keep = probs > 1e-6
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    expected = probs[keep] / probs[keep].sum() * counts[keep].sum()
    return float(stats.chisquare(counts[keep], expected).pvalue)


def test_rejection_sampling_keeps_the_target_distribution():
    """Drafts from q, the general rule: the first emitted token is distributed as p, for a q
    far from p (and zero where p is not); the second as p's next position after a keep."""
    pytest.importorskip("scipy")
    v, n = 6, 40_000
    # numpy inputs and one jitted program (eager jnp ops compile one program each)
    p = np.asarray([[[0.4, 0.3, 0.1, 0.1, 0.1, 0.0], [0.1, 0.1, 0.1, 0.2, 0.2, 0.3]]],
                   np.float32)
    q = np.asarray([[[0.05, 0.05, 0.2, 0.2, 0.0, 0.5]]], np.float32)

    def one(key):
        d_key, r_key = jax.random.split(key)
        d = jax.random.categorical(d_key, jnp.log(q[:, 0]))[:, None]
        a, tokens = rejection_sample(p, q, d, r_key)
        return a[0], tokens[0]

    a, tokens = jax.device_get(jax.jit(lambda key: jax.vmap(one)(jax.random.split(key, n)))(
        jax.random.key(7)))
    first = np.bincount(tokens[:, 0], minlength=v)
    assert _chi_square_p(first, p[0, 0]) > 1e-3
    kept = a == 1
    second = np.bincount(tokens[kept, 1], minlength=v)
    assert _chi_square_p(second, p[0, 1]) > 1e-3
    # and the acceptance is sum_x min(p, q), what the rule promises
    assert abs(kept.mean() - float(np.minimum(p[0, 0], q[0, 0]).sum())) < 0.01


def test_point_mass_rule_accepts_with_p_and_keeps_p():
    """The n-gram / greedy-draft rule (draw x ~ p with the plain decode's key, keep d iff
    x == d): d kept with probability p(d), and the emitted token distributed as p."""
    pytest.importorskip("scipy")
    from transformer_jax.decode.loop import SamplingSettings

    v, n = 6, 20_000
    probs = np.asarray([0.35, 0.25, 0.2, 0.1, 0.1, 1e-9], np.float32)
    settings = SamplingSettings(temperature=1.0)

    def run(key):  # one program (op by op, each of draw's operations would compile apart)
        keys = jax.random.key_data(jax.random.split(key, n))
        targets, _ = decode.draw(jnp.broadcast_to(jnp.log(probs), (n, 2, v)), keys,
                                 jnp.zeros(n, jnp.int32), settings)
        drafts = jnp.full((n, 1), 1, jnp.int32)
        return targets, accepted_length(targets, drafts, jnp.ones(n, jnp.int32))

    targets, a = jax.device_get(jax.jit(run)(jax.random.key(3)))
    assert abs(a.mean() - 0.25) < 0.015
    emitted = np.where(a == 1, 1, targets[:, 0])
    counts = np.bincount(emitted, minlength=v)
    assert _chi_square_p(counts, probs / probs.sum()) > 1e-3


# generate ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_generate_speculative_gives_the_plain_tokens(target, draft, twin_draft, temperature):
    """n-gram and draft proposers (greedy: a draft of the target's config; sampled: a smaller
    one), greedy and sampled (same seeds), with a stop token (that a row emits): the tokens,
    log-probabilities and stream of the plain ``generate``; some proposals are accepted."""
    config, weights = target
    draft = draft if temperature else twin_draft
    prompts = _prompts()
    kw = dict(max_new_tokens=20, temperature=temperature, seed=[1, 2, 3], stop_tokens=[STOP],
              top_k=20 if temperature else None)
    plain_stream, stream = _recorder()
    ref = generation.generate(config, weights, prompts, stream=stream, **kw)
    assert ref.lengths[0] == 20 > ref.lengths[1] and ref.tokens[1][-1] == STOP
    streamed, stream = _recorder()
    # (greedy: k=8 with n=2, the device loop's stop batches' setting: one program for both)
    ngram = generation.generate(config, weights, prompts,
                                speculative="ngram:k=4" if temperature else "ngram:k=8:n=2",
                                stream=stream, **kw)
    assert ngram.tokens == ref.tokens
    np.testing.assert_allclose(ngram.logprob_array, ref.logprob_array, atol=1e-5)
    assert [i for i, *_ in streamed] == list(range(max(ref.lengths)))
    assert streamed == plain_stream
    # (streamed, so that the device loop test's stop batches reuse this draft program)
    streamed, stream = _recorder()
    with_draft = generation.generate(config, weights, prompts, speculative="draft:x:k=3",
                                     draft=draft, stream=stream, **kw)
    assert with_draft.tokens == ref.tokens and streamed == plain_stream
    if temperature == 0:
        assert sum(s.accepted for s in ngram.speculative) > 0
        # the target as its own draft: every greedy proposal kept
        # (streamed, so that the cost-rule test's second draft reuses this program)
        streamed, stream = _recorder()
        itself = generation.generate(config, weights, prompts, speculative="draft:x:k=3",
                                     draft=DraftModel(config, weights), stream=stream, **kw)
        assert itself.tokens == ref.tokens and streamed == plain_stream
        assert all(s.acceptance_rate == 1.0 for s in itself.speculative if s.proposed)


def test_cost_rule_stops_where_a_round_cannot_pay_and_starts_again():
    """A row verifies while a round's expected tokens (1 + r + ... + r^k at its recent
    acceptance r) exceed the round's cost in plain steps; stopped, it starts again only above
    the cost times 1 + RESTART_MARGIN, on the evidence of the proposals it watched."""
    from transformer_jax.decode.speculative import RESTART_MARGIN, expected_tokens, pays

    for r, k in ((0.0, 4), (0.5, 4), (0.9, 16), (1.0, 3), (0.3, 0)):
        assert expected_tokens(r, k) == pytest.approx(sum(r ** i for i in range(k + 1)),
                                                      rel=2e-3)
    acc = Acceptance()  # the prior: acceptance 1/2, 1.94 tokens from 4 proposals
    assert acc.rate == 0.5 and acc.decide(4, cost=1.5)
    assert not acc.decide(4, cost=2.5) and acc.declined == 1
    between = expected_tokens(0.5, 4) / (1 + RESTART_MARGIN / 2)  # within the hysteresis
    assert not acc.decide(4, between)
    acc.proposing = True
    assert acc.decide(4, between)  # ... where a row that proposes goes on
    acc = Acceptance()
    assert not acc.decide(4, cost=2.5)
    acc.watch([5, 6, 7, 8])  # not verified: plain steps check it as a verification would
    acc.watch([1, 1, 1, 1])  # (one proposal at a time)
    for token in (5, 6, 7):
        acc.observe(token)
    assert (acc.hits, acc.tries) == (1, 2) and acc.matched == 3  # nothing counted mid-watch
    acc.observe(8)  # all four kept: as a verification keeping 4 of 4
    assert (acc.hits, acc.tries) == pytest.approx((0.8 + 4, 1.6 + 4)) and not acc.watched
    assert acc.decide(4, cost=2.5)  # 1 + r + ... + r^4 at r = 4.8 / 5.6: 3.76 > 2.5 * 1.15
    acc.watch([1, 2, 3])
    acc.observe(1)
    acc.observe(9)  # fails at its second: 1 kept of 2 tried
    assert (acc.hits, acc.tries) == pytest.approx((0.8 * 4.8 + 1, 0.8 * 5.6 + 2))
    acc.record(4, 2)  # a verification keeping 2 of 4: 2 hits of 3 tries
    assert acc.tries == pytest.approx(0.8 * (0.8 * 5.6 + 2) + 3)
    assert (acc.proposed, acc.accepted, acc.mean_accepted) == (4, 2, 3.0)
    # the rule in jnp, as the device loop runs it for B rows
    expected, cost = np.asarray([3.0, 3.0, 1.2, 2.6], np.float32), 2.5
    got = jax.jit(pays)(expected, cost, np.asarray([True, False, True, False]))
    assert got.tolist() == [True, True, False, False]

def test_the_budget_leaves_room_for_the_targets_own_token(target):
    """A verification adds the target's own token to the proposals it keeps, so a row with r
    tokens to go proposes at most r - 1 (the device loop's budget): ``generate`` with
    max_new_tokens=2 proposes nothing and verifies nothing."""
    config, weights = target
    prompt = list(range(config.vocab_size - 2))  # nearly every token: the lookup finds one
    out = generation.generate(config, weights, [prompt], max_new_tokens=2,
                              speculative="ngram:k=4")
    assert ngram_lookup(prompt + out.tokens[0][:1], 4), "no proposal to withhold"
    assert (out.speculative[0].proposed, out.speculative[0].verifications) == (0, 0)
    assert out.lengths == [2]


@pytest.mark.parametrize("flag, message", [
    ("ngram:k=x", "k must be an int"),
    ("draft::k=2", "'draft' needs a path"),
    ("lookahead", "unknown method 'lookahead'"),
])
def test_serve_speculative_flag_errors_are_one_line(flag, message):
    from transformer_jax.cli import serve as cli

    args = cli.build_parser().parse_args(["--checkpoint", "x", "--speculative", flag])
    with pytest.raises(ValueError, match=message) as e:
        cli._check(args)
    assert "\n" not in str(e.value)
    cli._check(cli.build_parser().parse_args(["--checkpoint", "x", "--speculative",
                                              "ngram:k=3:n=2"]))


def test_bench_repeat_workload_copies_the_passage():
    from transformer_jax.bench.speculative import repeat_workload

    ids = np.arange(1000) % 50
    (prompt,) = repeat_workload(ids, 1, 40, 8, np.random.default_rng(0), [99])
    assert len(prompt) == 40 + 1 + 8 and prompt[40] == 99
    assert sum(a != b for a, b in zip(prompt[:8], prompt[41:], strict=True)) == 1

@pytest.mark.parametrize("lines", [False, True])
def test_bench_copy_corpus_is_made_of_passages_and_their_copies(lines):
    """Every block of ``copy_corpus`` is a passage of the asked length, then its copy with at
    most two characters changed (none without edits); random passages use the text's
    alphabet; the corpus reaches the asked size and a seed makes the same one."""
    import re

    from transformer_jax.bench.speculative import copy_corpus

    text = "the quick brown fox jumps over the lazy dog " * 50
    for edits in (True, False):
        corpus = copy_corpus(text, 20_000, np.random.default_rng(1), 0.5, (10, 30), 0, edits,
                             lines)
        assert len(corpus) >= (20_000 if not lines else 16_000)  # lines: 4 fewer per block
        assert corpus == copy_corpus(text, 20_000, np.random.default_rng(1), 0.5, (10, 30),
                                     0, edits, lines)
        sep = "\n" if lines else "\n\n"
        blocks = re.findall(f"{sep}([^\n]+){sep}([^\n]+)" if not lines else
                            "([^\n]+)\n([^\n]+)\n", corpus if lines else corpus.replace(
                                "\n\n\n\n", "\n\n"))
        assert len(blocks) > 200
        changed = []
        for passage, copy in blocks:
            assert 10 <= len(passage) < 30 and len(copy) == len(passage)
            assert set(passage) <= set(text) - {"\n"}
            changed.append(sum(a != b for a, b in zip(passage, copy, strict=True)))
        assert max(changed) <= (2 if edits else 0)
        if edits:
            assert 0.3 < np.mean(np.asarray(changed) > 0) < 0.8  # 60% are edited (less ties)



def test_bench_write_copy_corpus_passes_every_option(tmp_path):
    """``bench speculative --write-copy-corpus`` writes ``copy_corpus`` of its options."""
    from transformer_jax.bench import speculative as bench

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 50)
    out = tmp_path / "copy.txt"
    assert bench.main(["--write-copy-corpus", str(out), "--text", str(text), "--seed", "3",
                       "--copy-size", "5000", "--copy-random-share", "0.2",
                       "--copy-passage", "12,20", "--copy-plain", "7", "--copy-no-edits",
                       "--copy-lines"]) == 0
    want = bench.copy_corpus(text.read_text(), 5000, np.random.default_rng(3), 0.2, (12, 20),
                             7, False, True)
    assert out.read_text() == want

def test_bench_copy_records_are_the_repeat_workloads_task(tmp_path):
    """``copy_records``: each prompt is a passage of the asked length, a blank line and the
    passage's first 1..lead characters with exactly one changed (none without edits); the
    completion is the rest of the passage, so prompt's copy + completion = passage but for the
    edit. ``--write-copy-sft`` writes the records of its options as .jsonl."""
    import json

    from transformer_jax.bench import speculative as bench

    text = "the quick brown fox jumps over the lazy dog. " * 50
    for edits in (True, False):
        records = bench.copy_records(text, 400, np.random.default_rng(2), 0.5, (10, 30), 6,
                                     edits)
        assert len(records) == 400
        leads, randoms = [], 0
        for r in records:
            passage, head = r["prompt"].split("\n\n") if "\n\n" in r["prompt"] else (None, None)
            assert passage is not None and 10 <= len(passage) < 30
            assert 1 <= len(head) <= 6 and passage == passage[:len(head)] + r["completion"]
            diff = sum(a != b for a, b in zip(head, passage, strict=False))
            assert diff == (1 if edits else 0)
            leads.append(len(head))
            randoms += passage not in text
        assert set(leads) == set(range(1, 7))
        assert 150 < randoms < 250  # about half are random characters
    text_file = tmp_path / "text.txt"
    text_file.write_text(text)
    out = tmp_path / "copy.jsonl"
    assert bench.main(["--write-copy-sft", str(out), "--text", str(text_file), "--seed", "4",
                       "--copy-records", "30", "--copy-random-share", "0.2",
                       "--copy-passage", "12,20", "--copy-lead", "5", "--copy-no-edits"]) == 0
    want = bench.copy_records(text, 30, np.random.default_rng(4), 0.2, (12, 20), 5, False)
    assert [json.loads(line) for line in out.read_text().splitlines()] == want
    with pytest.raises(SystemExit, match="3 <= MIN < MAX"):
        bench.main(["--write-copy-sft", str(out), "--text", str(text_file),
                    "--copy-passage", "20,12"])
    size = len(text)  # the longest passage the text holds: size - 1 characters
    assert bench.main(["--write-copy-sft", str(out), "--text", str(text_file), "--copy-records",
                       "50", "--copy-passage", f"{size - 2},{size}"]) == 0
    with pytest.raises(SystemExit, match=f"too few for passages of up to {size}"):
        bench.main(["--write-copy-sft", str(out), "--text", str(text_file),
                    "--copy-passage", f"20,{size + 1}"])


def test_bench_workload_prompts_start_with_bos_when_given():
    from transformer_jax.bench.speculative import workload_prompts

    ids = np.arange(500) % 40
    for workload in ("repeat", "free"):
        plain = workload_prompts(workload, ids, 3, 20, 4, np.random.default_rng(5), [99])
        with_bos = workload_prompts(workload, ids, 3, 20, 4, np.random.default_rng(5), [99], 77)
        assert [[77, *p] for p in plain] == with_bos
        assert len(plain[0]) == (20 + 1 + 4 if workload == "repeat" else 20)


def test_bench_serve_text_repeat_prompts_have_the_asked_lengths(tmp_path):
    """``bench serve --workload repeat --text``: each prompt is bos, a passage of the text, a
    blank line and the passage's first ``lead`` tokens with exactly one changed, of the
    workload's length; a length with no room for a passage is a ValueError naming it."""
    from transformer_jax.bench.serve_workload import text_repeat_prompts
    from transformer_jax.tokenizer.spm_backend import Tokenizer

    text = "the quick brown fox jumps over the lazy dog. " * 20 + "A-Z, 0-9!\n" * 5
    tok = Tokenizer.train([text], tmp_path / "char.model", 40, "char")
    path = tmp_path / "text.txt"
    path.write_text(text)
    sep = tok.encode("\n\n")
    lengths = [14, 30, 47]
    prompts = text_repeat_prompts(tok, str(path), lengths, 4, np.random.default_rng(0))
    assert [len(p) for p in prompts] == lengths
    for p, n in zip(prompts, lengths, strict=True):
        passage, rest = p[1:n - 4 - len(sep)], p[n - 4 - len(sep):]
        assert p[0] == tok.bos_id and rest[:len(sep)] == sep
        assert tok.decode(passage) in text
        assert sum(a != b for a, b in zip(rest[len(sep):], passage[:4], strict=True)) == 1
    with pytest.raises(ValueError, match="an input length of 8 leaves no passage"):
        text_repeat_prompts(tok, str(path), [8], 4, np.random.default_rng(0))


def test_bench_distill_records_are_the_targets_greedy_outputs(tmp_path):
    """``distill_records``: each completion is the target's greedy continuation of its prompt
    as ``generate`` gives it (bos first, as the tokenizer adds it; in other batches), up to
    the first special token; the prompts are of both workloads. A tokenizer whose text does
    not round-trip is a ValueError before any generation."""
    import dataclasses

    from transformer_jax.bench.speculative import distill_records
    from transformer_jax.tokenizer.spm_backend import Tokenizer

    text = "the quick brown fox jumps over the lazy dog. " * 20 + "A-Z, 0-9!\n" * 5
    tok = Tokenizer.train([text], tmp_path / "char.model", 40, "char")
    assert tok.add_bos_token and tok.decode(tok.encode(text)) == text
    config = dataclasses.replace(TINY, vocab_size=tok.vocab_size)
    # Drawn with numpy (an op-by-op init_params compiled some 90 programs).
    weights = decode.prepare(config, jax.device_put(random_params(config, seed=3)))
    ids = np.asarray(tok.encode(text))
    records = list(distill_records(config, weights, tok, ids, 8, np.random.default_rng(0),
                                   (6, 12), 3, 5, batch=4))
    assert len(records) == 8
    specials = {tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id} - {-1}
    prompts = [[tok.bos_id, *tok.encode(r["prompt"])] for r in records]
    # Regrouped (the programs distill_records compiled, other rows in each batch):
    stops = sorted(specials)
    want = [o for group in (prompts[::2], prompts[1::2]) for o in generation.generate(
        config, weights, group, max_new_tokens=5, stop_tokens=stops).tokens]
    want = [want[i // 2 + 4 * (i % 2)] for i in range(8)]
    repeats = cut = 0
    for r, alone in zip(records, want, strict=True):
        stop = next((i for i, t in enumerate(alone) if t in specials), len(alone))
        assert tok.encode(r["completion"]) == alone[:stop]
        cut += stop < 5
        repeats += "\n\n" in r["prompt"]
        assert r["prompt"].split("\n\n")[0] in text
    assert 0 < repeats < 8 and cut  # the random model emits special tokens: cut there

    class Lossy:  # a tokenizer whose decode loses a character
        def __getattr__(self, name):
            return getattr(tok, name)

        def decode(self, ids):
            return tok.decode(ids).replace("q", "")

    with pytest.raises(ValueError, match="round-trips"):
        list(distill_records(config, weights, Lossy(), np.asarray(tok.encode("quick " * 3)), 1,
                             np.random.default_rng(0), (6, 12), 3, 2))


# The device loop ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n, min_n", [(3, 1), (2, 2), (4, 2)])
def test_ngram_propose_in_jnp_equals_the_host_lookup(n, min_n):
    """Random sequences over small alphabets (matches, overlaps, none), ragged lengths in one
    batch: the jnp proposals are ``ngram_lookup``'s, and a row finds one iff it does."""
    from transformer_jax.decode.speculative import ngram_propose

    rng = np.random.default_rng(n * 10 + min_n)
    k, s = 6, 40
    propose = jax.jit(ngram_propose, static_argnums=(2, 3, 4))
    for trial in range(12):
        b = 5
        seq = rng.integers(0, 2 + trial % 6, (b, s)).astype(np.int32)
        length = rng.integers(1, s + 1, b).astype(np.int32)
        length[0] = 1  # nothing to match
        drafts, found = propose(jnp.asarray(seq), jnp.asarray(length), k, n, min_n)
        for row in range(b):
            want = ngram_lookup(seq[row, :length[row]], k, n, min_n)
            assert bool(found[row]) == bool(want), (trial, row)
            if want:
                assert np.asarray(drafts[row]).tolist() == want, (trial, row)


def test_round_cost_is_timed_on_the_program_less_its_prefill(caplog):
    """``measure_round_cost`` times the program forced plain, forced to verify and with no
    round, and divides the rounds' times (fastest of its repeats: a spike only adds time; the
    first call, which compiles, not timed); ``round_cost`` keeps it per shape."""
    from transformer_jax.decode.speculative import measure_round_cost

    calls = []

    def run(verify: bool, rounds: int) -> tuple[float, tuple[int, int]]:
        # prefill 5 s, a plain round 1 s, a verify round 3 s; two plain rounds where every
        # row has run out of proposals; the first call compiles, the fourth is slowed down
        counts = (min(rounds, 2), max(rounds - 2, 0)) if verify else (rounds, 0)
        calls.append((verify, rounds))
        spike = 100.0 if len(calls) == 1 else 50.0 if len(calls) == 4 else 0.0
        return 5.0 + counts[0] + 3.0 * counts[1] + spike, counts

    assert measure_round_cost(run, 16) == pytest.approx(3.0)
    assert calls[0] == (False, 0) and {(True, 16), (False, 16), (False, 0)} == set(calls[1:])
    assert measure_round_cost(run, 0) is None  # N = 1: no round to time
    speculative_loop.ROUND_COSTS.pop("key", None)
    with caplog.at_level(logging.INFO, "transformer_jax.decode.speculative_loop"):
        assert MEASURED_ROUND_COST("key", run, 4, 64) == pytest.approx(3.0)
        assert MEASURED_ROUND_COST("key", None, 4, 64) == pytest.approx(3.0)  # kept
    assert sum("costs 3.00 plain rounds" in r.message for r in caplog.records) == 1
    speculative_loop.ROUND_COSTS.pop("key")


def test_generate_measures_the_round_and_gives_the_plain_tokens(target, monkeypatch):
    """Speculative greedy decoding with the cost measured on this machine: the plain tokens;
    the program's first call measured it, the second did not."""
    config, weights = target
    monkeypatch.setattr(speculative_loop, "round_cost", MEASURED_ROUND_COST)
    monkeypatch.setattr(speculative_loop, "ROUND_COSTS", {})
    measured = []
    monkeypatch.setattr(speculative_loop, "measure_round_cost",
                        lambda *a: measured.append(speculative.measure_round_cost(*a)) or
                        measured[-1])
    # Streamed, greedy: test_generate_speculative_gives_the_plain_tokens' programs (compiled).
    kw = dict(max_new_tokens=20, seed=[1, 2, 3], stop_tokens=[STOP], stream=_recorder()[1])
    ref = generation.generate(config, weights, _prompts(), **kw)
    for _ in range(2):
        out = generation.generate(config, weights, _prompts(), speculative="ngram:k=8:n=2",
                                  **kw)
        assert out.tokens == ref.tokens
        np.testing.assert_allclose(out.logprob_array, ref.logprob_array, atol=1e-5)
    assert len(measured) == 1 and measured[0] is not None and measured[0] > 0
    assert list(speculative_loop.ROUND_COSTS.values()) == measured


def test_generate_stops_where_it_cannot_pay_and_starts_again(target, twin_draft, monkeypatch,
                                                             caplog):
    """A verify round measured at 2.5 plain rounds: a random draft's rows stop after the
    prior (1.9 tokens expected from 3 proposals), watch their proposals fail and never
    verify; the target as its own draft stops too, watches its proposals kept, and starts
    again. One log line per program; the plain tokens."""
    config, weights = target
    monkeypatch.setattr(speculative_loop, "round_cost", lambda *a: 2.5)
    monkeypatch.setattr(speculative_loop, "_STOP_LOGGED", set())
    kw = dict(max_new_tokens=20, temperature=0.0, seed=[1, 2, 3], stop_tokens=[STOP],
              top_k=None, stream=_recorder()[1])
    # (streamed: test_generate_speculative_gives_the_plain_tokens' programs, compiled)
    ref = generation.generate(config, weights, _prompts(), **kw)
    with caplog.at_level(logging.INFO, "transformer_jax.decode.speculative_loop"):
        for _ in range(2):
            weak = generation.generate(config, weights, _prompts(),
                                       speculative="draft:x:k=3", draft=twin_draft, **kw)
            assert weak.tokens == ref.tokens
            assert all(s.verifications == 0 and s.declined > 0 for s in weak.speculative)
    stops = [r.message for r in caplog.records if "speculation stopped" in r.message]
    assert len(stops) == 1 and "costs 2.50 plain steps" in stops[0]
    itself = generation.generate(config, weights, _prompts(), speculative="draft:x:k=3",
                                 draft=DraftModel(config, weights), **kw)
    assert itself.tokens == ref.tokens
    for row, s in enumerate(itself.speculative):
        if ref.lengths[row] == 20:  # (the row that stops at once has no time to)
            assert s.declined > 0 and s.verifications > 0 and s.acceptance_rate == 1.0

def _recorder() -> tuple[list, object]:
    """A stream callback and the (index, tokens, active) it was called with."""
    calls: list = []
    return calls, lambda i, t, a: calls.append((i, t.tolist(), a.tolist()))


def test_device_loop_gives_the_plain_tokens_on_ragged_batches(target, draft, twin_draft):
    """Greedy, ragged batches (repetitive and random prompts of lengths 1 to 20, with and
    without a stop token, rows that stop early among rows that run to the end), n-gram with
    k = 1 and k = 8 (n = 2) and drafts: the plain tokens and log-probabilities, the same
    stream, and counters that add up."""
    config, weights = target
    rng = np.random.default_rng(11)
    motif = rng.integers(0, config.vocab_size, 5).tolist()

    def rand(m: int) -> list[int]:
        return rng.integers(0, config.vocab_size, m).tolist()

    # Every batch 3 rows, prompts padded to 32 and 20 new tokens, as in
    # test_generate_speculative_gives_the_plain_tokens: the stop batches' plain, n-gram (k=8
    # with n=2) and draft programs are that test's greedy ones, and the batch without a stop
    # token (n-gram k=1, the smaller draft) has its own speculative programs.
    batches = [
        ([motif * 4, rand(3), rand(1)], (), "ngram:k=1"),
        ([rand(7), rand(12), rand(20)], (STOP,), "ngram:k=8:n=2"),
        ([motif[:2] * 6 + [3], motif[2:] * 6, rand(5)], (STOP,), "ngram:k=8:n=2"),
    ]
    for prompts, stop, ngram in batches:
        kw = dict(max_new_tokens=20, stop_tokens=stop)
        plain_stream, stream = _recorder()
        # Every reference from the greedy test's plain program, with the stop token: with it
        # a row stops early while another runs to the end; the batch without one has no row
        # that draws it, so its greedy tokens (and stream) are also those of a plain decode
        # with no stop token, which every row runs to the end.
        ref = generation.generate(config, weights, prompts, stream=stream, max_new_tokens=20,
                                  stop_tokens=(STOP,))
        early = [n < 20 for n in ref.lengths]
        assert (any(early) and not all(early)) if stop else not any(early), ref.lengths
        # (the greedy test's drafts: the smaller one without a stop token, the twin with it)
        drafts = {"draft": twin_draft if stop else draft}
        for spec, kwargs in ((ngram, {}), ("draft:x:k=3", drafts)):
            streamed, stream = _recorder()
            out = generation.generate(config, weights, prompts, speculative=spec,
                                      stream=stream, **kwargs, **kw)
            assert out.tokens == ref.tokens, (spec, prompts)
            np.testing.assert_allclose(out.logprob_array, ref.logprob_array, atol=1e-5)
            assert streamed == plain_stream, spec
            for row, st in enumerate(out.speculative):
                assert st.accepted <= st.proposed
                assert st.accepted + st.verifications <= out.lengths[row]
