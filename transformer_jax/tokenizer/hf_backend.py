"""Tokenizers of checkpoints that ship a HuggingFace ``tokenizer.json`` (Llama 3, Qwen2, Mistral),
with ``tokenizer_config.json`` applied as transformers' fast tokenizers do: ``encode`` matches
``tokenizer.encode(text, add_special_tokens=False)``, ``decode`` ``tokenizer.decode(ids)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import tokenizers

from transformer_jax.tokenizer.base import TokenizerBackend, TokenizerConfig, check_ids

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
# The class of saved tokenizers that had none: transformers uses tokenizer.json as stored.
DEFAULT_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


class HFTokenizer(TokenizerBackend):
    """A ``tokenizers.Tokenizer`` with the checkpoint's special tokens and settings; ``path``
    is the ``tokenizer.json`` it was loaded from, or None."""

    def __init__(self, backend: tokenizers.Tokenizer, config: TokenizerConfig | None = None,
                 path: Path | None = None):
        """Wraps a copy of a loaded ``tokenizers.Tokenizer`` with the checkpoint's settings
        (None: no named special tokens) and where its ``tokenizer.json`` lives."""
        self._tok = tokenizers.Tokenizer.from_str(backend.to_str())
        self._tok.no_truncation()
        self._tok.no_padding()
        self._config = config or TokenizerConfig()
        self.path = path
        present = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        missing = [t for t in self._config.all_special if t and t not in present]
        if missing:
            # transformers adds every named/extra special token that is not an added token yet.
            self._tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in missing])
            logger.info("added special tokens %s to %s", missing, path or "tokenizer")
        ids = {name: i for name, token in self._config.special.items()
               if (i := self.token_to_id(token)) is not None}
        self._bos, self._eos, self._unk, self._own_pad_id = (
            ids.get(f"{name}_token", -1) for name in ("bos", "eos", "unk", "pad"))
        self._add_bos, self._add_eos = self._default_bos_eos()
        serialised = self._tok.to_str()
        self._model_type = json.loads(serialised)["model"].get("type")
        digest = hashlib.sha256(serialised.encode())
        digest.update(json.dumps(self._config.special, sort_keys=True).encode())
        self._fingerprint = digest.hexdigest()

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, config: TokenizerConfig | None = None
             ) -> HFTokenizer:
        """Loads ``tokenizer.json`` (the file or its directory) and, unless ``config`` is given,
        the settings beside it; ValueError if it is not a valid ``tokenizers`` model."""
        file = Path(path)
        if file.is_dir():
            file = file / TOKENIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {file}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises plain Exception
            raise ValueError(f"{file} is not a valid tokenizer.json: {e}") from e
        if config is None:
            config = TokenizerConfig.read(file.parent)
        return cls(backend, config, file)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer`` (with the added special tokens)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids V, added tokens included (transformers' ``len(tokenizer)``)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def add_bos_token(self) -> bool:
        """Whether transformers' ``tokenizer(text)`` prepends bos: the config's
        ``add_bos_token`` if set, else what ``tokenizer.json``'s post-processor does."""
        return self._add_bos

    @property
    def add_eos_token(self) -> bool:
        """As ``add_bos_token``, for eos at the end."""
        return self._add_eos

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens that are set (``bos_token``, ``eos_token``, ...)."""
        return dict(self._config.special)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary string of ``token_id`` (validated to be in ``[0, V)``)."""
        check_ids(np.asarray([token_id]), self.vocab_size)
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            raise ValueError(f"token id {token_id} has no vocabulary entry")
        return piece

    def token_to_id(self, token: str) -> int | None:
        """The id of vocabulary string ``token``, or None."""
        token_id = self._tok.token_to_id(token)
        return None if token_id is None else int(token_id)

    def _encode_ids(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids if text else []

    def _decode_ids(self, ids: list[int]) -> str:
        """Special tokens kept, as transformers' ``tokenizer.decode(ids)`` does."""
        text = self._tok.decode(ids, skip_special_tokens=False)
        # transformers' clean-up drops the space before punctuation and contractions, but not
        # for BPE models, where it would corrupt the text.
        if self._config.clean_up_tokenization_spaces and self._model_type != "BPE":
            for spaced in (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're"):
                text = text.replace(spaced, spaced.strip())
        return text

    def save(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Writes ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory`` (created),
        as ``load_tokenizer`` and ``AutoTokenizer`` load them; returns the written files."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        file = directory / TOKENIZER_FILE
        self._tok.save(str(file))
        fields = ("content", "lstrip", "rstrip", "normalized", "single_word", "special")
        added = {str(i): {f: getattr(t, f) for f in fields}
                 for i, t in sorted(self._tok.get_added_tokens_decoder().items())}
        overrides: dict[str, object] = {
            "tokenizer_class": self._config.raw.get("tokenizer_class", DEFAULT_TOKENIZER_CLASS),
            "added_tokens_decoder": added,
        }
        if self._config.add_bos_token is not None or self._config.add_eos_token is not None:
            overrides["add_bos_token"] = self._add_bos
            overrides["add_eos_token"] = self._add_eos
        return [file, self._config.write(directory, **overrides)]

    def _default_bos_eos(self) -> tuple[bool, bool]:
        """``(add_bos_token, add_eos_token)`` (see those properties)."""
        config = self._config
        if config.add_bos_token is not None or config.add_eos_token is not None:
            return (bool(config.add_bos_token) and self._bos >= 0,
                    bool(config.add_eos_token) and self._eos >= 0)
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        extra = len(full) - len(plain)
        add_bos = extra > 0 and self._bos >= 0 and full[0] == self._bos
        add_eos = extra - int(add_bos) > 0 and self._eos >= 0 and full[-1] == self._eos
        return add_bos, add_eos


__all__ = ["DEFAULT_TOKENIZER_CLASS", "TOKENIZER_FILE", "HFTokenizer"]
