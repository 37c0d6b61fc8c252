"""Tests for transformer_jax.tokenizer: exact round trips, id layout, load errors, caching."""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax.tokenizer import Tokenizer

WORDS = ["alpha", "beta", "gamma", "héllo", "wörld", "naïve", "café", "value", "index", "return"]


def make_docs(num_docs: int = 30, seed: int = 0) -> list[str]:
    """Code-like documents with indentation, tabs, blank lines, CRLF and non-ASCII words."""
    rng = random.Random(seed)
    docs = []
    for d in range(num_docs):
        lines = []
        for _ in range(rng.randint(5, 20)):
            indent = rng.choice(["", "    ", "        ", "\t", "\t\t"])
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
            lines.append(indent + words + rng.choice(["", ":", "  ", " # note", " = 42"]))
        newline = "\r\n" if d % 5 == 0 else "\n"
        docs.append(newline.join(lines) + newline + ("\n" if d % 3 == 0 else ""))
    return docs


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return make_docs()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, docs) -> dict[str, Tokenizer]:
    out = tmp_path_factory.mktemp("tok")
    return {
        "bpe": Tokenizer.train(docs, out / "bpe.model", 400, "bpe"),
        "unigram": Tokenizer.train(docs, out / "unigram.model", 400, "unigram"),
        "char": Tokenizer.train(docs, out / "char.model", 100, "char"),
    }


ROUND_TRIP_TEXTS = [
    "",
    "héllo wörld — 你好 🙂",
    "def f(x):\n\tif x:\n\t\treturn 1\n    return 2\n",
    "    indented\n\n\n        deeper  \n",
    "  leading and trailing spaces  ",
    "windows\r\nline\rendings\r\n",
    "marker \u2581 char and NUL \x00 and BOM \ufeff",
    "<s> </s> <pad> <unk> literal special names",
    "\U0010ffff\u00a0\u3000 rare whitespace",
]


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_byte_fallback_models_round_trip(trained, model_type, text):
    tok = trained[model_type]
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_unseen_characters_use_byte_pieces_not_unk(trained, docs, model_type):
    tok = trained[model_type]
    text = "Ωμέγα 中文 🙂"
    assert not set(text) - {" "} & set("".join(docs))
    ids = tok.encode(text)
    assert tok.unk_id not in ids
    assert any(tok.processor.is_byte(i) for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_newlines_and_indentation_are_learned_pieces(trained, model_type):
    # Newlines must reach the trainer (it strips them from sentence ends), so they get real
    # pieces instead of costing a byte-fallback token each.
    tok = trained[model_type]
    for text in ["\n", "\r\n", "\t", "    "]:
        ids = tok.encode(text)
        assert not any(tok.processor.is_byte(i) for i in ids), repr(text)
        assert tok.unk_id not in ids


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=80))
def test_bpe_round_trips_any_text(trained, text):
    tok = trained["bpe"]
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=80))
def test_unigram_round_trips_any_text(trained, text):
    tok = trained["unigram"]
    assert tok.decode(tok.encode(text)) == text


def test_char_model_round_trips_its_corpus(trained, docs):
    tok = trained["char"]
    for doc in docs:
        assert tok.decode(tok.encode(doc)) == doc
    corpus_chars = set("".join(docs))
    # One piece per character, none of them unknown.
    for ch in corpus_chars:
        ids = tok.encode(ch)
        assert len(ids) == 1 and ids[0] != tok.unk_id, repr(ch)
    assert tok.encode("Ω") == [tok.unk_id]


def test_char_model_keeps_newlines_that_only_end_documents(tmp_path):
    # The trainer strips trailing newlines from each sentence; these characters only occur there.
    corpus = ["abc\n", "de\r\n", "f\tg  \n\n"]
    tok = Tokenizer.train(corpus, tmp_path / "c.model", 50, "char")
    for doc in corpus:
        assert tok.decode(tok.encode(doc)) == doc
    assert tok.unk_id not in tok.encode("".join(corpus))


def test_char_model_rejects_byte_fallback(tmp_path, docs):
    with pytest.raises(ValueError, match="byte_fallback"):
        Tokenizer.train(docs, tmp_path / "c.model", 100, "char", byte_fallback=True)


@pytest.mark.parametrize("model_type", ["bpe", "unigram", "char"])
def test_special_ids_distinct_in_vocab_and_used_consistently(trained, model_type):
    tok = trained[model_type]
    specials = [tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id]
    assert len(set(specials)) == 4
    assert all(0 <= i < tok.vocab_size for i in specials)
    pieces = [tok.id_to_piece(i) for i in (tok.bos_id, tok.eos_id, tok.pad_id)]
    assert pieces == ["<s>", "</s>", "<pad>"]
    text = "value index"
    plain = tok.encode(text)
    assert tok.encode(text, add_bos=True) == [tok.bos_id, *plain]
    assert tok.encode(text, add_eos=True) == [*plain, tok.eos_id]
    both = tok.encode(text, add_bos=True, add_eos=True)
    assert both == [tok.bos_id, *plain, tok.eos_id]
    assert tok.decode(both) == text
    # Control ids never come out of plain text, even text spelling their piece names.
    assert not {tok.bos_id, tok.eos_id, tok.pad_id} & set(tok.encode("<s></s><pad>"))


