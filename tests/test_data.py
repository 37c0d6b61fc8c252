"""Tests for transformer_jax.data: corpus resolution, token cache, splits and batches."""

from __future__ import annotations

import random
from pathlib import Path

import chex
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_jax.data import batches as data
from transformer_jax.data import corpus
from transformer_jax.tokenizer import Tokenizer, read_utf8


def write_docs(directory: Path, num_docs: int = 6, seed: int = 0) -> list[Path]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "héllo", "wörld", "return", "index", "42"]
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(num_docs):
        lines = [
            rng.choice(["", "    ", "\t"]) + " ".join(rng.choices(words, k=rng.randint(1, 8)))
            for _ in range(rng.randint(3, 12))
        ]
        path = directory / f"doc{i:02d}.txt"
        path.write_bytes(("\n".join(lines) + "\n").encode("utf-8"))
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    root = tmp_path_factory.mktemp("tok")
    files = write_docs(root / "corpus", num_docs=10, seed=1)
    return Tokenizer.train(files, root / "bpe.model", 320, "bpe")


# ------------------------------------------------------------------------------------ corpus


def test_resolve_corpus_globs_sorted_and_deduplicated(tmp_path):
    for name in ["b.txt", "a.txt", "sub/c.txt", "sub/d.md", ".hidden/e.txt"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"text of {name}\n", encoding="utf-8")
    got = corpus.resolve_corpus(
        [str(tmp_path / "*.txt"), tmp_path / "a.txt", str(tmp_path / "b.txt")]
    )
    assert got == [(tmp_path / "a.txt").resolve(), (tmp_path / "b.txt").resolve()]
    recursive = corpus.resolve_corpus(str(tmp_path / "**" / "*.txt"))
    # glob.glob semantics: "**" recurses but does not enter hidden directories.
    assert recursive == [(tmp_path / n).resolve() for n in ["a.txt", "b.txt", "sub/c.txt"]]
    directory = corpus.resolve_corpus(tmp_path)
    expected = sorted(
        p.resolve() for p in tmp_path.rglob("*") if p.is_file() and ".hidden" not in p.parts
    )
    assert directory == expected
    assert all(p.is_absolute() for p in directory)


def test_resolve_corpus_errors_name_the_pattern(tmp_path):
    pattern = str(tmp_path / "nothing-*.txt")
    with pytest.raises(FileNotFoundError, match="nothing-"):
        corpus.resolve_corpus(pattern)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        corpus.resolve_corpus([tmp_path / "missing.txt"])
    with pytest.raises(ValueError, match="at least one"):
        corpus.resolve_corpus([])
    (tmp_path / "empty1.txt").write_bytes(b"")
    (tmp_path / "empty2.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        corpus.resolve_corpus(str(tmp_path / "empty*.txt"))


def test_default_corpus_returns_readable_stdlib_sources():
    cap = 300_000
    files = corpus.default_corpus(max_bytes=cap)
    assert files and files == sorted(set(files))
    assert sum(f.stat().st_size for f in files) <= cap
    for f in files:
        assert f.is_file() and f.suffix == ".py" and f.stat().st_size > 0
        assert not {"test", "tests", "site-packages"} & set(f.parts)
        read_utf8(f)
    assert corpus.default_corpus(max_bytes=cap) == files
    with pytest.raises(ValueError, match="max_bytes"):
        corpus.default_corpus(max_bytes=0)


# ---------------------------------------------------------------------------------- tokenize


def test_token_dtype_boundaries():
    assert corpus.token_dtype(300) == np.uint16
    assert corpus.token_dtype(2**16) == np.uint16
    assert corpus.token_dtype(2**16 + 1) == np.uint32
    assert corpus.token_dtype(128_256) == np.uint32
    with pytest.raises(ValueError, match="0"):
        corpus.token_dtype(0)


def expected_tokens(files, tok, add_bos=False, add_eos=True) -> np.ndarray:
    ids: list[int] = []
    for f in files:
        text = f.read_bytes().decode("utf-8")
        if text:
            ids += tok.encode(text, add_bos=add_bos, add_eos=add_eos)
    return np.asarray(ids)


def count_encodes(monkeypatch) -> list[int]:
    calls: list[int] = []
    real_encode = Tokenizer.encode

    def counting(self, text, add_bos=False, add_eos=False):
        calls.append(len(text))
        return real_encode(self, text, add_bos=add_bos, add_eos=add_eos)

    monkeypatch.setattr(Tokenizer, "encode", counting)
    return calls


def test_tokenize_corpus_concatenates_documents_with_eos(tmp_path, tokenizer):
    files = write_docs(tmp_path / "corpus")
    (tmp_path / "corpus" / "empty.txt").write_bytes(b"")
    files.append(tmp_path / "corpus" / "empty.txt")
    tokens = corpus.tokenize_corpus(files, tokenizer, tmp_path / "cache")
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, expected_tokens(files, tokenizer))
    assert int((tokens == tokenizer.eos_id).sum()) == len(files) - 1  # the empty file adds none
    with_bos = corpus.tokenize_corpus(files, tokenizer, tmp_path / "cache", add_bos=True)
    np.testing.assert_array_equal(with_bos, expected_tokens(files, tokenizer, add_bos=True))


