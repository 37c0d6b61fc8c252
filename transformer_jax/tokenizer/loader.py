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
    """Loads the tokenizer of a checkpoint directory, a ``tokenizer.json`` (``HFTokenizer``,
    preferred where a directory holds both) or a SentencePiece ``.model`` file (``Tokenizer``),
    with the settings files beside it.

    Raises:
      FileNotFoundError: If the path does not exist or a directory holds no tokenizer file.
      ValueError: If the tokenizer or a settings file does not parse.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        directory = path
        file = next((path / name for name in (TOKENIZER_FILE, DEFAULT_MODEL_FILENAME)
                     if (path / name).is_file()), None)
        if file is None:
            raise FileNotFoundError(f"{path} holds no tokenizer: expected {TOKENIZER_FILE} or "
                                    f"{DEFAULT_MODEL_FILENAME}")
    elif path.is_file():
        directory, file = path.parent, path
    else:
        raise FileNotFoundError(f"tokenizer not found: {path}")
    config = TokenizerConfig.read(directory)
    backend = HFTokenizer if file.suffix == ".json" else Tokenizer
    tokenizer: TextTokenizer = backend.load(file, config=config)
    logger.info("loaded tokenizer %r (bos=%d, eos=%d, add_bos=%s, chat template: %s)", tokenizer,
                tokenizer.bos_id, tokenizer.eos_id, tokenizer.add_bos_token,
                "yes" if tokenizer.chat_template else "no")
    return tokenizer


__all__ = ["load_tokenizer"]
