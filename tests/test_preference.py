"""Preference training: DPO (sigmoid, IPO) and ORPO losses against their formulas and against
TRL's own trainers on a tiny HF Llama, pair packing, the LoRA adapters-off reference, bad
records, the CLI end to end (one subprocess, LoRA on a 2-device mesh) and exact resume (in
process).

Parity runs TRL 1.16's code itself on ``LlamaForCausalLM`` models loaded from the weights the
test writes with ``save_pretrained``: ``trl.DPOTrainer`` (``loss_type`` sigmoid / ipo, a
separate reference model) and ``trl.experimental.orpo.ORPOTrainer``, each built on CPU with a
one-record in-memory ``datasets.Dataset``; the fixed batch of pairs (our tokenisation, padded
and unpacked by the trainer's own ``data_collator``) goes through the trainer's
``compute_loss`` (DPO ``_compute_loss``; ORPO ``get_batch_loss_metrics``), and
``loss.backward()`` gives the gradients. The rewards are the ones the trainer logs.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from helpers import TRAIN_CLI_NO_PLOT, write_chatml_tokenizer

from transformer_jax import hf
from transformer_jax.checkpoint import loading
from transformer_jax.checkpoint.manager import CheckpointManager
from transformer_jax.data import preference as pref_data
from transformer_jax.data.instruct_records import InstructionDataError
from transformer_jax.model import lora
from transformer_jax.tokenizer import load_tokenizer
from transformer_jax.train import preference as P
from transformer_jax.train.config import TrainConfig, build_configs
from transformer_jax.train.run import make_objective, run
from transformer_jax.train.step import ParamsLayout, make_init_fn, stat_means

pytestmark = pytest.mark.usefixtures("shared_compilation_cache")

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the cat dog sat ran on a mat red blue big small yes no one two good bad".split()
VOCAB = 32
SMALL = ["train.batch_size=4", "train.grad_accum=1", "train.seq_len=48", "train.lr=5e-3",
         "train.min_lr=5e-4", "train.warmup_steps=1", "train.decay_steps=12",
         "train.log_every=1", "train.eval_every=0", "data.val_fraction=0",
         "train.peak_flops=1e9"]  # MFU's peak given: no matmul measured in each run


def _hf_model_dir(directory: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False))
    model.save_pretrained(directory, safe_serialization=True)
    write_chatml_tokenizer(directory, ["system", "user", "assistant", *WORDS],
                           add_eos_token=False)
    return directory


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(policy, reference): two random tiny Llamas written by save_pretrained."""
    return (_hf_model_dir(tmp_path_factory.mktemp("policy"), 0),
            _hf_model_dir(tmp_path_factory.mktemp("reference"), 1))


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    """Text and chat pairs with a learnable preference (chosen says the colour twice)."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(24):
        animal, colour = rng.choice(["cat", "dog"]), rng.choice(["red", "blue"])
        other = "blue" if colour == "red" else "red"
        if i % 2:
            lines.append({"prompt": f"the {animal} sat on a {colour} mat",
                          "chosen": f" {colour} {colour} good", "rejected": f" {other} bad"})
        else:
            lines.append({"prompt": [{"role": "user", "content": f"the {colour} {animal}"}],
                          "chosen": f"{colour} {colour} good",
                          "rejected": {"role": "assistant", "content": f"{other} no bad"}})
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


# ------------------------------------------------------------------------------ formulas


def test_losses_equal_their_formulas_on_hand_checked_numbers():
    pc, pr = jnp.array([-3.0, -5.0]), jnp.array([-4.0, -2.0])
    rc, rr = jnp.array([-3.5, -4.0]), jnp.array([-3.5, -3.0])
    # d = (pc - rc) - (pr - rr) = [0.5 - (-0.5), -1 - 1] = [1, -2]; beta 0.5 -> [0.5, -1].
    losses, chosen, rejected = P.dpo_losses(pc, pr, rc, rr, beta=0.5)
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    np.testing.assert_allclose(losses, -np.log(sig(np.array([0.5, -1.0]))), rtol=1e-6)
    np.testing.assert_allclose(chosen, [0.25, -0.5], rtol=1e-6)
    np.testing.assert_allclose(rejected, [-0.25, 0.5], rtol=1e-6)
    smooth, _, _ = P.dpo_losses(pc, pr, rc, rr, beta=0.5, label_smoothing=0.2)
    x = np.array([0.5, -1.0])
    np.testing.assert_allclose(smooth, -0.8 * np.log(sig(x)) - 0.2 * np.log(sig(-x)), rtol=1e-6)
    # IPO: per-token averages: chosen ratio [0.5, -1] / [2, 4], rejected [-0.5, 1] / [1, 2].
    ipo, _, _ = P.dpo_losses(pc, pr, rc, rr, beta=0.5, loss_type="ipo",
                             chosen_tokens=jnp.array([2.0, 4.0]),
                             rejected_tokens=jnp.array([1.0, 2.0]))
    d = np.array([0.25 + 0.5, -0.25 - 0.5])
    np.testing.assert_allclose(ipo, (d - 1.0) ** 2, rtol=1e-6)
    # ORPO: log odds of mean log-probs -0.5, -1: log(p/(1-p)) differences.
    ratio, log_odds = P.orpo_odds_ratio(jnp.array([-0.5]), jnp.array([-1.0]))
    odds = lambda lp: np.log(np.exp(lp) / (1 - np.exp(lp)))  # noqa: E731
    np.testing.assert_allclose(log_odds, [odds(-0.5) - odds(-1.0)], rtol=1e-6)
    np.testing.assert_allclose(ratio, np.log(sig(log_odds)), rtol=1e-6)
    np.testing.assert_allclose(P.log1mexp(jnp.array([-1e-3, -0.5, -5.0])),
                               np.log(1 - np.exp([-1e-3, -0.5, -5.0])), rtol=1e-5)
    stats = P.reward_stats(chosen, rejected, jnp.array([1.0, 0.0]))
    assert float(stats["rewards/accuracy"]) == 1.0
    assert float(stats["rewards/margin"]) == pytest.approx(0.5)


def test_reward_accuracy_counts_a_tie_as_no_win():
    """``rewards/accuracy`` counts chosen > rejected strictly, as TRL: a tie is not a win. Ties
    are every pair of full DPO's step 1 (policy = reference: both rewards 0), logged 0 there."""
    chosen = jnp.array([0.0, 0.5, -1.0, 2.0, 0.0])
    rejected = jnp.array([0.0, 0.5, -2.0, 3.0, 0.0])  # tie, tie, win, loss, tie (padding)
    stats = P.reward_stats(chosen, rejected, jnp.array([1.0, 1.0, 1.0, 1.0, 0.0]))
    assert float(stats["rewards/accuracy"]) == 1.0  # the one win of the 4 valid pairs
    zeros = jnp.zeros(3)
    assert float(P.reward_stats(zeros, zeros, jnp.ones(3))["rewards/accuracy"]) == 0.0