def test_tokenize_corpus_cache_reused_and_invalidated(tmp_path, tokenizer, monkeypatch):
    files = write_docs(tmp_path / "corpus")
    cache = tmp_path / "cache"
    calls = count_encodes(monkeypatch)

    def tokenize_counting() -> tuple[np.ndarray, int]:
        before = len(calls)
        tokens = corpus.tokenize_corpus(files, tokenizer, cache)
        return tokens, len(calls) - before

    first, encoded = tokenize_counting()
    assert encoded == len(files)
    assert len(list(cache.iterdir())) == 1

    again, encoded = tokenize_counting()
    assert encoded == 0
    np.testing.assert_array_equal(again, first)

    # Same size, different content: the key hashes contents, not just sizes and mtimes.
    original = files[2].read_bytes()
    edited = original.replace(b"e", b"q", 1)
    assert edited != original and len(edited) == len(original)
    files[2].write_bytes(edited)
    changed, encoded = tokenize_counting()
    assert encoded == len(files)
    np.testing.assert_array_equal(changed, expected_tokens(files, tokenizer))

    files[2].write_bytes(original + b"and one more line\n")
    longer, encoded = tokenize_counting()
    assert encoded == len(files)
    np.testing.assert_array_equal(longer, expected_tokens(files, tokenizer))
    assert len(longer) > len(first)
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


def test_tokenize_corpus_depends_on_tokenizer(tmp_path, tokenizer):
    files = write_docs(tmp_path / "corpus")
    other = Tokenizer.train(files, tmp_path / "char.model", 100, "char")
    a = corpus.tokenize_corpus(files, tokenizer, tmp_path / "cache")
    b = corpus.tokenize_corpus(files, other, tmp_path / "cache")
    np.testing.assert_array_equal(b, expected_tokens(files, other))
    assert len(a) != len(b)


def test_tokenize_corpus_crash_leaves_no_cache(tmp_path, tokenizer, monkeypatch):
    files = write_docs(tmp_path / "corpus")
    cache = tmp_path / "cache"
    real_encode = Tokenizer.encode
    seen = []

    def failing(self, text, add_bos=False, add_eos=False):
        seen.append(text)
        if len(seen) == 3:
            raise KeyboardInterrupt("simulated crash")
        return real_encode(self, text, add_bos=add_bos, add_eos=add_eos)

    monkeypatch.setattr(Tokenizer, "encode", failing)
    with pytest.raises(KeyboardInterrupt):
        corpus.tokenize_corpus(files, tokenizer, cache)
    assert list(cache.iterdir()) == []
    monkeypatch.setattr(Tokenizer, "encode", real_encode)
    tokens = corpus.tokenize_corpus(files, tokenizer, cache)
    np.testing.assert_array_equal(tokens, expected_tokens(files, tokenizer))


def test_tokenize_corpus_errors(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="at least one"):
        corpus.tokenize_corpus([], tokenizer, tmp_path)
    with pytest.raises(FileNotFoundError, match="gone.txt"):
        corpus.tokenize_corpus([tmp_path / "gone.txt"], tokenizer, tmp_path)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt"):
        corpus.tokenize_corpus([tmp_path / "latin1.txt"], tokenizer, tmp_path / "cache")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="no tokens"):
        corpus.tokenize_corpus([tmp_path / "empty.txt"], tokenizer, tmp_path / "cache")


# ------------------------------------------------------------------------------------- split