def test_load_matches_trained_and_accepts_directory(trained, tmp_path):
    tok = trained["bpe"]
    loaded = Tokenizer.load(tok.path)
    assert loaded.fingerprint == tok.fingerprint
    text = ROUND_TRIP_TEXTS[2]
    assert loaded.encode(text) == tok.encode(text)
    (tmp_path / "tokenizer.model").write_bytes(Path(tok.path).read_bytes())
    assert Tokenizer.load(tmp_path).fingerprint == tok.fingerprint


def test_load_missing_file_names_path(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(FileNotFoundError, match="nope.model"):
        Tokenizer.load(missing)


@pytest.mark.parametrize("content", [b"", b"this is not a protobuf \x00\xff" * 8])
def test_load_corrupt_file_names_path(tmp_path, content):
    bad = tmp_path / "bad.model"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match="bad.model"):
        Tokenizer.load(bad)


def test_pad_falls_back_to_eos_for_llama_style_models(docs):
    # A Llama-2-like model: no pad piece, dummy prefix, byte fallback.
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs),
        model_writer=model,
        vocab_size=300,
        model_type="bpe",
        byte_fallback=True,
        pad_id=-1,
        minloglevel=2,
    )
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tok = Tokenizer(processor)
    assert processor.pad_id() == -1
    assert tok.pad_id == tok.eos_id == processor.eos_id()
    # Loaded models keep SentencePiece's own encoding (no marker rewriting with a dummy prefix).
    text = "value\u2581index  café"
    assert tok.encode(text) == processor.encode(text)


def test_decode_validates_ids(trained):
    tok = trained["bpe"]
    ids = tok.encode("value index")
    assert tok.decode(np.asarray(ids, dtype=np.int32)) == "value index"
    assert tok.decode([]) == ""
    with pytest.raises(ValueError, match=str(tok.vocab_size)):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="-1"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="1-D"):
        tok.decode(np.zeros((2, 2), np.int32))


def test_output_path_forms(tmp_path, docs):
    prefix = tmp_path / "pre" / "mytok"
    assert Tokenizer.train(docs, prefix, 300, "bpe").path == tmp_path / "pre" / "mytok.model"
    directory = tmp_path / "d"
    directory.mkdir()
    assert Tokenizer.train(docs, directory, 300, "bpe").path == directory / "tokenizer.model"
    leftovers = [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []


def test_train_from_files_equals_train_from_texts(tmp_path, docs):
    files = []
    for i, doc in enumerate(docs):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_bytes(doc.encode("utf-8"))
    from_files = Tokenizer.train(files, tmp_path / "f.model", 350, "bpe")
    from_texts = Tokenizer.train(docs, tmp_path / "t.model", 350, "bpe")
    assert from_files.fingerprint == from_texts.fingerprint


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model_type": "word2"}, ValueError, "word2"),
        ({"vocab_size": 100}, ValueError, "vocab_size=100"),
        ({"unk_id": 5}, ValueError, "unk_id"),
        ({"source": ["", ""]}, ValueError, "empty corpus"),
        ({"source": []}, ValueError, "empty corpus"),
        ({"source": "just one string"}, TypeError, "single str"),
        ({"source": [Path("/definitely/missing.txt")]}, FileNotFoundError, "missing.txt"),
    ],
)
def test_train_rejects_bad_input(tmp_path, docs, kwargs, error, match):
    args = {"source": docs, "output": tmp_path / "x.model", "vocab_size": 400, **kwargs}
    with pytest.raises(error, match=match):
        Tokenizer.train(**args)


def test_train_rejects_file_names_passed_as_str(tmp_path, docs):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(docs), encoding="utf-8")
    with pytest.raises(ValueError, match="pathlib.Path"):
        Tokenizer.train([str(path)], tmp_path / "x.model", 400)


def test_train_or_load_caches(tmp_path, docs, monkeypatch):
    calls = []
    real_train = spm.SentencePieceTrainer.train

    def counting_train(*args, **kwargs):
        calls.append(kwargs.get("vocab_size"))
        return real_train(*args, **kwargs)

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", counting_train)
    files = []
    for i, doc in enumerate(docs[:10]):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_bytes(doc.encode("utf-8"))
    cache = tmp_path / "cache"

    first = tokenizer_lib.train_or_load(files, cache, 320, "bpe")
    assert len(calls) == 1 and first.path.parent == cache
    mtime = first.path.stat().st_mtime_ns
    second = Tokenizer.train_or_load(files, cache, 320, "bpe")
    assert len(calls) == 1
    assert second.fingerprint == first.fingerprint and second.path == first.path
    assert first.path.stat().st_mtime_ns == mtime

    Tokenizer.train_or_load(files, cache, 330, "bpe")
    assert len(calls) == 2
    Tokenizer.train_or_load(files, cache, 320, "unigram")
    assert len(calls) == 3
    files[0].write_bytes(b"changed corpus text\n" + docs[0].encode("utf-8"))
    Tokenizer.train_or_load(files, cache, 320, "bpe")
    assert len(calls) == 4
    # Text documents are keyed by their content as well.
    Tokenizer.train_or_load(docs[:10], cache, 320, "bpe")
    Tokenizer.train_or_load(list(docs[:10]), cache, 320, "bpe")
    assert len(calls) == 5


def test_train_or_load_retrains_over_corrupt_cache(tmp_path, docs):
    cache = tmp_path / "cache"
    first = Tokenizer.train_or_load(docs, cache, 320)
    first.path.write_bytes(b"garbage")
    again = Tokenizer.train_or_load(docs, cache, 320)
    assert again.fingerprint == first.fingerprint
    assert Tokenizer.load(again.path).fingerprint == first.fingerprint
