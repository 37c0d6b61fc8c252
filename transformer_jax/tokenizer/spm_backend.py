"""SentencePiece tokenizer: load an existing model (e.g. Llama 2's) or train one on a corpus.

Trained models (``spm_train``) round-trip any text exactly (``"char"``: of its corpus's
characters) and reserve ids ``unk=0, bos=1, eos=2, pad=3``. With a ``TokenizerConfig`` its
special-token strings in text become their ids, as transformers does (``legacy=False``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

from transformer_jax.storage.files import atomic_writer
from transformer_jax.tokenizer.base import TokenizerBackend, TokenizerConfig, check_ids
from transformer_jax.tokenizer.spm_train import (
    BOS_ID,
    EOS_ID,
    MODEL_TYPES,
    PAD_ID,
    SPACE_MARKER,
    UNK_ID,
    ModelType,
    Source,
    cached_model_path,
    read_utf8,
    split_source,
    train_model,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL_FILENAME = "tokenizer.model"


class Tokenizer(TokenizerBackend):
    """A SentencePiece model with exact-round-trip encode/decode and a fixed id layout, from
    ``load``, ``train`` or ``train_or_load``; ``path`` is its ``.model`` file, or None."""

    ENTRY = "piece"

    def __init__(self, processor: spm.SentencePieceProcessor, path: Path | None = None, *,
                 config: TokenizerConfig | None = None):
        """Wraps a loaded, non-empty processor (from the model file at ``path``, if any) with
        the checkpoint's settings (None: a bare model, whose text holds no special tokens)."""
        if processor.get_piece_size() <= 0:
            raise ValueError(f"SentencePiece model {path or '<in memory>'} has no pieces")
        self._sp = processor
        self._bos, self._eos, self._unk = processor.bos_id(), processor.eos_id(), processor.unk_id()
        self._own_pad_id = processor.pad_id()
        self.path = path
        self._config = config
        digest = hashlib.sha256(processor.serialized_model_proto())
        specials = [] if config is None else config.all_special
        self._special_pieces = {token: i for token in specials
                                if token and (i := self.token_to_id(token)) is not None}
        self._special_re: re.Pattern[str] | None = None
        if self._special_pieces:
            # Longest first, so that a special token containing another one wins.
            alternatives = sorted(self._special_pieces, key=len, reverse=True)
            self._special_re = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
            digest.update(json.dumps(sorted(self._special_pieces.items())).encode())
        self._fingerprint = digest.hexdigest()
        self._marker_byte_ids = self._space_marker_byte_ids()

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, config: TokenizerConfig | None = None
             ) -> Tokenizer:
        """Loads a SentencePiece ``.model`` file (or a directory's) with ``config`` (no settings
        file is read); ValueError if it is not a valid SentencePiece model."""
        model_path = Path(path)
        if model_path.is_dir():
            model_path = model_path / DEFAULT_MODEL_FILENAME
        if not model_path.is_file():
            raise FileNotFoundError(f"tokenizer model file not found: {model_path}")
        try:
            processor = spm.SentencePieceProcessor(model_proto=model_path.read_bytes())
        except RuntimeError as e:
            raise ValueError(f"{model_path} is not a valid SentencePiece model: {e}") from e
        if processor.get_piece_size() <= 0:
            raise ValueError(f"{model_path} is not a valid SentencePiece model: it has no pieces")
        return cls(processor, model_path, config=config)

    @classmethod
    def train(cls, source: Source, output: str | os.PathLike[str], vocab_size: int,
              model_type: ModelType = "bpe", *, byte_fallback: bool | None = None,
              character_coverage: float | None = None, num_threads: int | None = None,
              **trainer_options: Any) -> Tokenizer:
        """Trains a SentencePiece model on a corpus and writes it to disk atomically; the
        tokenizer's ``path`` is the written file.

        Args:
          source: The corpus: paths (``os.PathLike``; a single one is one file) of UTF-8 text
            files, one document each, or ``str`` documents (always text, never file names).
          output: A path ending in ``.model``; an existing directory (``<dir>/tokenizer.model``);
            or a prefix (``<prefix>.model``).
          vocab_size: Target number of pieces, specials and bytes included (``"char"``: unused).
          model_type: ``"bpe"``, ``"unigram"`` or ``"char"``.
          byte_fallback: Encode unknown characters as UTF-8 byte pieces; default not ``"char"``.
          character_coverage: Share of characters with a piece; 1.0 for ``"char"``, else 0.9995.
          num_threads: Trainer threads; default the number of CPUs (at most 16).
          **trainer_options: Further ``SentencePieceTrainer`` options (not the fixed ids, I/O).

        Raises:
          ValueError: On an unknown ``model_type``, a too small ``vocab_size``, an empty corpus,
            a reserved trainer option, or a trainer failure.
          FileNotFoundError: If a corpus file does not exist.
        """
        return cls._train(*split_source(source), output, vocab_size, model_type,
                          byte_fallback=byte_fallback, character_coverage=character_coverage,
                          num_threads=num_threads, **trainer_options)

    @classmethod
    def train_or_load(cls, source: Source, cache_dir: str | os.PathLike[str], vocab_size: int,
                      model_type: ModelType = "bpe", **options: Any) -> Tokenizer:
        """``Tokenizer.train`` (same arguments) into ``cache_dir``, or the model cached there
        for the same corpus and settings (``spm_train.cached_model_path``)."""
        files, texts = split_source(source)
        if model_type not in MODEL_TYPES:
            raise ValueError(f"unknown model_type {model_type!r}; expected one of {MODEL_TYPES}")
        key = {"byte_fallback": None, "character_coverage": None, **options}
        key.pop("num_threads", None)
        model_path = cached_model_path(cache_dir, files, texts, vocab_size, model_type, key)
        if model_path.is_file():
            try:
                tokenizer = cls.load(model_path)
            except ValueError:
                logger.warning("cached tokenizer %s is unreadable; retraining", model_path)
            else:
                logger.info("loaded cached tokenizer %s", model_path)
                return tokenizer
        logger.info("training %s tokenizer (vocab_size=%d) into %s", model_type, vocab_size,
                    model_path)
        return cls._train(files, texts, model_path, vocab_size, model_type, **options)

    @classmethod
    def _train(cls, files: list[Path] | None, texts: list[str] | None,
               output: str | os.PathLike[str], vocab_size: int, model_type: str,
               **options: Any) -> Tokenizer:
        """``spm_train.train_model``, the model written to ``output`` atomically and loaded."""
        model = train_model(files, texts, vocab_size, model_type, **options)
        model_path = Path(output)
        if model_path.suffix != ".model":  # a directory's tokenizer.model, or a prefix's .model
            model_path = (model_path / DEFAULT_MODEL_FILENAME if model_path.is_dir()
                          else model_path.with_name(model_path.name + ".model"))
        with atomic_writer(model_path) as f:
            f.write(model)
        tokenizer = cls(spm.SentencePieceProcessor(model_proto=model), model_path)
        logger.info("trained %s tokenizer with %d pieces -> %s", model_type, tokenizer.vocab_size,
                    model_path)
        return tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of pieces V; every id is in ``[0, V)``."""
        return self._sp.get_piece_size()

    @property
    def processor(self) -> spm.SentencePieceProcessor:
        """The wrapped ``SentencePieceProcessor``."""
        return self._sp

    @property
    def add_bos_token(self) -> bool:
        """Whether transformers prepends bos: the config's ``add_bos_token``, else True if the
        model has a bos piece (``LlamaTokenizer``'s default)."""
        setting = None if self._config is None else self._config.add_bos_token
        return (True if setting is None else setting) and self.bos_id >= 0

    @property
    def add_eos_token(self) -> bool:
        """Whether transformers appends eos: the config's ``add_eos_token``, else False."""
        setting = None if self._config is None else self._config.add_eos_token
        return bool(setting) and self.eos_id >= 0

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens: the config's, else the model's own unk/bos/eos/pad pieces."""
        if self._config is not None and self._config.special:
            return dict(self._config.special)
        ids = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self.unk_id,
               "pad_token": self._own_pad_id}
        return {name: self._sp.id_to_piece(i) for name, i in ids.items()
                if 0 <= i < self.vocab_size}

    def id_to_piece(self, token_id: int) -> str:
        """Returns the piece string of ``token_id`` (validated to be in ``[0, V)``)."""
        check_ids(np.asarray([token_id]), self.vocab_size)
        return self._sp.id_to_piece(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of piece ``token``, or None if the model has no such piece."""
        token_id = self._sp.piece_to_id(token)
        if token_id == self._sp.unk_id() and self._sp.id_to_piece(token_id) != token:
            return None
        return int(token_id)

    def save(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Writes ``tokenizer.model`` and a ``LlamaTokenizer`` ``tokenizer_config.json`` into
        ``directory`` (created), as ``load_tokenizer`` and ``AutoTokenizer`` load them."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        model_path = directory / DEFAULT_MODEL_FILENAME
        with atomic_writer(model_path) as f:
            f.write(self._sp.serialized_model_proto())
        config = self._config or TokenizerConfig()
        config = dataclasses.replace(config, special=self.special_tokens)
        # legacy=False: the text after a special token gets no dummy prefix, as encode does.
        config_path = config.write(directory, tokenizer_class="LlamaTokenizer",
                                   add_bos_token=self.add_bos_token,
                                   add_eos_token=self.add_eos_token, legacy=False,
                                   add_prefix_space=self._has_dummy_prefix())
        return [model_path, config_path]

    def _encode_ids(self, text: str) -> list[int]:
        """Encodes text, the config's special-token strings in it to their ids."""
        if self._special_re is None:
            return self._encode_plain(text)
        ids: list[int] = []
        for i, part in enumerate(self._special_re.split(text)):  # odd parts: the specials
            if i % 2:
                ids.append(self._special_pieces[part])
            elif part:
                ids.extend(self._encode_plain(part))
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        """Encodes text that holds no special token."""
        if not (self._marker_byte_ids and SPACE_MARKER in text):
            return self._sp.encode(text)
        # Encode the literal U+2581 as its bytes so it does not come back as a space.
        ids: list[int] = []
        for i, part in enumerate(text.split(SPACE_MARKER)):
            if i:
                ids.extend(self._marker_byte_ids)
            if part:
                ids.extend(self._sp.encode(part))
        return ids

    def _decode_ids(self, ids: list[int]) -> str:
        """bos/eos/pad decode to nothing, unk to `` ⁇ ``."""
        return self._sp.decode(ids)

    def _has_dummy_prefix(self) -> bool:
        """Whether the model prepends a space marker to the text (``add_dummy_prefix``)."""
        pieces = self._sp.encode("x", out_type=str)
        return bool(pieces) and pieces[0].startswith(SPACE_MARKER)

    def _space_marker_byte_ids(self) -> list[int]:
        """Byte-piece ids spelling U+2581, if the model can use them without side effects."""
        ids = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in SPACE_MARKER.encode("utf-8")]
        # With a dummy prefix every separately encoded part would gain a leading space.
        if not all(self._sp.is_byte(i) for i in ids) or self._has_dummy_prefix():
            return []
        return ids


def train_or_load(source: Source, cache_dir: str | os.PathLike[str], vocab_size: int,
                  model_type: ModelType = "bpe", **train_options: Any) -> Tokenizer:
    """Module-level alias of ``Tokenizer.train_or_load`` (same arguments and result)."""
    return Tokenizer.train_or_load(source, cache_dir, vocab_size, model_type, **train_options)


__all__ = ["BOS_ID", "EOS_ID", "DEFAULT_MODEL_FILENAME", "MODEL_TYPES", "PAD_ID", "UNK_ID",
           "ModelType", "Source", "Tokenizer", "read_utf8", "train_or_load"]
