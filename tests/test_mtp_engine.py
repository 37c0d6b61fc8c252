"""Multi-token prediction as a proposer in the serving engine (``speculative="mtp"``,
``serving.mtp``) on a tiny DeepSeek-shaped model (latent attention, a dense then a
mixture-of-experts layer, one module). One forward of the whole sequences without a cache
(``Transformer(mtp=True)``) is the reference: concurrent requests of several lengths under a
pool that preempts decode the greedy continuation (what greedy ``generate`` gives: each token
the argmax of the target's logits at the position before), and every proposal the engine makes
is the argmax of the module's logits at the request's last kept position. A module made to
agree with the target has every proposal kept, and under the cost rule runs its plain steps
while verification does not pay; setups without the module are refused in one line (the
engine, serve, bench serve)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, exit_and_line, random_params

from transformer_jax.bench import serve as bench_serve
from transformer_jax.cli import serve as cli
from transformer_jax.decode import loop as decode
from transformer_jax.model.fields import MLA, MoE
from transformer_jax.model.transformer import Transformer
from transformer_jax.serving import Engine, SamplingParams, speculation
from transformer_jax.serving import mtp as mtp_lib
from transformer_jax.serving.step import Sampler

pytestmark = pytest.mark.usefixtures("fast_generate_compiles", "fast_engine_compiles")

CONFIG = TINY.replace(n_kv_heads=4, head_dim=4, mtp_depth=1,
                      mla=MLA(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                              v_head_dim=8),
                      moe=MoE(4, 2, 16, shared_d_ff=16, dense_layers=(0,)))
N = 10
# 3 slots, pages of 4 positions, 9 usable: fewer than the load needs, so it preempts; one
# page-table width (min_context = max_seq_len), one prompt a step.
ENGINE = dict(num_slots=3, num_pages=10, page_size=4, token_budget=19, min_context=64,
              max_prefill_rows=1)
PROMPTS = [[5, 17, 3, 60, 2], [9, 1], [4, 4, 8, 1, 2, 3, 9, 10, 11, 12, 13], [7],
           [30, 31, 32, 33, 34, 35, 36]]


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(jnp.asarray, random_params(CONFIG, 1))


def _whole(params, seqs):
    """The target's and the module's greedy tokens over whole sequences ([R, S] each, one
    batch padded): entry j of the target's is its prediction of token j + 1; entry j of the
    module's, from the target's hidden state at j and token j + 1, of token j + 2."""
    width = max(map(len, seqs))
    batch = jnp.asarray([s + [0] * (width - len(s)) for s in seqs])

    def run(params, batch):
        out = Transformer(CONFIG).apply({"params": params}, batch, mtp=True)
        return out.logits.argmax(-1), out.mtp[0].argmax(-1)

    return tuple(map(np.asarray, jax.jit(run)(params, batch)))


def _verify_always(monkeypatch):
    """No step time is measured, so every step with a proposal verifies it."""
    monkeypatch.setattr(speculation.Speculation, "record", lambda *a: None)


def _run(params, monkeypatch):
    """The prompts as speculating requests (the last one added while the others run) in a
    fresh engine: ({request index: Completion}, engine, [(index, cached length, proposal)])."""
    _verify_always(monkeypatch)
    eng = Engine(CONFIG, decode.prepare(CONFIG, params), **ENGINE)
    made = []
    original = mtp_lib.EngineMTP.proposal

    def proposal(self, req):
        found = original(self, req)
        made.extend((req.id, req.cached, t) for (t,) in found.values())
        return found

    monkeypatch.setattr(mtp_lib.EngineMTP, "proposal", proposal)
    p = SamplingParams(max_tokens=N, speculative="mtp")
    ids = [eng.add_request(prompt, p) for prompt in PROMPTS[:-1]]
    eng.step()
    ids.append(eng.add_request(PROMPTS[-1], p))
    done = eng.run_until_idle(max_steps=500)
    eng.check_no_leaks()
    index = {rid: i for i, rid in enumerate(ids)}
    return ({index[rid]: c for rid, c in done.items()}, eng,
            [(index[rid], n, t) for rid, n, t in made])


def test_mtp_requests_under_load_decode_greedily_and_propose_the_modules_argmax(
        params, monkeypatch):
    done, eng, made = _run(params, monkeypatch)
    assert sorted(done) == list(range(len(PROMPTS)))
    seqs = [PROMPTS[i] + done[i].tokens for i in range(len(PROMPTS))]
    target, module = _whole(params, seqs)
    for i, prompt in enumerate(PROMPTS):
        assert len(done[i].tokens) == N
        assert done[i].tokens == target[i, len(prompt) - 1:len(seqs[i]) - 1].tolist(), i
    assert eng.scheduler.preemptions > 0, "the load was meant to preempt"
    metrics = eng.speculation.metrics()
    assert metrics["verify_steps"] > 0 and len(made) >= metrics["proposed"] > 20
    # A proposal made at cached length c (token c the last, not cached yet) is the module's
    # entry c - 1: after a prompt (c = its length), a verification or a plain step.
    assert made == [(i, c, int(module[i, c - 1])) for i, c, _ in made]
    assert any(c == len(PROMPTS[i]) for i, c, _ in made), "no first proposal of a prompt"


def test_a_module_that_agrees_with_the_target_has_every_proposal_kept(params, monkeypatch):
    """Zero gains on both final norms: the target's head and the module's see zeros, so the
    target draws token 0 and the module proposes it (tests/test_mtp.py's trick)."""
    agree = {**params, "final_norm": {"scale": jnp.zeros(CONFIG.d_model)},
             "mtp_0": {**params["mtp_0"], "head_norm": {"scale": jnp.zeros(CONFIG.d_model)}}}
    done, eng, made = _run(agree, monkeypatch)
    assert all(done[i].tokens == [0] * N for i in range(len(PROMPTS)))
    m = eng.speculation.metrics()
    assert m["proposed"] > 10 and m["accepted"] == m["proposed"], m
    assert all(c.speculative.accepted == c.speculative.proposed > 0 for c in done.values())


def test_the_cost_rule_runs_the_modules_plain_steps_and_verifies_when_it_pays(params,
                                                                             monkeypatch):
    """Verification measured at 100 plain steps: no verify step, the rows watch their
    proposals on the module's plain steps (T = 1, which keep its pages whole); at 1 plain
    step, an agreeing module's proposals are all verified and kept. The tokens stay the
    target's (token 0: the agreeing model)."""
    agree = {**params, "final_norm": {"scale": jnp.zeros(CONFIG.d_model)},
             "mtp_0": {**params["mtp_0"], "head_norm": {"scale": jnp.zeros(CONFIG.d_model)}}}
    eng = Engine(CONFIG, decode.prepare(CONFIG, agree), **ENGINE)
    spec = eng.speculation
    _verify_always(monkeypatch)  # no measurement replaces the made-up times below
    for cost, verifies in ((100.0, False), (1.0, True)):
        spec.times = {(w, t, c, Sampler()): (cost if t > 1 else 1.0, 10 ** 9)
                      for w in eng.scheduler.widths for t in (1, 2) for c in (False, True)}
        eng.steps = 10 ** 9
        before = spec.metrics()
        rid = eng.add_request(PROMPTS[2], SamplingParams(max_tokens=N, speculative="mtp"))
        done = eng.run_until_idle(max_steps=100)[rid]
        assert done.tokens == [0] * N
        m = spec.metrics()
        assert (m["verify_steps"] > before["verify_steps"]) == verifies
        assert (m["backed_off_steps"] > before["backed_off_steps"]) != verifies
        acc = done.speculative
        assert acc.accepted == acc.proposed and (acc.proposed > 0) == verifies
        assert verifies or acc.declined > 0
    eng.check_no_leaks()


def test_mtp_is_refused_in_one_line_where_it_cannot_run(params, capsys):
    eng = Engine(TINY, decode.prepare(TINY, random_params(TINY, 0)), **ENGINE)
    with pytest.raises(ValueError, match=r"^speculative mtp drafts with the model's multi-token"):
        eng.add_request([1, 2], SamplingParams(max_tokens=2, speculative="mtp"))
    with pytest.raises(ValueError, match=r"^speculative mtp proposes one token a round"):
        SamplingParams(max_tokens=2, speculative="mtp:k=2").validate(CONFIG.vocab_size)
    args = cli.build_parser().parse_args(["--checkpoint", "x", "--speculative", "mtp",
                                          "--tensor", "2"])
    with pytest.raises(ValueError, match="needs one device"):
        cli._check(args)
    code, line = exit_and_line(capsys, bench_serve.main, "--config", "tiny", "--speculative",
                               "mtp")
    assert code == 2 and "the model's multi-token prediction module" in line, line
    assert eng.idle
