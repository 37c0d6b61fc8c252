"""GRPO: advantages and the clipped objective against direct numpy formulas, the engine's
sampled log-probs against the trainer's recomputed ones, an in-memory weight refresh that
changes the engine's outputs and compiles nothing, bad prompt records and reward functions
(FILE:LINE), exact resume (in process) and the CLI end to end (LoRA on a 2-device mesh, then
the export)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers
from helpers import TRAIN_CLI_NO_PLOT, write_chatml_tokenizer

from transformer_jax.checkpoint import loading
from transformer_jax.checkpoint.manager import CheckpointManager
from transformer_jax.cli import export as hf_export
from transformer_jax.data.instruct_records import InstructionDataError
from transformer_jax.model.transformer import Transformer
from transformer_jax.serving import step as step_lib
from transformer_jax.serving.requests import SamplingParams
from transformer_jax.train import grpo as G
from transformer_jax.train import grpo_data
from transformer_jax.train.config import TrainConfig, build_configs
from transformer_jax.train.run import run

pytestmark = pytest.mark.usefixtures("shared_compilation_cache", "fast_engine_compiles")

ROOT = Path(__file__).resolve().parent.parent
WORDS = "yes no cat dog red blue one two say".split()
REWARD = '''
def says_yes(completion, record):
    return float(record["answer"] in completion.split())

def raises(completion, record):
    return {}["missing"]

def text(completion, record):
    return "high"

def huge(completion, record):
    return 1e300

def big(completion, record):
    return 3e38
'''
SMALL = ["train.batch_size=8", "train.grpo_group_size=4", "train.grpo_max_tokens=6",
         "train.seq_len=24", "train.lr=1e-2", "train.min_lr=1e-2", "train.log_every=1",
         "data.val_fraction=0"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(tiny HF Llama dir, prompts.jsonl, rewards.py)."""
    root = tmp_path_factory.mktemp("grpo")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False))
    model.save_pretrained(root / "hf", safe_serialization=True)
    write_chatml_tokenizer(root / "hf", ["system", "user", "assistant", *WORDS],
                           add_eos_token=False)
    lines = [{"messages": [{"role": "user", "content": f"say {w}"}], "answer": "yes"}
             for w in ("yes", "cat", "red", "one")]
    lines += [{"prompt": "say yes", "answer": "yes"}]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (root / "rewards.py").write_text(REWARD)
    return root / "hf", root / "prompts.jsonl", root / "rewards.py"


# ------------------------------------------------------------------------------ formulas


def test_group_advantages_match_the_formula():
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 3, size=12).astype(np.float32)
    rewards[4:8] = 1.0  # a group with one value: advantages 0
    got = G.group_advantages(rewards, 4)
    want = []
    for g in range(3):
        r = rewards[4 * g:4 * g + 4].astype(np.float64)
        mean = sum(r) / 4
        std = (sum((x - mean) ** 2 for x in r) / 3) ** 0.5
        want += [(x - mean) / (std + 1e-4) for x in r]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.all(got[4:8] == 0)
    np.testing.assert_allclose(G.group_advantages(rewards, 4, scale=False),
                               rewards - np.repeat(rewards.reshape(3, 4).mean(1), 4), atol=1e-6)