# ------------------------------------------------------------------------------ data


def test_packing_keeps_the_sides_apart_and_scores_the_completions_only(hf_dirs, pairs_file):
    tokenizer = load_tokenizer(hf_dirs[0])
    pairs = pref_data.load_pairs(pairs_file, tokenizer)
    packed = pref_data.pack_pairs(pairs, seq_len=47)
    rows = packed.rows
    assert packed.num_pairs == 24 and rows.num_rows < 24  # several pairs a row
    seen = set()
    for r in range(rows.num_rows):
        for k, pair in enumerate(packed.pair_ids[r]):
            if pair < 0:
                continue
            seen.add(int(pair))
            for side, example in enumerate(pairs[pair]):
                at = rows.segment_ids[r] == 2 * k + 1 + side  # one segment per side
                np.testing.assert_array_equal(rows.tokens[r, at], example.tokens)
                np.testing.assert_array_equal(rows.loss_tokens[r, at], example.loss)
                np.testing.assert_array_equal(rows.positions[r, at], np.arange(at.sum()))
    assert seen == set(range(24))
    # The loss is on the completion only: a text pair's prompt tokens carry none.
    chosen = pairs[1][0]
    prompt = tokenizer.encode("the cat sat on a red mat") or []
    assert not chosen.loss[:len(prompt)].any() and chosen.loss[-1]
    text = tokenizer.decode(chosen.tokens[chosen.loss].tolist())
    assert text.split() == ["red", "red", "good"] or "good" in text
    # Chat: the loss covers the assistant reply and the template's close, not the user turn.
    reply = pairs[0][1]
    scored = tokenizer.decode(reply.tokens[reply.loss].tolist())
    assert "bad" in scored and "user" not in scored


