"""The interface every tokenizer backend implements, and a checkpoint's tokenizer settings
(``TokenizerConfig``: ``tokenizer_config.json`` and the files beside it).

Ids: ``bos_id``/``eos_id``/``unk_id`` are -1 when the tokenizer has no such token; ``pad_id`` is
always a usable id (the pad token, else eos, else unk, else 0): padding is masked out of the loss.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: transformers' directory of a checkpoint's named chat templates besides the default.
CHAT_TEMPLATES_DIR = "additional_chat_templates"

# The named special tokens of transformers, in its order; chat templates see them as variables.
NAMED_SPECIAL_TOKENS: tuple[str, ...] = ("bos_token", "eos_token", "unk_token", "sep_token",
                                         "pad_token", "cls_token", "mask_token")


@runtime_checkable
class TextTokenizer(Protocol):
    """What the data pipeline, chat rendering and generation need from a tokenizer:
    ``Tokenizer`` (SentencePiece) or ``HFTokenizer`` (``tokenizer.json``)."""

    @property
    def vocab_size(self) -> int:
        """Number of ids V (added tokens included); every id is in ``[0, V)``."""

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id, or -1 if there is none."""

    @property
    def eos_id(self) -> int:
        """End-of-sequence id, or -1 if there is none."""

    @property
    def pad_id(self) -> int:
        """Id to pad with: the pad token, else eos, else unk, else 0 (never -1)."""

    @property
    def fingerprint(self) -> str:
        """Hex digest that changes whenever the ids produced for some text could change."""

    @property
    def add_bos_token(self) -> bool:
        """Whether transformers' ``tokenizer(text)`` prepends bos for this checkpoint."""

    @property
    def add_eos_token(self) -> bool:
        """Whether transformers' ``tokenizer(text)`` appends eos for this checkpoint."""

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's Jinja chat template source, if it has one."""

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens that are set, e.g. ``{"bos_token": "<s>", ...}``."""

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Text -> ids [T]; special-token strings in the text become their ids."""

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Ids [T] -> text."""

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary string of one id."""

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string, or None if it is not one."""

    def save(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Writes the files that ``load_tokenizer`` and ``AutoTokenizer`` reload it from."""


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """A checkpoint's tokenizer settings, as transformers reads them.

    Attributes:
      special: The named special tokens that are set (``bos_token``, ``eos_token``, ...).
      extra_special: Further special strings (``extra_special_tokens`` and the like), in order.
      add_bos_token, add_eos_token: The config's settings, None when it does not say.
      chat_template: The default chat template source, if any.
      named_templates: The other chat templates by name (``"tool_use"``: with tools).
      clean_up_tokenization_spaces: The config's decode clean-up switch.
      raw: The whole ``tokenizer_config.json`` as read (written back, updated, on save).
    """

    special: Mapping[str, str] = dataclasses.field(default_factory=dict)
    extra_special: tuple[str, ...] = ()
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    chat_template: str | None = None
    named_templates: Mapping[str, str] = dataclasses.field(default_factory=dict)
    clean_up_tokenization_spaces: bool = False
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def all_special(self) -> list[str]:
        """Every special string (named first, then extra), without duplicates."""
        return list(dict.fromkeys([*self.special.values(), *self.extra_special]))

    @classmethod
    def read(cls, directory: str | os.PathLike[str]) -> TokenizerConfig:
        """Reads the (optional) settings files of a checkpoint directory as transformers does
        (``chat_template.jinja`` and ``additional_chat_templates/NAME.jinja`` included);
        ValueError names a file that is not JSON."""
        directory = Path(directory)
        raw = _read_json(directory / CONFIG_FILE)
        settings = dict(raw)
        if "added_tokens_decoder" not in raw:
            settings.update(_read_json(directory / SPECIAL_TOKENS_MAP_FILE))
        special = {key: _token_content(settings[key]) for key in NAMED_SPECIAL_TOKENS
                   if settings.get(key) is not None}
        extra: list[str] = []
        for key in ("additional_special_tokens", "extra_special_tokens"):
            value = settings.get(key) or []
            if isinstance(value, Mapping):  # model-specific named tokens
                for name, token in value.items():
                    special.setdefault(str(name), _token_content(token))
            else:
                extra.extend(_token_content(token) for token in value)
        for token in (raw.get("added_tokens_decoder") or {}).values():
            if isinstance(token, Mapping) and token.get("special", False):
                extra.append(_token_content(token))
        template = raw.get("chat_template")
        named: dict[str, str] = {}
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {item["name"]: item["template"] for item in template}
            template = named.pop("default", None)
        template_file = directory / CHAT_TEMPLATE_FILE
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        for path in sorted((directory / CHAT_TEMPLATES_DIR).glob("*.jinja")):
            named[path.stem] = path.read_text(encoding="utf-8")
        return cls(
            special=special,
            extra_special=tuple(dict.fromkeys(t for t in extra if t not in special.values())),
            add_bos_token=_optional_bool(raw.get("add_bos_token")),
            add_eos_token=_optional_bool(raw.get("add_eos_token")),
            chat_template=template,
            named_templates=named,
            clean_up_tokenization_spaces=bool(raw.get("clean_up_tokenization_spaces", False)),
            raw=raw,
        )

    def to_json(self, **overrides: Any) -> dict[str, Any]:
        """The ``tokenizer_config.json`` content: the raw config updated with these settings,
        then ``overrides``; keys naming other files (``tokenizer_file``, ...) dropped."""
        dropped = ("tokenizer_file", "vocab_file", "name_or_path", "auto_map",
                   *NAMED_SPECIAL_TOKENS)  # the named ones: set from ``special`` below
        out = {k: v for k, v in self.raw.items() if k not in dropped}
        out.update(self.special)
        if self.extra_special:
            out.pop("additional_special_tokens", None)
            out["extra_special_tokens"] = list(self.extra_special)
        if self.named_templates:  # the list form keeps every template in the one file
            default = ([] if self.chat_template is None
                       else [{"name": "default", "template": self.chat_template}])
            out["chat_template"] = default + [{"name": name, "template": source} for name,
                                              source in self.named_templates.items()]
        elif self.chat_template is not None:
            out["chat_template"] = self.chat_template
        out["clean_up_tokenization_spaces"] = self.clean_up_tokenization_spaces
        out.update(overrides)
        return out

    def write(self, directory: Path, **overrides: Any) -> Path:
        """Writes ``to_json(**overrides)`` to ``directory/tokenizer_config.json``."""
        path = directory / CONFIG_FILE
        path.write_text(json.dumps(self.to_json(**overrides), indent=2, ensure_ascii=False)
                        + "\n", encoding="utf-8")
        return path