@pytest.mark.parametrize("loss_type", G.GRPO_LOSSES)
def test_clipped_objective_matches_the_formula(loss_type):
    rng = np.random.default_rng(1)
    b, t, eps, beta, max_tokens = 4, 7, 0.2, 0.1, 9
    logps = rng.normal(-2, 0.5, (b, t)).astype(np.float32)
    old = (logps + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    ref = (logps + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    adv = np.array([1.5, -0.7, 0.3, -1.1], np.float32)
    mask = np.zeros((b, t), np.float32)
    for i, n in enumerate([7, 3, 5, 1]):
        mask[i, t - n:] = 1
    loss, kl, clipped = G.token_terms(logps, old, ref, adv, clip_eps=eps, kl_beta=beta)
    total, count = G.normalised_sum(loss, mask, loss_type, max_tokens)
    want_loss = np.zeros((b, t))
    n_clipped = 0.0
    for i in range(b):
        for j in range(t):
            ratio = np.exp(float(logps[i, j]) - float(old[i, j]))
            c = min(max(ratio, 1 - eps), 1 + eps)
            d = float(ref[i, j]) - float(logps[i, j])
            want_loss[i, j] = -min(ratio * adv[i], c * adv[i]) + beta * (np.exp(d) - d - 1)
            if mask[i, j] and ((ratio < 1 - eps and adv[i] < 0)
                               or (ratio > 1 + eps and adv[i] > 0)):
                n_clipped += 1
    np.testing.assert_allclose(loss, want_loss, rtol=2e-5, atol=1e-6)
    per_row = (want_loss * mask).sum(1)
    if loss_type == "token":
        want = per_row.sum() / mask.sum()
    elif loss_type == "sequence":
        want = np.mean(per_row / mask.sum(1))
    else:
        want = per_row.sum() / (b * max_tokens)
    assert float(total / count) == pytest.approx(want, rel=1e-5)
    assert float((np.asarray(clipped) * mask).sum()) == n_clipped > 0
    assert np.all(np.asarray(kl) >= 0)


# ------------------------------------------------------------------------------ engine


@pytest.fixture(scope="module")
def loaded(setup):
    hf_dir, prompts_file, _ = setup
    ckpt = loading.load(loading.locate(str(hf_dir)))
    prompts = grpo_data.load_prompts(prompts_file, ckpt.tokenizer, 18)
    return ckpt, prompts


# The engines' settings: 8 slots, pages for 18 + 6 tokens (the engines of this module are of one
# shape, so they share their compiled programs).
ENGINE_TC = TrainConfig(objective="grpo", reward="m:f", batch_size=8, grpo_group_size=4,
                        grpo_max_tokens=6, seq_len=24)


@pytest.fixture(scope="module")
def rollouts(loaded):
    """A step's rollouts of 2 prompts x G=4 (6 tokens each) by ``make_engine``'s engine (which
    ``train.seq_len`` does not change): (prompt rows, completions, sampled log-probs)."""
    ckpt, prompts = loaded
    engine = G.make_engine(ckpt.config, ckpt.params, ENGINE_TC, 18)
    rows, completions, lps = G.sample(engine, prompts[:2], ENGINE_TC, 0, eos_id=-1)
    return rows, completions, lps


def test_engine_logps_equal_the_trainers(loaded, rollouts):
    """The log-probs the engine reports for its sampled tokens = the training forward's."""
    ckpt, _ = loaded
    rows, completions, lps = rollouts
    assert len(set(map(tuple, completions))) > 2  # sampled, not all the same
    batch = G.grpo_batch(rows, completions, lps, np.zeros(8), 24)
    ours = jax.jit(G.make_logps_fn(Transformer(ckpt.config)))(ckpt.params, batch)
    mask = batch["mask"] > 0
    assert mask.sum() == 8 * 6
    gap = np.abs(np.asarray(ours)[mask] - batch["old_logps"][mask]).max()
    assert gap < 1e-5, gap


def test_the_update_runs_at_the_batchs_bucket_and_changes_nothing(loaded, rollouts):
    """A step's batch is as long as its longest row's bucket (powers of two from 16, at most
    train.seq_len), so the update compiles once per bucket; its objective, gradient and
    log-probs equal those of the batch padded to seq_len."""
    assert G.batch_length([np.zeros(5)], [[1] * 4], 512) == 16  # rows of 8 tokens
    assert G.batch_length([np.zeros(9), np.zeros(3)], [[1] * 8, [1]], 512) == 16
    assert G.batch_length([np.zeros(9)], [[1] * 9], 512) == 32  # 17
    assert G.batch_length([np.zeros(40)], [[1] * 9], 48) == 48  # at most seq_len
    ckpt, _ = loaded
    rows, completions, lps = rollouts
    seq_len = 64  # train.seq_len
    t = G.batch_length(rows, completions, seq_len)
    longest = max(len(r) + len(c) for r, c in zip(rows, completions, strict=True)) - 1
    assert t in (16, 32) and longest <= t < seq_len
    advantages = np.linspace(-1, 1, 8).astype(np.float32)
    model = Transformer(ckpt.config)
    loss_fn = G.make_grpo_loss_fn(model, lambda p: p, loss_type="token", clip_eps=0.2,
                                  kl_beta=0.1, max_tokens=6)
    logps_fn = jax.jit(G.make_logps_fn(model))  # one program per length, as in training
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    out = []
    for length in (t, seq_len):
        batch = G.grpo_batch(rows, completions, lps, advantages, length)
        batch["ref_logps"] = batch["old_logps"] * 1.1
        logps = np.asarray(logps_fn(ckpt.params, batch))[:, :t]
        (loss, aux), grads = grad_fn(ckpt.params, batch)
        out.append((logps * batch["mask"][:, :t], loss, aux[2], grads))
    np.testing.assert_allclose(out[0][0], out[1][0], atol=1e-6)
    # The objective sums float32 terms over 16 or 64 positions: another order of the same
    # sum (differences of 4e-6 on 0.1435 seen) stays well inside rtol 1e-4 + atol 1e-5.
    np.testing.assert_allclose(out[0][1], out[1][1], rtol=1e-4, atol=1e-5)
    assert out[0][2] == out[1][2] == 8 * 6  # the same completion tokens counted
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), out[0][3],
                 out[1][3])  # float32 sums over 16 or 64 positions


