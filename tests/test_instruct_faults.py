"""Instruction data as a new user writes it: prompts longer than the context, several files,
OpenAI-style content parts, content that is not text, and strings that are not Unicode."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from helpers import write_chatml_tokenizer
from test_instruct import CharTokenizer, write_jsonl

from transformer_jax.data import instruct
from transformer_jax.data.instruct import InstructionDataError, count, load_examples, pack
from transformer_jax.data.instruct_records import Example
from transformer_jax.data.preference import fit_pair
from transformer_jax.model.config import ModelConfig
from transformer_jax.train.config import DataConfig, TrainConfig
from transformer_jax.train.data import prepare_instruction_data


def loss_targets(data) -> int:
    """Targets that carry the loss over every packed row (what training sees)."""
    return int(instruct.rows_to_batch(data, np.arange(data.num_rows))["loss_mask"].sum())


# Records longer than seq_len ---------------------------------------------------------------------

def test_a_long_prompt_keeps_the_completion_and_the_bos(tmp_path, caplog):
    tok = CharTokenizer()
    records = [{"prompt": f"{i}: " + "long context " * 6, "completion": f" answer {i}"}
               for i in range(30)]
    path = write_jsonl(tmp_path / "long.jsonl", records)
    with caplog.at_level(logging.WARNING, logger="transformer_jax.data.instruct"):
        data = instruct.load_instruction_data(path, tok, seq_len=32)
    assert data.num_examples == 30 and data.num_truncated == 30 and data.num_dropped == 0
    # Every completion and its eos is trained on, whole.
    assert loss_targets(data) == sum(len(f" answer {i}") + 1 for i in range(30))
    starts = data.segment_ids != np.roll(data.segment_ids, 1, axis=1)
    assert (data.tokens[starts & (data.segment_ids > 0)] == tok.bos_id).all()
    assert "30 of 30 examples are longer than seq_len + 1 = 33 tokens" in caplog.text


def test_a_long_chat_keeps_the_templates_head_and_the_reply(tmp_path):
    tok = CharTokenizer()
    record = {"messages": [{"role": "user", "content": "why? " * 20},
                           {"role": "assistant", "content": "because"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [record])
    (example,) = load_examples(path, tok)
    head = tok.encode("<|im_start|>user\n")
    assert example.head == len(head)
    data = pack([example], seq_len=24)
    row = data.tokens[0][data.segment_ids[0] > 0].tolist()
    assert row[:len(head)] == head  # the template's head, then the end of the question
    assert tok.decode(np.asarray(row)[data.loss_tokens[0][:len(row)]]) == "because<|im_end|>\n"


def test_a_completion_too_long_for_the_row_keeps_its_start(tmp_path):
    tok = CharTokenizer()
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "q" * 10, "completion": "a" * 40}])
    data = instruct.load_instruction_data(path, tok, seq_len=15)
    assert data.num_truncated == 1
    # bos, the prompt's last token, then as much of the completion as fits.
    assert tok.decode(data.tokens[0][:3]) == "<s>qa"
    assert loss_targets(data) == 16 - 2


def test_cut_and_dropped_examples_are_counted_and_a_long_pair_shares_its_row(caplog):
    """``pack`` counts what ``fit`` cut and dropped (a head that fills the row leaves no
    target); ``fit_pair`` gives the shorter side its length when it fits in half the row and
    the other side the rest, else each side half (the first the odd token)."""
    def example(n: int, head: int = 0) -> Example:  # n tokens, the last two scored
        return Example(np.arange(n, dtype=np.int32), np.arange(n) >= n - 2, line=1, head=head)

    with caplog.at_level(logging.WARNING, logger="transformer_jax.data.instruct"):
        data = pack([example(4), example(12), example(12, head=10)], seq_len=7)
    assert (data.num_examples, data.num_truncated, data.num_dropped) == (2, 1, 1)
    assert "start was cut from 1 " in caplog.text and "and 1 were dropped" in caplog.text
    for a, b, capacity, sides in ((5, 30, 20, (5, 15)), (30, 5, 20, (15, 5)),
                                  (12, 14, 20, (10, 10)), (12, 14, 21, (11, 10)),
                                  (8, 9, 20, (8, 9))):
        pair, cut = fit_pair(example(a), example(b), capacity)
        assert tuple(len(e.tokens) for e in pair) == sides and cut == (a + b > capacity)


def _tokenizer_dir(directory: Path) -> Path:
    """A word-level tokenizer.json with a ChatML template (the ``tokenizers`` library)."""
    return write_chatml_tokenizer(
        directory, ["system", "user", "assistant", "why", "because", "?", "yes", "no"])


def test_a_run_whose_data_carry_no_loss_token_is_an_error_before_any_step(tmp_path):
    """A row of 3 tokens holds only the template's head of each conversation: before, the run
    trained 0% of the tokens (loss 0.0000) and exited 0."""
    from transformer_jax.train import run as training

    records = [{"messages": [{"role": "user", "content": "why ? why ?"},
                             {"role": "assistant", "content": "because yes"}]}] * 8
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    model = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, d_ff=32,
                        max_seq_len=8)
    tc = TrainConfig(steps=2, batch_size=2, seq_len=2, warmup_steps=0, eval_every=0,
                     sample_tokens=0, run_dir=str(tmp_path / "run"))
    data = DataConfig(path=str(path), tokenizer=str(_tokenizer_dir(tmp_path / "tok")),
                      val_fraction=0.0)
    with pytest.raises(ValueError, match=r"none of the 8 examples has a completion/assistant "
                                         r"token within seq_len \+ 1 = 3 tokens") as info:
        training.run(model, tc, data, progress=False)
    assert str(info.value).startswith(f"{path}: ")
    assert not (tmp_path / "run" / "checkpoints").exists()


# Several files -----------------------------------------------------------------------------------

def _files(tmp_path: Path) -> tuple[Path, Path]:
    a = write_jsonl(tmp_path / "sft" / "a.jsonl", [{"prompt": "a", "completion": "1"}] * 3)
    b = write_jsonl(tmp_path / "sft" / "b.jsonl", [{"prompt": "b", "completion": "22"}] * 2)
    return a, b


@pytest.mark.parametrize("kind", ["list", "directory", "glob"])
def test_several_jsonl_files_are_instruction_data(tmp_path, kind):
    (tmp_path / "sft").mkdir()
    a, b = _files(tmp_path)
    path = {"list": f"{a},{b}", "directory": str(a.parent),
            "glob": str(a.parent / "*.jsonl")}[kind]
    config = DataConfig(path=path, val_fraction=0.0)
    assert config.is_instruct and config.instruction_files() == [a, b]
    data = prepare_instruction_data(config, CharTokenizer(), seq_len=16)
    assert data.train_rows.num_examples == 5
    assert loss_targets(data.train_rows) == 3 * 2 + 2 * 3  # completions + eos of both files


def test_a_glob_matching_one_jsonl_file_is_instruction_data(tmp_path):
    (tmp_path / "sft").mkdir()
    a, _ = _files(tmp_path)
    config = DataConfig(path=str(tmp_path / "sft" / "a*.jsonl"), val_fraction=0.0)
    assert config.instruction_files() == [a]
    assert prepare_instruction_data(config, CharTokenizer(), 16).train_rows.num_examples == 3


def test_jsonl_mixed_with_text_is_an_error_naming_both(tmp_path):
    (tmp_path / "sft").mkdir()
    a, _ = _files(tmp_path)
    text = tmp_path / "sft" / "notes.txt"
    text.write_text("plain text\n")
    for path in (f"{a},{text}", str(tmp_path / "sft")):
        with pytest.raises(ValueError, match="mixes instruction data") as info:
            DataConfig(path=path).is_instruct  # noqa: B018
        assert str(a) in str(info.value) and str(text) in str(info.value)
    assert not DataConfig(path=str(text)).is_instruct


# Chat content ------------------------------------------------------------------------------------

def test_text_parts_are_concatenated_like_a_string(tmp_path):
    tok = CharTokenizer()
    parts = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi "},
                                     {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}]}
    plain = {"messages": [{"role": "user", "content": "hi there"},
                          {"role": "assistant", "content": "hello"}]}
    path = write_jsonl(tmp_path / "p.jsonl", [parts, plain])
    first, second = load_examples(path, tok)
    np.testing.assert_array_equal(first.tokens, second.tokens)
    np.testing.assert_array_equal(first.loss, second.loss)
    assert "[{" not in tok.decode(first.tokens) and "'type'" not in tok.decode(first.tokens)


@pytest.mark.parametrize(("content", "match"), [
    (7, r"\"content\" must be a string or a list of text parts, got 7"),
    ({"text": "hi"}, r"must be a string or a list of text parts"),
    (None, r"must be a string or a list of text parts, got null"),
    ([{"type": "image_url", "image_url": "x.png"}], r"content part 0 must be \{\"type\": \"text\""),
    ([{"type": "text", "text": 3}], r"content part 0"),
    (["hi"], r"content part 0"),
])
def test_content_that_is_not_text_names_the_line(tmp_path, content, match):
    record = {"messages": [{"role": "user", "content": content},
                           {"role": "assistant", "content": "ok"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, record])
    with pytest.raises(InstructionDataError, match=r"d\.jsonl:2: message 0 .*" + match):
        load_examples(path, CharTokenizer())


# Strings that are not Unicode --------------------------------------------------------------------

@pytest.mark.parametrize("record", [
    '{"prompt": "a\\ud800b", "completion": "x"}',
    '{"messages": [{"role": "user", "content": "\\udfff"}, {"role": "assistant", '
    '"content": "ok"}]}',
])
def test_a_lone_surrogate_names_the_line(tmp_path, record):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "completion": "b"}, record])
    with pytest.raises(InstructionDataError, match=r"s\.jsonl:2: .*lone surrogate"):
        load_examples(path, CharTokenizer())


def test_a_real_tokenizer_gets_no_surrogate(tmp_path):
    from transformer_jax.tokenizer import load_tokenizer

    tok = load_tokenizer(_tokenizer_dir(tmp_path / "tok"))
    path = write_jsonl(tmp_path / "s.jsonl", ['{"prompt": "why \\ud800", "completion": "yes"}'])
    with pytest.raises(InstructionDataError, match=r"s\.jsonl:1: .*\\ud800"):
        load_examples(path, tok)


# Counts in words ---------------------------------------------------------------------------------

def test_counts_agree_with_their_nouns(tmp_path, caplog):
    assert (count(1, "record"), count(2, "record")) == ("1 record", "2 records")
    path = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "a", "completion": "b"}])
    with caplog.at_level(logging.INFO, logger="transformer_jax"):
        prepare_instruction_data(DataConfig(path=str(path), val_fraction=0.0), CharTokenizer(),
                                 16)
    assert "1 example (0 cut to fit, 0 dropped) in 1 packed row of" in caplog.text
    assert "packed 1 example into 1 row of" in caplog.text
    assert "1 examples" not in caplog.text and "1 rows" not in caplog.text