def test_split_is_contiguous():
    tokens = np.arange(1000, dtype=np.uint16)
    train, val = data.split(tokens, 0.1)
    assert len(val) == 100 and len(train) == 900
    np.testing.assert_array_equal(np.concatenate([train, val]), tokens)
    assert np.shares_memory(train, tokens) and np.shares_memory(val, tokens)
    train0, val0 = data.split(tokens, 0.0)
    assert len(train0) == 1000 and len(val0) == 0
    for bad in [-0.1, 1.0, 0.0001]:
        with pytest.raises(ValueError, match="val_fraction"):
            data.split(tokens, bad)


# ----------------------------------------------------------------------------------- batches


@pytest.fixture(scope="module")
def flat_tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 500, size=3000).astype(np.uint16)


def test_get_batch_windows_match_flat_tokens(flat_tokens):
    batch = data.get_batch(flat_tokens, seed=3, step=7, batch_size=8, seq_len=16)
    chex.assert_shape(batch["inputs"], (8, 16))
    chex.assert_shape(batch["targets"], (8, 16))
    assert batch["inputs"].dtype == np.int32 and batch["targets"].dtype == np.int32
    offsets = data.batch_offsets(3, 7, 8, len(flat_tokens), 16)
    for row, start in enumerate(offsets):
        np.testing.assert_array_equal(batch["inputs"][row], flat_tokens[start : start + 16])
        np.testing.assert_array_equal(batch["targets"][row], flat_tokens[start + 1 : start + 17])


def test_targets_are_next_tokens():
    # With tokens equal to their positions, every window is a run of consecutive integers.
    tokens = np.arange(5000, dtype=np.uint16)
    batch = data.get_batch(tokens, seed=0, step=1, batch_size=16, seq_len=32)
    np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)
    np.testing.assert_array_equal(np.diff(batch["inputs"], axis=1), 1)
    assert batch["targets"].max() < len(tokens)


def test_get_batch_deterministic_and_step_dependent(flat_tokens):
    a = data.get_batch(flat_tokens, 0, 5, 8, 16)
    b = data.get_batch(flat_tokens, 0, 5, 8, 16)
    chex.assert_trees_all_equal(a, b)
    c = data.get_batch(flat_tokens, 0, 6, 8, 16)
    d = data.get_batch(flat_tokens, 1, 5, 8, 16)
    assert not np.array_equal(a["inputs"], c["inputs"])
    assert not np.array_equal(a["inputs"], d["inputs"])


@pytest.mark.parametrize("process_count", [1, 2, 4, 8])
def test_process_slices_partition_global_batch(flat_tokens, process_count):
    global_batch = data.get_batch(flat_tokens, 11, 3, 8, 16)
    parts = [
        data.get_batch(flat_tokens, 11, 3, 8, 16, process_index=p, process_count=process_count)
        for p in range(process_count)
    ]
    for part in parts:
        chex.assert_shape(part["inputs"], (8 // process_count, 16))
    for key in ("inputs", "targets"):
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), global_batch[key])
    # Disjoint rows: each process's rows start where the previous process's rows end.
    offsets = data.batch_offsets(11, 3, 8, len(flat_tokens), 16)
    local = 8 // process_count
    for p, part in enumerate(parts):
        rows = offsets[p * local : (p + 1) * local]
        np.testing.assert_array_equal(part["inputs"][:, 0], flat_tokens[rows])


def test_get_batch_errors(flat_tokens):
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by process_count=4"):
        data.get_batch(flat_tokens, 0, 0, 6, 16, process_index=0, process_count=4)
    with pytest.raises(ValueError, match="process_index=2"):
        data.get_batch(flat_tokens, 0, 0, 8, 16, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="seq_len=3000"):
        data.get_batch(flat_tokens, 0, 0, 8, len(flat_tokens))
    with pytest.raises(ValueError, match="seed"):
        data.get_batch(flat_tokens, -1, 0, 8, 16)
    with pytest.raises(ValueError, match="step"):
        data.get_batch(flat_tokens, 0, -2, 8, 16)
    with pytest.raises(ValueError, match="1-D"):
        data.get_batch(flat_tokens.reshape(2, -1), 0, 0, 8, 16)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    step=st.integers(0, 10**9),
    num_tokens=st.integers(2, 400),
    seq_len=st.integers(1, 64),
    local=st.integers(1, 4),
    process_count=st.integers(1, 3),
)
def test_get_batch_property(seed, step, num_tokens, seq_len, local, process_count):
    seq_len = min(seq_len, num_tokens - 1)
    tokens = np.random.default_rng(num_tokens).integers(0, 1000, size=num_tokens)
    batch_size = local * process_count
    offsets = data.batch_offsets(seed, step, batch_size, num_tokens, seq_len)
    assert offsets.min() >= 0 and offsets.max() + seq_len < num_tokens
    process_index = step % process_count
    batch = data.get_batch(
        tokens,
        seed,
        step,
        batch_size,
        seq_len,
        process_index=process_index,
        process_count=process_count,
    )
    for row, start in enumerate(offsets[process_index * local : (process_index + 1) * local]):
        np.testing.assert_array_equal(batch["inputs"][row], tokens[start : start + seq_len])
        np.testing.assert_array_equal(
            batch["targets"][row], tokens[start + 1 : start + seq_len + 1]
        )