def test_weight_refresh_changes_outputs_and_compiles_nothing(loaded):
    ckpt, prompts = loaded
    tc = ENGINE_TC
    rng = np.random.default_rng(3)  # numpy noise: jax.random op by op compiles per shape
    other = jax.device_put(jax.tree.map(
        lambda x: np.asarray(x) + 0.3 * rng.standard_normal(x.shape, np.float32), ckpt.params))

    def greedy(engine):
        ids = [engine.add_request(p.tokens.tolist(), SamplingParams(max_tokens=5))
               for p in prompts[:4]]
        done = engine.run_until_idle()
        return [done[i].tokens for i in ids], [done[i].logprobs for i in ids]

    fresh_other = greedy(G.make_engine(ckpt.config, other, tc, 18))
    engine = G.make_engine(ckpt.config, ckpt.params, tc, 18)
    before = greedy(engine)
    engine.update_weights(other)  # compiles the prepare program once
    engine.update_weights(ckpt.params)
    compiled = step_lib.step_jit._cache_size()
    assert greedy(engine) == before
    engine.update_weights(other)
    after = greedy(engine)
    assert step_lib.step_jit._cache_size() == compiled  # nothing compiled again
    assert after[0] == fresh_other[0] and after[0] != before[0]
    np.testing.assert_allclose(np.concatenate(after[1]), np.concatenate(fresh_other[1]),
                               atol=1e-6)
    with pytest.raises(ValueError, match="structure, shape"):
        engine.update_weights(jax.tree.map(lambda x: np.asarray(x)[..., :1], ckpt.params))


# ------------------------------------------------------------------------------ bad input


def test_bad_records_and_rewards_name_the_record(setup, loaded, tmp_path):
    hf_dir, prompts_file, rewards_file = setup
    ckpt, prompts = loaded
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "say yes"}\n\n{"answer": "yes"}\n')
    with pytest.raises(InstructionDataError, match=rf"{bad}:3: a GRPO record needs"):
        grpo_data.load_prompts(bad, ckpt.tokenizer, 18)
    with pytest.raises(InstructionDataError, match=rf"{prompts_file}:1: the prompt has \d+ "
                       "tokens, more than the 3"):
        grpo_data.load_prompts(prompts_file, ckpt.tokenizer, 3)
    for name, match in (("raises", r"reward .*:raises raised KeyError: 'missing'"),
                        ("text", r"reward .*:text returned 'high' \(str\), not a finite number")):
        rewards = grpo_data.load_rewards(f"{rewards_file}:{name}")
        with pytest.raises(grpo_data.RewardError, match=rf"{prompts_file}:2: {match}"):
            grpo_data.score(rewards, "yes", prompts[1])
    # Finite in Python, inf in float32 (the update's): refused as NaN and inf are, naming the
    # reward, not left to end the run as a non-finite loss; so is a weighted or summed one.
    for spec, match in (("huge", r"reward .*:huge returned 1e\+300, beyond float32's range"),
                        ("big*2", r"reward .*:big returned 3e\+38 \(weighted 6e\+38\), "
                                  "beyond float32's range"),
                        ("big,{f}:big", r"the rewards .*:big, .*:big sum to 6e\+38, beyond")):
        rewards = grpo_data.load_rewards(f"{rewards_file}:" + spec.format(f=rewards_file))
        with pytest.raises(grpo_data.RewardError, match=rf"{prompts_file}:2: {match}"):
            grpo_data.score(rewards, "yes", prompts[1])
    assert grpo_data.score(grpo_data.load_rewards(f"{rewards_file}:big"), "", prompts[0]) == 3e38
    both = grpo_data.load_rewards(f"{rewards_file}:says_yes,{rewards_file}:says_yes*0.5")
    assert grpo_data.score(both, "yes", prompts[0]) == 1.5
    for spec, match in (("nocolon", "not MODULE:FUNCTION"), ("os:nope", "no function 'nope'"),
                        ("no_such_module_x:f", "cannot import"), ("m:f*x", "not MODULE")):
        with pytest.raises(ValueError, match=match):
            grpo_data.load_rewards(spec)
    for key, value, match in (("grpo_loss", "mean", "grpo_loss must be one of"),
                              ("grpo_group_size", 1, "grpo_group_size must be >= 2"),
                              ("grpo_kl_beta", -1.0, "grpo_kl_beta must be a number >= 0"),
                              ("grpo_temperature", 0.0, "grpo_temperature must be a number > 0"),
                              ("batch_size", 6, r"batch_size \(6\) counts completions"),
                              ("reward", "", "needs train.reward")):
        kw = {"objective": "grpo", "reward": "m:f", "grpo_group_size": 4, "batch_size": 8,
              key: value}
        with pytest.raises(ValueError, match=match):
            TrainConfig(**kw)


