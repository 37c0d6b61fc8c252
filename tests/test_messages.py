"""Bad input that used to pass silently or with a misleading message (issue 52, item 11): each
is refused (or warned of) in one line that names the right thing.

NaN/inf weights refused at load (a HF directory, a run, and ``generate`` on them); a non-finite
gradient named as such; GRPO's group size and completion budget; DPO pairs whose sides are equal
(``FILE:LINE``); ``[model.moe]`` tables with an out-of-range layer or an unknown key;
speculative specs with a repeated or out-of-range option; ``export`` given both
``--tokenizer`` and ``--no-tokenizer``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, TINY, write_chatml_tokenizer

from transformer_jax.checkpoint import loading
from transformer_jax.checkpoint.manager import CheckpointManager
from transformer_jax.cli import export as hf_export
from transformer_jax.data import preference as pref_data
from transformer_jax.data.instruct_records import InstructionDataError
from transformer_jax.decode import speculative
from transformer_jax.decode.speculative import parse_spec
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import init_params
from transformer_jax.tokenizer import load_tokenizer
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.log import NonFiniteLossError, RunLog

hf = pytest.importorskip("transformer_jax.hf")
generate_cli = importlib.import_module("transformer_jax.cli.generate")


@pytest.fixture(scope="module")
def params():
    init = jax.jit(init_params, static_argnums=0, compiler_options=FAST_COMPILE)
    return init(TINY, jax.random.key(0))


def _poisoned(params, value: float):
    """``params`` with one entry of the second block's ``mlp/down`` weight set to ``value``."""
    out = jax.tree.map(np.array, params)
    out["blocks_1"]["mlp"]["down"].reshape(-1)[3] = value
    return out


# ------------------------------------------------------------------------------ NaN weights


def test_nan_weights_of_a_hf_checkpoint_are_refused(params, tmp_path, capsys):
    path = tmp_path / "hf"
    hf.save(TINY, _poisoned(params, math.nan), path)
    with pytest.raises(ValueError, match=r"NaN or inf \(blocks_1/mlp/down\)"):
        loading.load(path, with_tokenizer=False)
    # generate refuses in one line, instead of decoding NaN logits into arbitrary ids.
    argv = ["--checkpoint", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
            "--json"]
    assert generate_cli.main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.strip().splitlines()
    assert "NaN or inf" in line and "blocks_1/mlp/down" in line
    # The intact checkpoint loads.
    hf.save(TINY, params, tmp_path / "ok")
    loading.load(tmp_path / "ok", with_tokenizer=False)


def test_inf_weights_of_a_run_are_refused(params, tmp_path):
    run_dir = tmp_path / "run"
    with CheckpointManager(run_dir / "checkpoints", async_save=False) as manager:
        manager.save(1, {"params": _poisoned(params, -math.inf), "step": jnp.int32(1)},
                     meta={"model": dataclasses.asdict(TINY), "step": 1})
    with pytest.raises(ValueError, match=r"NaN or inf \(blocks_1/mlp/down\)"):
        loading.load(run_dir, with_tokenizer=False)


# ------------------------------------------------------------------------------ training


def test_a_non_finite_gradient_is_named_not_the_finite_loss(tmp_path):
    log = RunLog(tmp_path, 0, TrainConfig(), flops=1.0, peak=0.0, log_train=False)
    try:
        log.push(1, {"loss": 1.5, "grad_norm": 2.0, "lr": 1e-3})
        log.push(2, {"loss": 7.607, "grad_norm": math.inf, "lr": 1e-3})
        with pytest.raises(NonFiniteLossError) as error:
            log.flush()
        message = str(error.value)
        assert "grad norm inf" in message and "at step 2" in message
        assert "non-finite loss" not in message
        log.push(3, {"loss": math.nan, "grad_norm": math.nan, "lr": 1e-3})
        with pytest.raises(NonFiniteLossError, match="non-finite loss nan at step 3"):
            log.flush()
    finally:
        log.close()


GRPO = dict(objective="grpo", reward="m:f", batch_size=8, grpo_group_size=4, seq_len=48)


@pytest.mark.parametrize("size", [0, 1])
def test_grpo_group_size_names_the_least_it_takes(size):
    with pytest.raises(ValueError, match=rf"grpo_group_size must be >= 2 .*got {size}$"):
        TrainConfig(**{**GRPO, "grpo_group_size": size})


