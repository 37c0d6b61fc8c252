"""A HF checkpoint's ``generation_config.json``: the ids generation stops at."""

from __future__ import annotations

from pathlib import Path

from transformer_jax.storage.files import read_json

FILE = "generation_config.json"


def generation_stop_ids(path: str | Path) -> tuple[int, ...]:
    """The ids a checkpoint's ``generation_config.json`` ends generation at: its
    ``eos_token_id``, an id or a list (Llama 3.1 lists ``<|eom_id|>`` and ``<|eot_id|>``
    besides ``<|end_of_text|>``); () without the file or the key.

    Raises:
      ValueError: the file is not JSON, or ``eos_token_id`` is not an id or a list of ids.
    """
    file = Path(path) / FILE
    if not file.is_file():
        return ()
    value = read_json(file, "generation config")
    eos = value.get("eos_token_id") if isinstance(value, dict) else None
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of them, got "
                         f"{eos!r}")
    return tuple(ids)