# ------------------------------------------------------------------------------ runs


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_resume_is_exact(setup, tmp_path, monkeypatch):
    """Killed after step 2's record but before its checkpoint (kill -9; the checkpoint of step 2
    removed), resumed from step 1 to 2 = the straight run of 2 it was killed in (rollouts,
    rewards, losses and weights, taken before the kill; ``metrics.jsonl`` holds each step
    once), full fine-tuning with the KL to the initial weights made again on resume. Each step
    samples its rollouts with seeds of its own."""
    hf_dir, prompts_file, rewards_file = setup
    seeds: list[int] = []  # the engine seed of every rollout request, in order
    add_request = G.Engine.add_request

    def recording(engine, prompt, params):
        seeds.append(params.seed)
        return add_request(engine, prompt, params)

    monkeypatch.setattr(G.Engine, "add_request", recording)
    from transformer_jax.train import plot

    monkeypatch.setattr(plot, "plot_run", lambda run_dir: None)  # no loss plots: not tested here

    def go(run_dir: Path, steps: int):
        model, train, data = build_configs("grpo", [
            f"train.init_from={hf_dir}", f"data.path={prompts_file}", *SMALL,
            f"train.reward={rewards_file}:says_yes", f"train.run_dir={run_dir}",
            f"train.steps={steps}", "train.ckpt_every=1", "train.mesh=1,1,1"])
        return run(model, train, data, progress=False, memory_check=False)

    run_dir = tmp_path / "a"
    go(run_dir, 2)  # the straight run: its step 2, as it was before the kill
    straight_seeds = seeds[:]
    b, _ = CheckpointManager(run_dir / "checkpoints", async_save=False).restore_params(None, 2)
    mb = _metrics(run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "2")  # killed before step 2's checkpoint
    assert [m["step"] for m in mb] == [1, 2]
    del seeds[:]
    summary = go(run_dir, 2)
    assert (summary.start_step, summary.final_step) == (1, 2)
    # 8 rollouts a step; the seeds of step 2 are not step 1's (a step reusing them samples
    # the same completions again), and the resumed run's step 2 drew exactly the straight one's.
    assert len(straight_seeds) == 16 and len(set(straight_seeds[:8])) == 8
    assert len(set(straight_seeds[8:])) == 8
    assert not set(straight_seeds[:8]) & set(straight_seeds[8:])
    assert seeds == straight_seeds[8:]
    a, _ = CheckpointManager(run_dir / "checkpoints", async_save=False).restore_params(None, 2)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    keys = ("step", "loss", "reward_mean", "kl", "completion_len", "grad_norm")
    ma = _metrics(run_dir)
    assert [[m[k] for k in keys] for m in ma] == [[m[k] for k in keys] for m in mb]
    assert [m["step"] for m in ma] == [1, 2]  # the killed run's record of step 2 not kept twice
    assert mb[0]["kl"] == pytest.approx(0, abs=1e-6) and mb[1]["kl"] > 0  # moved off the ref
    assert {m["batch_len"] for m in ma + mb} <= {16, 24}  # train.seq_len=24's buckets


def test_grpo_cli_lora_on_a_two_device_mesh(setup, tmp_path):
    """``python train.py --config grpo train.init_from=DIR data.path=prompts.jsonl
    train.reward=rewards.py:says_yes ...`` (the CLI's main in a fresh process, no loss plot) with
    LoRA over 2 simulated devices; then export."""
    hf_dir, prompts_file, rewards_file = setup
    run_dir = tmp_path / "cli"
    cmd = [*TRAIN_CLI_NO_PLOT, "--config", "grpo", "--no-progress", "--no-memory-check",
           "--cpu-devices", "2", f"train.init_from={hf_dir}", f"data.path={prompts_file}",
           f"train.reward={rewards_file}:says_yes", f"train.run_dir={run_dir}",
           "train.steps=2", "train.lora_rank=4", "train.mesh=-1,1,1", "train.grad_accum=2",
           *SMALL]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "KL reference: adapters-off" in done.stderr
    records = _metrics(run_dir)
    assert len(records) == 2  # the second after a weight refresh
    for key in ("reward_mean", "reward_std", "kl", "clip_fraction", "completion_len",
                "rollout_tokens_per_s", "time/rollout_share", "time/refresh_share",
                "time/update_share"):
        assert all(np.isfinite(m[key]) for m in records), key
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 2
    # Exported as any run (LoRA merged): transformers' logits = ours on the run's weights.
    out = hf_export.export(run_dir / "checkpoints", tmp_path / "export")
    ours = loading.load(run_dir / "checkpoints", with_tokenizer=False)
    tokens = np.array([[3, 5, 7, 9, 11]])
    logits = jax.jit(Transformer(ours.config).apply)({"params": ours.params}, tokens).logits
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out)(torch.tensor(tokens)).logits
    np.testing.assert_allclose(np.asarray(logits), theirs.detach().numpy(), atol=1e-4)
