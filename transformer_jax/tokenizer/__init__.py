"""Tokenizers: SentencePiece models (trained here or Llama 2's) and HuggingFace tokenizer.json,
behind ``base.TextTokenizer``; ``load_tokenizer`` picks the backend for a checkpoint directory.
"""

from transformer_jax.tokenizer.base import TextTokenizer, TokenizerConfig, detokenize
from transformer_jax.tokenizer.chat import ChatTemplate, ChatTemplateError, render_chat
from transformer_jax.tokenizer.hf_backend import HFTokenizer
from transformer_jax.tokenizer.loader import load_tokenizer
from transformer_jax.tokenizer.spm_backend import DEFAULT_MODEL_FILENAME, Tokenizer, train_or_load
from transformer_jax.tokenizer.spm_train import (
    BOS_ID,
    EOS_ID,
    MODEL_TYPES,
    PAD_ID,
    UNK_ID,
    ModelType,
    Source,
    read_utf8,
)

__all__ = ["detokenize", "BOS_ID", "DEFAULT_MODEL_FILENAME", "EOS_ID", "MODEL_TYPES", "PAD_ID",
           "UNK_ID", "ChatTemplate", "ChatTemplateError", "HFTokenizer", "ModelType", "Source",
           "TextTokenizer", "Tokenizer", "TokenizerConfig", "load_tokenizer", "read_utf8",
           "render_chat", "train_or_load"]
