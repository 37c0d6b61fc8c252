"""Tests for transformer_jax.instruct: loss masks, packing, deterministic batches, errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from helpers import CHATML

from transformer_jax.data import instruct
from transformer_jax.data.instruct import (
    Example,
    InstructionDataError,
    PackedBatches,
    load_instruction_data,
    pack,
)
from transformer_jax.tokenizer import ChatTemplate, TextTokenizer, load_tokenizer

STRICT = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "{{ message['role'] + ': ' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


class CharTokenizer:
    """One id per character (its code point, < 256) plus ChatML specials; easy to check by hand."""

    SPECIALS = {"<|im_start|>": 256, "<|im_end|>": 257, "<s>": 258}

    def __init__(self, chat_template: str | None = CHATML, add_bos_token: bool = True):
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.add_eos_token = False
        self.special_tokens = {"bos_token": "<s>", "eos_token": "<|im_end|>"}
        self.bos_id, self.eos_id, self.pad_id = 258, 257, 0
        self.vocab_size = 259
        self.fingerprint = "chars"

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        i = 0
        while i < len(text):
            for token, token_id in self.SPECIALS.items():
                if text.startswith(token, i):
                    ids.append(token_id)
                    i += len(token)
                    break
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids) -> str:
        names = {v: k for k, v in self.SPECIALS.items()}
        return "".join(names.get(int(i), chr(int(i))) for i in ids)

    def id_to_piece(self, token_id: int) -> str:
        return self.decode([token_id])

    def token_to_id(self, token: str) -> int | None:
        return self.SPECIALS.get(token, ord(token) if len(token) == 1 else None)

    def save(self, directory):
        raise NotImplementedError


def write_jsonl(path: Path, records: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def masked_text(tok, example: Example) -> str:
    return tok.decode(example.tokens[example.loss])


def test_char_tokenizer_is_a_text_tokenizer():
    assert isinstance(CharTokenizer(), TextTokenizer)


def test_prompt_completion_mask_is_exactly_the_completion(tmp_path):
    tok = CharTokenizer()
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Q: 2+2?", "completion": " 4"}])
    [example] = instruct.load_examples(path, tok)
    assert example.tokens.tolist() == [258, *map(ord, "Q: 2+2? 4"), 257]
    assert example.loss.tolist() == [False] * 8 + [True] * 3  # " 4" and eos
    assert masked_text(tok, example) == " 4<|im_end|>"
    no_bos = CharTokenizer(add_bos_token=False)
    [example] = instruct.load_examples(path, no_bos, add_eos=False)
    assert example.tokens.tolist() == list(map(ord, "Q: 2+2? 4"))
    assert masked_text(tok, example) == " 4"


def test_chat_mask_covers_assistant_turns_and_their_end(tmp_path):
    tok = CharTokenizer()
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ok"},
    ]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}])
    [example] = instruct.load_examples(path, tok)
    full = ChatTemplate.of(tok).render(messages)
    assert tok.decode(example.tokens) == full
    assert example.tokens.tolist() == tok.encode(full)
    # Each assistant turn: its content, the turn's end token and newline.
    assert masked_text(tok, example) == "yo<|im_end|>\nok<|im_end|>\n"
    assistant = [i for i, flag in enumerate(example.loss) if flag]
    first = tok.encode(ChatTemplate.of(tok).render(messages[:2], add_generation_prompt=True))
    assert assistant[0] == len(first)


def test_chat_without_assistant_is_skipped_and_trailing_user_unmasked(tmp_path, caplog):
    tok = CharTokenizer()
    records = [
        {"messages": [{"role": "user", "content": "only a question"}]},
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
            ]
        },
    ]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    with caplog.at_level(logging.WARNING):
        examples = instruct.load_examples(path, tok)
    assert "1 record has no completion" in caplog.text
    assert len(examples) == 1 and examples[0].line == 2
    assert masked_text(tok, examples[0]) == "b<|im_end|>\n"


def make_examples(lengths: list[int]) -> list[Example]:
    out = []
    for n, length in enumerate(lengths):
        tokens = np.arange(1, length + 1, dtype=np.int32) + 100 * n
        loss = np.arange(length) >= length // 2
        out.append(Example(tokens, loss, n + 1))
    return out


def test_packing_segments_positions_and_token_count():
    lengths = [9, 3, 7, 2, 5, 4, 1, 8]
    examples = make_examples(lengths)
    data = pack(examples, seq_len=9, pad_id=-7)  # rows of 10 tokens
    assert data.tokens.shape[1] == 10 and data.seq_len == 9
    assert (data.segment_ids > 0).sum() == sum(lengths)  # every token kept
    assert data.num_rows == -(-sum(lengths) // 10)  # best fit needs no extra row here
    assert (data.tokens[data.segment_ids == 0] == -7).all()
    seen = []
    for r in range(data.num_rows):
        segments = data.segment_ids[r]
        ids = [s for s in dict.fromkeys(segments.tolist()) if s]
        assert ids == list(range(1, len(ids) + 1))  # 1, 2, ... in order, padding at the end
        for s in ids:
            where = np.flatnonzero(segments == s)
            assert (np.diff(where) == 1).all()
            np.testing.assert_array_equal(data.positions[r, where], np.arange(len(where)))
            seen.append(data.tokens[r, where].tolist())
        assert (data.positions[r, segments == 0] == 0).all()
    assert sorted(seen) == sorted(e.tokens.tolist() for e in examples)


def test_batch_keys_shift_and_loss_mask_respects_segments():
    examples = make_examples([4, 4, 2])  # fits one row of 10
    data = pack(examples, seq_len=9)
    batch = instruct.rows_to_batch(data, np.array([0]))
    assert set(batch) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
    assert all(v.shape == (1, 9) for v in batch.values())
    row = data.tokens[0]
    np.testing.assert_array_equal(batch["inputs"][0], row[:-1])
    np.testing.assert_array_equal(batch["targets"][0], row[1:])
    assert batch["loss_mask"].dtype == np.float32
    # Example tokens t1..t4 with loss on t3, t4: targets t3, t4 in each 4-token example, and
    # t2 of the 2-token example (loss from length // 2 = 1); never across a boundary or padding.
    seg = batch["segment_ids"][0]
    mask = batch["loss_mask"][0]
    for t in range(9):
        same = seg[t] > 0 and data.segment_ids[0, t + 1] == seg[t]
        assert mask[t] == float(same and data.loss_tokens[0, t + 1])
    assert mask.sum() == 2 + 2 + 1


def test_too_long_example_is_truncated_with_a_warning(caplog):
    examples = make_examples([30, 3])  # loss on tokens 15..29 of the first
    with caplog.at_level(logging.WARNING, logger="transformer_jax.data.instruct"):
        data = pack(examples, seq_len=7)
    assert "1 of 2 examples is longer than seq_len + 1 = 8 tokens" in caplog.text
    assert data.num_truncated == 1
    # The prompt's start goes first (its last token stays, the input of the first target).
    np.testing.assert_array_equal(data.tokens[0], examples[0].tokens[14:22])
    assert (data.segment_ids > 0).sum() == 8 + 3


def test_batches_are_pure_in_seed_and_step_and_cover_each_epoch():
    data = pack(make_examples([3] * 20), seq_len=5)  # 2 examples per row -> 10 rows
    assert data.num_rows == 10
    a = PackedBatches(data, batch_size=4, seed=3)
    b = PackedBatches(data, batch_size=4, seed=3)
    for step in (0, 7, 2, 7):
        for key, value in a.get(step).items():
            np.testing.assert_array_equal(value, b.get(step)[key])
    assert not np.array_equal(a.get(0)["inputs"], PackedBatches(data, 4, seed=4).get(0)["inputs"])
    # 5 steps x 4 rows = 2 epochs: each row exactly twice.
    rows = np.concatenate([instruct.row_indices(3, s, 4, 10) for s in range(5)])
    assert np.bincount(rows, minlength=10).tolist() == [2] * 10
    # Processes split the global batch.
    parts = [
        PackedBatches(data, 4, seed=3, process_index=p, process_count=2).get(1) for p in (0, 1)
    ]
    np.testing.assert_array_equal(np.concatenate([p["inputs"] for p in parts]), a.get(1)["inputs"])
    iterated = a.iterate(2)
    np.testing.assert_array_equal(next(iterated)["targets"], a.get(2)["targets"])
    with pytest.raises(ValueError, match="divisible"):
        PackedBatches(data, 3, process_count=2)


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ("{not json", r"d\.jsonl:2: not valid JSON"),
        ('["a list"]', r"d\.jsonl:2: a record must be a JSON object"),
        ({"prompt": "only"}, r"d\.jsonl:2: a record needs \"prompt\" and \"completion\""),
        ({"prompt": 1, "completion": "x"}, r"d\.jsonl:2: \"prompt\" and \"completion\" must be"),
        ({"messages": []}, r"d\.jsonl:2: \"messages\" must be a non-empty list"),
        ({"messages": [{"content": "x"}]}, r"d\.jsonl:2: message 0 needs a string \"role\""),
        ({"messages": [{"role": "user"}]}, r"d\.jsonl:2: message 0 has no \"content\""),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, record, match):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, record])
    with pytest.raises(InstructionDataError, match=match):
        load_instruction_data(path, CharTokenizer(), seq_len=16)


def test_failing_template_names_the_record(tmp_path):
    ok = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    bad = {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "b"}]}
    path = write_jsonl(tmp_path / "t.jsonl", [ok, "", ok, bad])
    with pytest.raises(InstructionDataError, match=r"t\.jsonl:4: chat template failed: no tools"):
        load_instruction_data(path, CharTokenizer(chat_template=STRICT), seq_len=32)
    with pytest.raises(InstructionDataError, match=r"t\.jsonl:1: chat record: .*no chat template"):
        load_instruction_data(path, CharTokenizer(chat_template=None), seq_len=32)
    with pytest.raises(FileNotFoundError):
        load_instruction_data(tmp_path / "gone.jsonl", CharTokenizer(), seq_len=32)
    rewriting = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(InstructionDataError, match=r"t\.jsonl:1: .*prefix"):
        load_instruction_data(path, CharTokenizer(chat_template=rewriting), seq_len=32)


def test_end_to_end_with_a_tokenizer_json_checkpoint(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["hello world, naïve café 🙂 def f(x): return x"] * 20, trainer)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(directory)

    records = [
        {"prompt": "hello ", "completion": "world"},
        {
            "messages": [
                {"role": "user", "content": "café?"},
                {"role": "assistant", "content": "🙂"},
            ]
        },
    ] * 3
    path = write_jsonl(tmp_path / "mix.jsonl", records)
    data = load_instruction_data(path, tokenizer, seq_len=64)
    examples = instruct.load_examples(path, tokenizer)
    assert (data.segment_ids > 0).sum() == sum(len(e.tokens) for e in examples)
    assert tokenizer.decode(examples[0].tokens[examples[0].loss]) == "world<|im_end|>"
    assert tokenizer.decode(examples[1].tokens[examples[1].loss]) == "🙂<|im_end|>\n"
    batch = PackedBatches(data, batch_size=2, seed=0).get(0)
    assert batch["inputs"].shape == (2, 64)
    everything = instruct.rows_to_batch(data, np.arange(data.num_rows))
    assert everything["loss_mask"].sum() == sum(e.loss[1:].sum() for e in examples)
    decoded_targets = tokenizer.decode(batch["targets"][batch["loss_mask"] > 0])
    assert "world" in decoded_targets or "🙂" in decoded_targets