def test_pairs_grouped_by_step_give_every_step_its_pairs(hf_dirs, pairs_file):
    """``train.pairs_per_step`` (``group_pairs``): each step's batch holds exactly N pairs (the
    epoch's last the rest), each pair's tokens as ``load_pairs`` made them (sides apart), in
    batches of one shape whose rows the devices x micro-batches divide; an epoch trains on
    every pair once, and the grouping is a function of the seed."""
    tokenizer = load_tokenizer(hf_dirs[0])
    pairs = pref_data.load_pairs(pairs_file, tokenizer)
    packed = pref_data.pack_pairs(pairs, seq_len=47)
    grouped = pref_data.group_pairs(packed, 5, seed=3, multiple=2)
    step_rows = grouped.step_rows
    assert step_rows % 2 == 0 and grouped.rows.num_rows == 5 * step_rows  # 24 pairs: 5 steps
    batches = pref_data.PairBatches(grouped, step_rows, seed=7)
    epochs = []
    for epoch in range(2):
        ids = [batches.get(step)["pair_ids"] for step in range(5 * epoch, 5 * epoch + 5)]
        assert sorted((i >= 0).sum() for i in ids) == [4, 5, 5, 5, 5]
        assert sorted(int(p) for i in ids for p in i.ravel() if p >= 0) == list(range(24))
        epochs.append([frozenset(i[i >= 0].tolist()) for i in ids])
    assert set(epochs[0]) == set(epochs[1]) and epochs[0] != epochs[1]  # groups reshuffled
    rows = grouped.rows
    for r in range(rows.num_rows):
        for k, pair in enumerate(grouped.pair_ids[r]):
            if pair < 0:
                continue
            for side, example in enumerate(pairs[pair]):
                at = rows.segment_ids[r] == 2 * k + 1 + side
                np.testing.assert_array_equal(rows.tokens[r, at], example.tokens)
                np.testing.assert_array_equal(rows.loss_tokens[r, at], example.loss)
                np.testing.assert_array_equal(rows.positions[r, at], np.arange(at.sum()))
        used = rows.segment_ids[r] > 0  # the pairs, then padding only
        n = sum(len(e.tokens) for p in grouped.pair_ids[r] if p >= 0 for e in pairs[p])
        np.testing.assert_array_equal(used, np.arange(len(used)) < n)
    again = pref_data.group_pairs(packed, 5, seed=3, multiple=2)
    np.testing.assert_array_equal(again.rows.tokens, rows.tokens)
    other = pref_data.group_pairs(packed, 5, seed=4, multiple=2)
    assert not np.array_equal(other.pair_ids, grouped.pair_ids)
    with pytest.raises(ValueError, match="rows a step, not batch_size=3"):
        pref_data.PairBatches(grouped, 3)
    for key, value, match in (("pairs_per_step", -1, "pairs_per_step must be an int >= 0"),
                              ("objective", "sft", "pairs_per_step=4 applies to objective=dpo")):
        with pytest.raises(ValueError, match=match):
            TrainConfig(**{"objective": "dpo", "pairs_per_step": 4, key: value})


