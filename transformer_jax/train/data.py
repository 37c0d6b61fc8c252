"""A run's data: the token splits of a text corpus, the packed rows of ``.jsonl`` instruction
files, or shard builds (``data.shards``), and their batches (pure in (seed, step))."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from transformer_jax.checkpoint.manager import ensure_writable_dir
from transformer_jax.data import batches as data_lib
from transformer_jax.data import corpus
from transformer_jax.data import shards as shards_lib
from transformer_jax.data.instruct import (
    PackedBatches,
    PackedData,
    count,
    load_instruction_data,
    packed_eval_batches,
    with_mask,
)
from transformer_jax.data.preference import PairBatches, PreferenceRows
from transformer_jax.tokenizer import MODEL_TYPES, TextTokenizer, Tokenizer, load_tokenizer
from transformer_jax.train.config import DataConfig, TrainConfig
from transformer_jax.train.resume import data_fingerprint

logger = logging.getLogger(__name__)


def prepare_data(data_config: DataConfig, vocab_size: int, tokenizer: TextTokenizer | None = None
                 ) -> tuple[TextTokenizer, np.ndarray, np.ndarray]:
    """``(tokenizer, train_tokens [N_train], val_tokens [N_val])``: tokenizes the corpus (cached)
    with ``tokenizer``, or with the one of ``data_config`` (loaded or trained; ``vocab_size``
    unless ``data.vocab_size`` gives one), and splits it.

    Raises:
      FileNotFoundError: for a missing corpus or tokenizer file.
      ValueError: for an empty corpus or a tokenizer file that does not load.
    """
    dc = data_config
    if dc.packing == "pack":
        raise ValueError("data.packing=pack reads shard builds: make them with python -m "
                         "transformer_jax.data build --out DIR and pass data.path=DIR")
    cache_dir = Path(dc.cache_dir).expanduser()
    files = (corpus.resolve_corpus(dc.patterns) if dc.patterns
             else corpus.default_corpus(dc.max_bytes))
    ensure_writable_dir(cache_dir, "data cache directory")
    if tokenizer is None and dc.tokenizer in MODEL_TYPES:
        tokenizer = Tokenizer.train_or_load(files, cache_dir, dc.vocab_size or vocab_size,
                                            dc.tokenizer)
    elif tokenizer is None:
        tokenizer = Tokenizer.load(Path(dc.tokenizer).expanduser())
    tokens = corpus.tokenize_corpus(files, tokenizer, cache_dir)
    train_tokens, val_tokens = data_lib.split(tokens, dc.val_fraction)
    logger.info("data: %d files, %d train / %d val tokens, tokenizer %s", len(files),
                len(train_tokens), len(val_tokens), tokenizer)
    return tokenizer, train_tokens, val_tokens


@dataclasses.dataclass(frozen=True, eq=False)
class ShardData:
    """A run's shard builds: the mixture, how rows are cut, the validation streams.

    Attributes:
      mixture: the sources (one, ``data``, for a plain ``data.path``) and their weights.
      packing: ``pack`` or ``concat``.
      seq_len: T, the run's row length.
      num_train_tokens: the train split's size in tokens, all sources.
      val: the validation stream of all sources together.
      source_val: each source's validation stream (a mixture's; else empty).
      fingerprint: what a resumed run must read the same (``shards.fingerprint``).
    """

    mixture: shards_lib.Mixture
    packing: str
    seq_len: int
    num_train_tokens: int
    val: shards_lib.TokenStream
    source_val: dict[str, shards_lib.TokenStream]
    fingerprint: str
    _batches: dict = dataclasses.field(default_factory=dict)

    def batches(self, tc: TrainConfig, process_index: int, process_count: int
                ) -> shards_lib.ShardBatches:
        """The ``ShardBatches`` of this split over processes (opened once)."""
        key = (tc.seed, tc.batch_size, tc.seq_len, process_index, process_count)
        if key not in self._batches:
            self._batches[key] = shards_lib.ShardBatches(
                self.mixture, tc.seq_len, tc.batch_size, self.packing, tc.seed,
                process_index, process_count)
        return self._batches[key]


def prepare_shard_data(data_config: DataConfig, seq_len: int, tokenizer: TextTokenizer | None,
                       where: str = "data.tokenizer") -> tuple[TextTokenizer, ShardData]:
    """Opens the shard builds of ``data.path`` / ``data.mixture`` for rows of ``seq_len``,
    checked against ``tokenizer`` (named ``where`` in an error; None: the first build's).

    Raises:
      ValueError: another tokenizer than the builds', a bad mixture, mixed tokenizers.
    """
    # Builds on object storage are read from a local copy (ArrayRecord reads local files only).
    given = shards_lib.Mixture.parse(data_config.path, data_config.mixture)
    mixture = given.fetched()
    builds = [b for source in mixture.builds for b in source]
    if tokenizer is None:
        tokenizer = load_tokenizer(Path(builds[0]).expanduser() / "tokenizer")
        where = f"the tokenizer of {builds[0]}"
    shards_lib.check_tokenizer(builds, tokenizer.fingerprint, where)
    packing = "pack" if data_config.packing == "auto" else data_config.packing
    train = sum(shards_lib.TokenStream.open(s, "train").num_tokens for s in mixture.builds)
    source_val = ({name: shards_lib.TokenStream.open(s, "val")
                   for name, s in zip(mixture.names, mixture.builds, strict=True)}
                  if len(mixture.names) > 1 else {})
    for name, stream in source_val.items():
        if not shards_lib.eval_rows(stream, packing, seq_len):
            logger.warning("data source %r has %d validation tokens, not one row of %d: it is "
                           "left out of the validation loss (the weighted mean of the other "
                           "sources' losses)", name, stream.num_tokens, seq_len + 1)
    data = ShardData(mixture, packing, seq_len, train, shards_lib.TokenStream.open(builds, "val"),
                     source_val, shards_lib.fingerprint(builds, [packing, mixture.names,
                                                                 mixture.weights]))
    logger.info("data: shards %s (%s), %d train / %d val tokens, tokenizer %s", ", ".join(
        f"{n}={'+'.join(b)}:{w:.3g}" for n, b, w in zip(given.names, given.builds,
                                                         given.weights, strict=True)),
                packing, train, data.val.num_tokens, tokenizer)
    return tokenizer, data


@dataclasses.dataclass(frozen=True)
class RunData:
    """A run's train and validation data: token streams (text), packed rows (``.jsonl``) or
    shards; batches are pure in (seed, step).

    Attributes:
      train_tokens: [N_train] token ids (text), or None.
      val_tokens: [N_val] token ids (text), or None.
      train_rows: packed train rows (instruction data), or None.
      val_rows: packed validation rows, or None.
      shards: shard builds, or None.
      pairs: a preference objective's packed train pairs (``train_rows`` are theirs), or None.
      reference: DPO's stored reference log-probs [num_pairs, 2], or None.
    """

    train_tokens: np.ndarray | None = None
    val_tokens: np.ndarray | None = None
    train_rows: PackedData | None = None
    val_rows: PackedData | None = None
    shards: ShardData | None = None
    pairs: PreferenceRows | None = None
    reference: np.ndarray | None = None

    @property
    def packed(self) -> bool:
        return self.train_rows is not None

    @property
    def num_train_tokens(self) -> int:
        """Train size in tokens (packed: rows x (T + 1))."""
        if self.shards is not None:
            return self.shards.num_train_tokens
        return len(self.train_tokens) if not self.packed else self.train_rows.tokens.size

    @property
    def num_val_tokens(self) -> int:
        """Validation size in tokens; packed rows count as ``R x T + 1`` (R windows)."""
        if self.shards is not None:
            return shards_lib.eval_tokens(self.shards.val, self.shards.packing, self.shards.seq_len)
        if not self.packed:
            return len(self.val_tokens)
        rows = self.val_rows.num_rows if self.val_rows is not None else 0
        return rows * self.train_rows.seq_len + 1 if rows else 0

    def fingerprint(self) -> str:
        """``data_fingerprint`` of the token ids (and, packed, of the loss masks)."""
        if self.shards is not None:
            return self.shards.fingerprint
        if not self.packed:
            return data_fingerprint(self.train_tokens, self.val_tokens)
        arrays = [self.train_rows.tokens, self.train_rows.loss_tokens]
        if self.val_rows is not None:
            arrays += [self.val_rows.tokens, self.val_rows.loss_tokens]
        return data_fingerprint(*arrays)

    def batch(self, tc: TrainConfig, step: int, process_index: int = 0, process_count: int = 1
              ) -> dict[str, np.ndarray]:
        """This process's rows of the global batch of ``step``: each key [B / P, T]."""
        if self.shards is not None:
            return self.shards.batches(tc, process_index, process_count).get(step)
        if not self.packed:
            return data_lib.get_batch(self.train_tokens, tc.seed, step, tc.batch_size,
                                      tc.seq_len, process_index=process_index,
                                      process_count=process_count)
        if self.pairs is not None:
            return PairBatches(self.pairs, tc.batch_size, tc.seed, process_index, process_count,
                               self.reference).get(step)
        return with_mask(PackedBatches(self.train_rows, tc.batch_size, tc.seed, process_index,
                                       process_count).get(step))

    def eval_batches(self, batch_size: int, seq_len: int, max_batches: int | None = None, *,
                     process_index: int = 0, process_count: int = 1
                     ) -> Iterator[dict[str, np.ndarray]]:
        """Deterministic validation batches (see ``data.eval_batches``); packed rows are taken
        in order, a last incomplete batch filled with rows of zero mask."""
        if self.shards is not None:
            return shards_lib.eval_batches(self.shards.val, self.shards.packing, batch_size,
                                           seq_len, max_batches, process_index=process_index,
                                           process_count=process_count)
        if not self.packed:
            return data_lib.eval_batches(self.val_tokens, batch_size, seq_len, max_batches,
                                         process_index=process_index, process_count=process_count)
        return packed_eval_batches(self.val_rows, batch_size, max_batches, process_index,
                                    process_count)

    def source_eval_batches(self, batch_size: int, seq_len: int,
                            max_batches: int | None = None, *, process_index: int = 0,
                            process_count: int = 1) -> dict[str, Iterator[dict[str, np.ndarray]]]:
        """Each mixture source's validation batches by name (a source without a row left out)."""
        if self.shards is None:
            return {}
        return {name: shards_lib.eval_batches(stream, self.shards.packing, batch_size, seq_len,
                                              max_batches, process_index=process_index,
                                              process_count=process_count, pad=True)
                for name, stream in self.shards.source_val.items()
                if shards_lib.eval_rows(stream, self.shards.packing, seq_len)}


def split_rows(rows: PackedData, val_fraction: float) -> tuple[PackedData, PackedData | None]:
    """``(train rows, validation rows or None)``: ``round(val_fraction * R)`` packed rows (at least
    one when the fraction is positive and R > 1) held out by a fixed permutation, in order."""
    train, val = split_index(rows.num_rows, val_fraction)
    return rows.take(train), None if val is None else rows.take(val)


def split_index(count: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray | None]:
    """The sorted train and validation row indices of ``split_rows`` (of ``count`` rows)."""
    n_val = min(count - 1, max(1, round(val_fraction * count))) if val_fraction > 0 else 0
    if n_val <= 0:
        return np.arange(count), None
    order = np.random.default_rng(0).permutation(count)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def prepare_instruction_data(data_config: DataConfig, tokenizer: TextTokenizer, seq_len: int
                             ) -> RunData:
    """Reads, tokenizes and packs the ``.jsonl`` files of ``data.path`` and splits the rows.

    Raises:
      InstructionDataError: a bad record (``FILE:LINE: ...``).
      ValueError: no record keeps a completion token within ``seq_len + 1`` tokens.
    """
    files = data_config.instruction_files()
    packed = load_instruction_data(files, tokenizer, seq_len)
    train, val = split_rows(packed, data_config.val_fraction)
    where = files[0] if len(files) == 1 else f"{len(files)} files"
    logger.info("instruction data (%s): %s (%d cut to fit, %d dropped) in %s of %d tokens: "
                "%d train / %d val rows; %.1f%% of the target tokens carry the loss", where,
                count(packed.num_examples, "example"), packed.num_truncated, packed.num_dropped,
                count(packed.num_rows, "packed row"), seq_len + 1, train.num_rows,
                0 if val is None else val.num_rows, 100 * packed.loss_tokens.mean())
    return RunData(train_rows=train, val_rows=val)