def detokenize(tokenizer: Any, ids: list[int]) -> str:
    """Decodes ids; ids past the tokenizer's vocabulary (a model's vocab is often padded beyond
    it) are shown as ``<id>`` instead of failing."""
    parts, run = [], []
    for i in ids:
        if 0 <= i < tokenizer.vocab_size:
            run.append(i)
            continue
        parts.append(tokenizer.decode(run) + f"<{i}>")
        run = []
    return "".join(parts) + tokenizer.decode(run)


class TokenizerBackend:
    """What both backends share: ``encode`` and ``decode`` around a backend's own
    ``_encode_ids`` (text -> ids, no bos/eos) and ``_decode_ids`` (checked ids -> text)."""

    path: Path | None
    _config: TokenizerConfig | None
    _bos: int  # each id -1 where the tokenizer has no such token
    _eos: int
    _unk: int
    _own_pad_id: int
    #: What the backend calls a vocabulary entry, in its error messages.
    ENTRY = "token"

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Text (TypeError if not a str) -> ids [T], bos / eos added on request (ValueError if
        the tokenizer has none); special-token strings become their ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = self._encode_ids(text)
        for wanted, name in ((add_bos, "bos"), (add_eos, "eos")):
            if wanted and getattr(self, f"{name}_id") < 0:
                raise ValueError(f"tokenizer {self.path} has no {name} {self.ENTRY}; cannot "
                                 f"add_{name}")
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id (1 in trained SentencePiece models), -1 if there is none."""
        return self._bos

    @property
    def eos_id(self) -> int:
        """End-of-sequence id (2 in trained SentencePiece models), -1 if there is none."""
        return self._eos

    @property
    def unk_id(self) -> int:
        """Unknown-token id (0 in trained SentencePiece models), -1 if there is none."""
        return self._unk

    @property
    def pad_id(self) -> int:
        """Id to pad with: the pad token (3 in trained SentencePiece models), else ``eos_id``,
        else ``unk_id``, else 0 (the Llama 2 tokenizer has no pad)."""
        return next((i for i in (self._own_pad_id, self.eos_id, self.unk_id) if i >= 0), 0)

    @property
    def fingerprint(self) -> str:
        """SHA-256 hex digest of the serialised model and the special tokens it encodes."""
        return self._fingerprint

    @property
    def config(self) -> TokenizerConfig | None:
        """The checkpoint's tokenizer settings, or None for a bare SentencePiece model."""
        return self._config

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's chat template source, if any."""
        return None if self._config is None else self._config.chat_template

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Decodes ids [T] to text; ValueError unless they are 1-D integers in ``[0, V)``."""
        array = as_id_array(ids)
        if array.size == 0:
            return ""
        check_ids(array, self.vocab_size)
        return self._decode_ids(array.tolist())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={str(self.path)!r}, vocab_size={self.vocab_size})"


def check_ids(array: np.ndarray, vocab_size: int) -> None:
    """Raises ValueError naming the first id outside ``[0, vocab_size)``."""
    bad = array[(array < 0) | (array >= vocab_size)]
    if bad.size:
        raise ValueError(f"token id {int(bad[0])} is outside [0, {vocab_size})")


def as_id_array(ids: Iterable[int] | np.ndarray) -> np.ndarray:
    """A 1-D integer array [T] of ``ids``; raises ValueError for other shapes or dtypes."""
    array = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
    if array.size == 0:
        return array.astype(np.int64).reshape(0)
    if array.ndim != 1:
        raise ValueError(f"decode expects a 1-D sequence of ids, got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"decode expects integer ids, got dtype {array.dtype}")
    return array


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(token: Any) -> str:
    """A token string from a config value: a str or an ``AddedToken`` dict with ``content``."""
    return str(token["content"] if isinstance(token, Mapping) else token)


def _optional_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


__all__ = ["CHAT_TEMPLATE_FILE", "CHAT_TEMPLATES_DIR", "CONFIG_FILE", "NAMED_SPECIAL_TOKENS",
           "SPECIAL_TOKENS_MAP_FILE", "TextTokenizer", "TokenizerBackend", "TokenizerConfig",
           "as_id_array", "check_ids"]