def test_bad_records_name_file_and_line(hf_dirs, pairs_file, tmp_path):
    tokenizer = load_tokenizer(hf_dirs[0])
    good = {"prompt": "the cat", "chosen": " red", "rejected": " blue"}
    cases = [({"prompt": "the cat", "chosen": " red"}, "missing ['rejected']"),
             ({**good, "chosen": 3}, '"chosen" must be a string'),
             ({**good, "prompt": 5}, '"prompt" must be a string or a list'),
             ({**good, "prompt": [{"role": "user"}]}, 'message 0 has no "content"'),
             ({**good, "prompt": [{"role": "user", "content": "x"}], "rejected": []},
              '"rejected" must be a string, a message')]
    for record, message in cases:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(good) + "\n\n" + json.dumps(record) + "\n")
        with pytest.raises(InstructionDataError) as e:
            pref_data.load_pairs(path, tokenizer)
        assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value), e.value
    # dpo on SFT records, or on text: one line each, before any training.
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"prompt": "the cat", "completion": " red"}) + "\n")
    model, train, data = build_configs("dpo", [f"train.init_from={hf_dirs[0]}",
                                               f"data.path={sft}", *SMALL,
                                               f"train.run_dir={tmp_path / 'r'}"])
    with pytest.raises(ValueError, match=r'objective=dpo needs preference records .*sft.jsonl'):
        run(model, train, data, progress=False)
    model, train, data = build_configs("finetune", [f"train.init_from={hf_dirs[0]}",
                                                    f"data.path={pairs_file}", *SMALL])
    with pytest.raises(InstructionDataError, match=r"pairs.jsonl:1: .*train.objective=dpo"):
        run(model, train, data, progress=False)  # pairs under objective=sft: says what to set
    text = tmp_path / "corpus.txt"
    text.write_text("the cat sat\n")
    model, train, data = build_configs("dpo", [f"train.init_from={hf_dirs[0]}",
                                               f"data.path={text}", *SMALL])
    with pytest.raises(ValueError, match=r"objective=dpo needs data.path=FILE.jsonl"):
        run(model, train, data, progress=False)
    for bad, match in [("train.objective=ppo", "objective must be one of"),
                       ("train.dpo_loss=hinge", "dpo_loss must be one of"),
                       ("train.dpo_beta=0", "dpo_beta must be a number > 0"),
                       ("train.dpo_label_smoothing=0.7", r"dpo_label_smoothing must be in")]:
        with pytest.raises(ValueError, match=match):
            build_configs("dpo", [bad])


# ------------------------------------------------------------------------------ parity


def _split(example) -> tuple[list[int], list[int]]:
    """(prompt, completion) token ids of one side: the loss covers a suffix of the tokens."""
    first = int(np.argmax(example.loss))
    assert example.loss[first:].all() and not example.loss[:first].any()
    tokens = [int(t) for t in example.tokens]
    return tokens[:first], tokens[first:]


def _trl_trainer(kind: str, policy, reference, tokenizer, beta: float, out: Path):
    """TRL's own trainer on the local models: ``DPOTrainer`` (``loss_type`` sigmoid or ipo,
    the reference a separate model) or ``trl.experimental.orpo.ORPOTrainer``. The tiny
    in-memory datasets.Dataset only lets the trainer build; the batch is made from our tokens
    by the trainer's own collator (see ``_trl_loss``)."""
    import datasets
    from trl import DPOConfig, DPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    common = dict(output_dir=str(out), beta=beta, report_to=[], use_cpu=True,
                  per_device_train_batch_size=2, save_strategy="no", bf16=False)
    text = datasets.Dataset.from_list([{"prompt": "the cat", "chosen": " red",
                                        "rejected": " blue"}])
    if kind == "orpo":
        return ORPOTrainer(model=policy, args=ORPOConfig(max_length=64, **common),
                           train_dataset=text, processing_class=tokenizer)
    return DPOTrainer(model=policy, ref_model=reference, processing_class=tokenizer,
                      args=DPOConfig(loss_type=[kind], **common), train_dataset=text)


