"""``load_tokenizer``: the right backend for a checkpoint directory or a tokenizer file."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from transformer_jax.tokenizer.base import TextTokenizer, TokenizerConfig
from transformer_jax.tokenizer.hf_backend import TOKENIZER_FILE, HFTokenizer
from transformer_jax.tokenizer.spm_backend import DEFAULT_MODEL_FILENAME, Tokenizer

logger = logging.getLogger(__name__)


def load_tokenizer(path: str | os.PathLike[str]) -> TextTokenizer:
    """Loads the tokenizer of a checkpoint directory, or a single tokenizer file.

    A directory holding ``tokenizer.json`` gets the HuggingFace ``tokenizers`` backend, even when
    it also holds ``tokenizer.model`` (transformers' fast tokenizers prefer it too); one with only
    ``tokenizer.model`` gets SentencePiece. Either way the directory's ``tokenizer_config.json``,
    ``special_tokens_map.json`` and ``chat_template.jinja`` supply the special tokens, whether to
    add bos/eos and the chat template. A file is loaded by its kind (``.json`` or a
    SentencePiece model) with the settings files beside it.

    Args:
      path: A checkpoint directory, a ``tokenizer.json`` or a SentencePiece ``.model`` file.

    Returns:
      An ``HFTokenizer`` or a SentencePiece ``Tokenizer``.

    Raises:
      FileNotFoundError: If the path does not exist or a directory holds no tokenizer file.
      ValueError: If the tokenizer or a settings file does not parse.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        directory = path
        if (path / TOKENIZER_FILE).is_file():
            file = path / TOKENIZER_FILE
        elif (path / DEFAULT_MODEL_FILENAME).is_file():
            file = path / DEFAULT_MODEL_FILENAME
        else:
            raise FileNotFoundError(
                f"{path} holds no tokenizer: expected {TOKENIZER_FILE} or {DEFAULT_MODEL_FILENAME}"
            )
    elif path.is_file():
        directory, file = path.parent, path
    else:
        raise FileNotFoundError(f"tokenizer not found: {path}")
    config = TokenizerConfig.read(directory)
    backend = HFTokenizer if file.suffix == ".json" else Tokenizer
    tokenizer: TextTokenizer = backend.load(file, config=config)
    logger.info(
        "loaded tokenizer %r (bos=%d, eos=%d, add_bos=%s, chat template: %s)",
        tokenizer,
        tokenizer.bos_id,
        tokenizer.eos_id,
        tokenizer.add_bos_token,
        "yes" if tokenizer.chat_template else "no",
    )
    return tokenizer


__all__ = ["load_tokenizer"]