def test_batches_class_matches_function(flat_tokens):
    batches = data.Batches(
        flat_tokens, batch_size=4, seq_len=8, seed=9, process_index=1, process_count=2
    )
    stream = batches.iterate(start_step=5)
    for step in range(5, 8):
        expected = data.get_batch(flat_tokens, 9, step, 4, 8, process_index=1, process_count=2)
        chex.assert_trees_all_equal(batches.get(step), expected)
        chex.assert_trees_all_equal(next(stream), expected)
    with pytest.raises(ValueError, match="divisible"):
        data.Batches(flat_tokens, batch_size=3, seq_len=8, process_count=2)


# -------------------------------------------------------------------------------------- eval


def test_eval_batches_sequential(flat_tokens):
    tokens = flat_tokens[:1000]
    batches = list(data.eval_batches(tokens, batch_size=4, seq_len=20))
    num_windows = (len(tokens) - 1) // 20
    assert len(batches) == num_windows // 4
    windows = [tokens[w * 20 : w * 20 + 21] for w in range(len(batches) * 4)]
    inputs = np.concatenate([b["inputs"] for b in batches])
    targets = np.concatenate([b["targets"] for b in batches])
    np.testing.assert_array_equal(inputs, np.stack([w[:-1] for w in windows]))
    np.testing.assert_array_equal(targets, np.stack([w[1:] for w in windows]))
    again = list(data.eval_batches(tokens, batch_size=4, seq_len=20))
    chex.assert_trees_all_equal(batches, again)
    assert len(list(data.eval_batches(tokens, 4, 20, max_batches=3))) == 3


def test_eval_batches_process_slices(flat_tokens):
    whole = list(data.eval_batches(flat_tokens, 4, 16, max_batches=5))
    halves = [
        list(data.eval_batches(flat_tokens, 4, 16, 5, process_index=p, process_count=2))
        for p in range(2)
    ]
    for i, batch in enumerate(whole):
        np.testing.assert_array_equal(
            np.concatenate([halves[0][i]["inputs"], halves[1][i]["inputs"]]), batch["inputs"]
        )


def test_eval_batches_errors_are_eager(flat_tokens):
    with pytest.raises(ValueError, match="do not fill"):
        data.eval_batches(flat_tokens[:50], batch_size=4, seq_len=16)
    with pytest.raises(ValueError, match="seq_len=50"):
        data.eval_batches(flat_tokens[:50], batch_size=1, seq_len=50)
    with pytest.raises(ValueError, match="max_batches"):
        data.eval_batches(flat_tokens, 4, 16, max_batches=0)


def test_end_to_end_memmap_pipeline(tmp_path, tokenizer):
    files = corpus.resolve_corpus(str(write_docs(tmp_path / "corpus", num_docs=8)[0].parent / "*"))
    tokens = corpus.tokenize_corpus(files, tokenizer, tmp_path / "cache")
    train, val = data.split(tokens, 0.2)
    batch = data.get_batch(train, seed=0, step=0, batch_size=4, seq_len=8)
    offsets = data.batch_offsets(0, 0, 4, len(train), 8)
    flat = expected_tokens(files, tokenizer)
    for row, start in enumerate(offsets):
        np.testing.assert_array_equal(batch["inputs"][row], flat[start : start + 8])
    first_eval = next(data.eval_batches(val, batch_size=2, seq_len=8))
    np.testing.assert_array_equal(first_eval["inputs"][0], flat[len(train) : len(train) + 8])