def test_grpo_max_tokens_must_leave_room_for_a_prompt():
    for tokens in (48, 1000):
        with pytest.raises(ValueError, match=rf"grpo_max_tokens \({tokens}\) must be below "
                                             r"seq_len \(48\).*no room for a prompt"):
            TrainConfig(**GRPO, grpo_max_tokens=tokens)
    assert TrainConfig(**GRPO, grpo_max_tokens=47).grpo_max_tokens == 47
    # Not a GRPO run: the GRPO keys do not constrain it.
    TrainConfig(seq_len=16, grpo_max_tokens=64, grpo_group_size=1)


def test_dpo_pairs_whose_sides_are_equal_are_named(tmp_path, caplog):
    tokenizer = load_tokenizer(write_chatml_tokenizer(
        tmp_path / "tok", "the cat dog sat red blue yes no".split(), add_eos_token=False))
    records = [{"prompt": "the cat", "chosen": " sat red", "rejected": " sat blue"},
               {"prompt": "the dog", "chosen": " yes", "rejected": " yes"},
               {"prompt": [{"role": "user", "content": "the cat"}], "chosen": "no",
                "rejected": {"role": "assistant", "content": "no"}}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with caplog.at_level(logging.WARNING, logger=pref_data.__name__):
        pairs = pref_data.load_pairs(path, tokenizer)
    assert len(pairs) == 3
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"{path}:2" in warning and f"{path}:3" in warning and f"{path}:1" not in warning
    assert "2 pairs of 3" in warning
    # Every pair a tie: nothing to learn, refused with the first one's FILE:LINE.
    path.write_text(json.dumps(records[1]) + "\n")
    with pytest.raises(InstructionDataError, match=rf"{path}:1: every pair has the same"):
        pref_data.load_pairs(path, tokenizer)


# ------------------------------------------------------------------------------ model tables

MOE = {"n_experts": 4, "top_k": 2, "d_ff": 32}


def test_moe_dense_layers_past_the_last_layer_are_refused():
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=48, max_seq_len=32)
    with pytest.raises(ValueError, match=r"moe.dense_layers lists \[7\].*n_layers=2"):
        ModelConfig.from_dict({**base, "moe": {**MOE, "dense_layers": [7]}})
    with pytest.raises(ValueError, match=r"moe.dense_layers lists \[2\]"):
        ModelConfig.from_dict({**base, "moe": {**MOE, "dense_layers": [0, 2]}})
    assert ModelConfig.from_dict({**base, "moe": {**MOE, "dense_layers": [1]}}
                                 ).sparse_layers == (0,)


@pytest.mark.parametrize("table,value,match", [
    ("moe", {**MOE, "n_expert": 8}, r"^unknown model.moe option 'n_expert'; did you mean "
                                     r"'n_experts'"),
    ("moe", {"n_experts": 4, "top_k": 2}, r"^model.moe needs d_ff \(missing\)$"),
    ("rope_scaling", {"kind": "linear", "factor": 2.0, "scale": 1.0},
     r"^unknown model.rope_scaling option 'scale'"),
])
def test_a_bad_model_sub_table_is_one_line_naming_the_key(table, value, match):
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=48, max_seq_len=32)
    with pytest.raises(ValueError, match=match) as error:
        ModelConfig.from_dict({**base, table: value})
    assert type(error.value) is ValueError and "\n" not in str(error.value)


# ------------------------------------------------------------------------------ CLI options


@pytest.mark.parametrize("spec,match", [
    ("ngram:k=2:k=3", "k is given twice"),
    ("ngram:n=2:k=3:n=3", "n is given twice"),
    ("draft:/x:k=2:k=2", "k is given twice"),
    ("ngram:n=17", r"n must be at most 16, got 17"),
    ("ngram:k=2:n=99", r"n must be at most 16, got 99"),
])
def test_speculative_specs_with_a_repeated_or_out_of_range_option_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_spec(spec)


def test_speculative_specs_in_range_parse():
    assert speculative.MAX_N == 16  # the cases above
    spec = parse_spec("ngram:k=3:n=16")
    assert (spec.k, spec.n) == (3, 16)


def test_export_refuses_tokenizer_with_no_tokenizer(params, tmp_path, capsys):
    source = tmp_path / "hf"
    hf.save(TINY, params, source)
    with pytest.raises(SystemExit) as exit_:
        hf_export.main(["--checkpoint", str(source), "--out", str(tmp_path / "out"),
                        "--no-tokenizer", "--tokenizer", str(tmp_path / "tok")])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--tokenizer .* and --no-tokenizer contradict"):
        hf_export.export(source, tmp_path / "out", tokenizer=tmp_path / "tok",
                         use_tokenizer=False)
    assert not (tmp_path / "out").exists()