def _trl_loss(trainer, kind: str, pairs) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's loss (autograd through the policy) and reward metrics on ``pairs``' tokens:
    ``trainer.data_collator`` pads them, ``trainer.compute_loss`` (DPO: ``_compute_loss``,
    rewards in ``trainer._metrics["train"]``; ORPO: ``get_batch_loss_metrics``, rewards in
    ``trainer._stored_metrics["train"]``)."""
    if kind == "orpo":
        features = []
        for chosen, rejected in pairs:
            feature = {}
            for side, example in (("chosen", chosen), ("rejected", rejected)):
                prompt, completion = _split(example)
                feature[f"{side}_input_ids"] = prompt + completion
                feature[f"{side}_attention_mask"] = [1] * (len(prompt) + len(completion))
                feature[f"{side}_labels"] = [-100] * len(prompt) + completion
            features.append(feature)
        loss = trainer.compute_loss(trainer.model, trainer.data_collator(features))
        stored = trainer._stored_metrics["train"]
        return loss, {k: stored[f"rewards/{k}"][-1]
                      for k in ("chosen", "rejected", "accuracies", "margins")}
    features = []
    for chosen, rejected in pairs:
        (prompt, c), (prompt_r, r) = _split(chosen), _split(rejected)
        assert prompt == prompt_r
        features.append({"prompt_ids": prompt, "chosen_ids": c, "rejected_ids": r})
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(features))
    logged = trainer._metrics["train"]
    return loss, {k: logged[f"rewards/{k}"][-1]
                  for k in ("chosen", "rejected", "accuracies", "margins")}


@pytest.fixture(scope="module")
def parity_setup(hf_dirs, pairs_file):
    tokenizer = load_tokenizer(hf_dirs[0])
    pairs = pref_data.load_pairs(pairs_file, tokenizer)[:6]
    packed = pref_data.pack_pairs(pairs, seq_len=47)
    loaded = [loading.load(d, with_tokenizer=False, dtype="float32") for d in hf_dirs]
    return pairs, packed, loaded


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "orpo"])
def test_loss_rewards_and_gradients_equal_trl(parity_setup, hf_dirs, kind, tmp_path):
    """Our jitted loss, rewards and gradients on packed rows = TRL 1.16's own trainer code on
    the same weights and tokens (right-padded, unpacked): ``DPOTrainer.compute_loss`` (loss
    types sigmoid and ipo) and ``trl.experimental.orpo.ORPOTrainer.compute_loss``
    (``get_batch_loss_metrics``), each on a batch from the trainer's own collator, then
    ``loss.backward()``."""
    pairs, packed, loaded = parity_setup
    config, params = loaded[0].config, loaded[0].params
    objective = "orpo" if kind == "orpo" else "dpo"
    beta = 0.3
    tc = TrainConfig(objective=objective, dpo_loss="sigmoid" if kind == "orpo" else kind,
                     dpo_beta=beta, orpo_lambda=beta, batch_size=packed.rows.num_rows,
                     seq_len=47)
    mesh_sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
        jax.sharding.PartitionSpec("data"))
    ref = (None if kind == "orpo" else  # ORPO has no reference
           P.reference_pass(config, tc, loaded[1].params, packed, mesh_sharding))
    batch = pref_data.pair_batch(packed, np.arange(packed.rows.num_rows), ref)
    loss_fn = make_objective(tc).loss_fn(config, packed.pairs_per_row)

    def mean_loss(p):
        total, (_, _, count, stats) = loss_fn(p, batch)
        return total / count, stat_means(stats, count)

    (loss, metrics), grads = jax.jit(jax.value_and_grad(mean_loss, has_aux=True))(params)

    policy, reference = (transformers.LlamaForCausalLM.from_pretrained(
        d, torch_dtype=torch.float32, attn_implementation="eager") for d in hf_dirs)
    trainer = _trl_trainer(kind, policy.train(), reference,
                           transformers.AutoTokenizer.from_pretrained(hf_dirs[0]), beta,
                           tmp_path / "trl")
    policy.zero_grad()
    t_loss, t_rewards = _trl_loss(trainer, kind, pairs)
    t_loss.backward()
    assert float(loss) == pytest.approx(t_loss.item(), abs=1e-5)
    assert t_loss.item() > 0.05  # a loss far from trivially zero
    for ours_key, theirs_key in [("chosen", "chosen"), ("rejected", "rejected"),
                                 ("margin", "margins"), ("accuracy", "accuracies")]:
        np.testing.assert_allclose(metrics[f"rewards/{ours_key}"], t_rewards[theirs_key],
                                   atol=1e-5, err_msg=ours_key)
    assert abs(t_rewards["margins"]) > 1e-4
    # Our gradients written in HF's layout (names, transposes) by the exporter.
    hf.save(config, jax.device_get(grads), tmp_path / "grads")
    ours = safetensors.numpy.load_file(str(tmp_path / "grads" / "model.safetensors"))
    theirs = {n: p.grad.numpy() for n, p in policy.named_parameters()}
    assert set(ours) == set(theirs)
    # 1e-5 absolute, and relative for the largest entries: an embedding gradient of about 5
    # summed over the batch in float32 differed by 1.1e-5 (2.4e-6 relative, some 20 ulps)
    # between torch 2.13 and XLA:CPU here; beta off by 0.1% moves them by 1e-3 relative.
    for name, grad in theirs.items():
        np.testing.assert_allclose(ours[name], grad, atol=1e-5, rtol=1e-5, err_msg=name)
    assert max(np.abs(g).max() for g in theirs.values()) > 1e-3  # gradients are not ~zero


def test_lora_reference_is_the_frozen_base(parity_setup):
    """DPO with LoRA (adapters-off reference in the step) equals full-fine-tuning DPO of the
    merged weights against a stored first pass of a separate frozen copy of the base."""
    _, packed, loaded = parity_setup
    config, base = loaded[0].config, loaded[0].params
    tc = TrainConfig(objective="dpo", lora_rank=2, batch_size=packed.rows.num_rows)
    state = jax.jit(make_init_fn(config, tc))(jax.random.key(0), base)
    rng = np.random.default_rng(1)  # numpy noise: jax.random op by op compiles per shape
    adapters = jax.tree.map(  # numpy arrays (device ones would add op by op)
        lambda x: np.asarray(x) + 0.05 * rng.standard_normal(x.shape, np.float32),
        state.params[lora.ADAPTERS])
    params = {lora.BASE: state.params[lora.BASE], lora.ADAPTERS: adapters}
    rows = np.arange(packed.rows.num_rows)
    lora_loss = make_objective(tc).loss_fn(config, packed.pairs_per_row)
    ours, (_, _, _, stats) = jax.jit(lora_loss)(params, pref_data.pair_batch(packed, rows))

    frozen = jax.tree.map(lambda x: jnp.array(np.asarray(x)), base)  # a separate copy
    full = TrainConfig(objective="dpo", batch_size=packed.rows.num_rows)
    sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
        jax.sharding.PartitionSpec("data"))
    ref = P.reference_pass(config, full, frozen, packed, sharding)
    merged = jax.jit(ParamsLayout.of(tc).model_params)(params)  # one program, not op by op
    full_loss = make_objective(full).loss_fn(config, packed.pairs_per_row)
    theirs, (_, _, _, full_stats) = jax.jit(full_loss)(merged,
                                                      pref_data.pair_batch(packed, rows, ref))
    assert float(theirs) > 0.1 and abs(float(stats["rewards/margin"])) > 1e-4
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    for k in stats:
        np.testing.assert_allclose(stats[k], full_stats[k], atol=1e-6, err_msg=k)


# ------------------------------------------------------------------------------ runs


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "loss" in m and m.get("split") == "train"]


def test_dpo_cli_lora_on_a_two_device_mesh(hf_dirs, pairs_file, tmp_path):
    """``python train.py --config dpo train.init_from=DIR data.path=pairs.jsonl ...`` (the CLI's
    main in a fresh process, no loss plot)."""
    run_dir = tmp_path / "cli"
    cmd = [*TRAIN_CLI_NO_PLOT, "--config", "dpo", "--no-progress", "--no-memory-check",
           "--cpu-devices", "2", f"train.init_from={hf_dirs[0]}", f"data.path={pairs_file}",
           f"train.run_dir={run_dir}", "train.steps=6", "train.lora_rank=4",
           "train.mesh=-1,1,1", *SMALL, "train.lr=2e-2", "train.grad_accum=2",
           "data.val_fraction=0.1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reference log-probs: adapters-off" in done.stderr
    # train.batch_size counts packed rows (4), each of one pair or more: the pairs are logged.
    assert "train.batch_size=4 packed rows a step hold " in done.stderr
    records = _metrics(run_dir)
    assert all(m["pairs"] >= 4 and m["pairs"] == int(m["pairs"]) for m in records)
    assert len(records) == 6 and records[0]["loss"] == pytest.approx(np.log(2), abs=1e-4)
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracy",
            "rewards/margin"} <= set(records[0])
    assert np.mean([m["loss"] for m in records[-3:]]) < 0.5
    assert records[-1]["rewards/accuracy"] >= 0.75 and records[-1]["rewards/margin"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 6 and summary["val_loss"] is not None  # completions' CE


def test_dpo_resume_is_exact(hf_dirs, pairs_file, tmp_path, monkeypatch, caplog):
    """Full fine-tuning DPO of ``train.pairs_per_step=5`` (TRL's batch: 5 pairs a step, logged)
    killed after step 2's record but before its checkpoint (the checkpoint of step 2 removed)
    and resumed from step 1 (the stored first-pass reference restored, not recomputed) = the
    straight run of 2 steps it was killed in (weights and records, taken before the kill), in
    process (no loss plots drawn)."""
    from transformer_jax.train import plot

    monkeypatch.setattr(plot, "plot_run", lambda run_dir: None)
    caplog.set_level(logging.INFO, logger=P.__name__)

    def go(run_dir: Path, steps: int):
        model, train, data = build_configs("dpo", [
            f"train.init_from={hf_dirs[0]}", f"data.path={pairs_file}", *SMALL,
            f"train.run_dir={run_dir}", f"train.steps={steps}", "train.ckpt_every=1",
            "train.mesh=1,1,1", "train.pairs_per_step=5"])
        return run(model, train, data, progress=False, memory_check=False)

    run_dir = tmp_path / "a"
    go(run_dir, 2)  # the straight run: its step 2 and records, as they were before the kill
    with CheckpointManager(run_dir / "checkpoints", async_save=False) as manager:
        straight, _ = manager.restore_params(None, 2)
    straight_records = _metrics(run_dir)
    reference = run_dir / P.REFERENCE_FILE
    stored = reference.stat().st_mtime_ns
    shutil.rmtree(run_dir / "checkpoints" / "2")  # killed before step 2's checkpoint
    summary = go(run_dir, 2)
    assert (summary.start_step, summary.final_step) == (1, 2)
    assert reference.stat().st_mtime_ns == stored  # read back, not written again
    with CheckpointManager(run_dir / "checkpoints", async_save=False) as manager:
        resumed, _ = manager.restore_params(None, 2)
    jax.tree.map(np.testing.assert_array_equal, resumed, straight)
    losses = [m["loss"] for m in straight_records]
    assert [m["loss"] for m in _metrics(run_dir)] == losses  # step 2's record once, the same
    assert losses[0] == pytest.approx(np.log(2), abs=1e-5) and losses[1] != losses[0]
    # Step 1: the policy is the reference, so every pair ties at rewards 0 (TRL logs 0 there).
    first = straight_records[0]
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margin"] == 0
    assert first["rewards/accuracy"] == 0
    # 24 pairs, 5 a step: an epoch is 5 steps, the last on 4 pairs.
    assert ("train.pairs_per_step=5: each step trains on 5 pairs (the last of each epoch's 5 "
            "steps on 4), packed into train.batch_size=") in caplog.text
    assert {m["pairs"] for m in straight_records} <= {4, 5}
