"""``jax.export`` of the whole generate (prefill + decode loop), shape-polymorphic in B and T.

``decode.generate_padded`` with the config, ``max_new_tokens`` (N) and sampling settings fixed
and the parameters an argument (one artifact serves any weights of that config):

    (params, tokens [b, t] int32, lengths [b] int32, key_data [b, 2] uint32)
        -> (tokens [b, N] int32, logprobs [b, N] float32, num_tokens [b] int32)

with symbolic ``b`` and ``t`` under ``t + N <= max_seq_len``. A new (b, t) compiles for that
shape, so callers still pad t to a bucket (``ExportedGenerate.generate`` does). A saved file
holds a JSON header (config, N, settings) and the serialized ``Exported``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.decode import prompts as prompt_lib
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import abstract_params

logger = logging.getLogger(__name__)

_MAGIC = b"transformer_jax.export/1\n"


@dataclasses.dataclass(frozen=True)
class ExportedGenerate:
    """An exported generate function plus what is needed to call it correctly.

    Attributes:
      exported: the ``jax.export.Exported`` (symbolic dims b, t).
      config: the model config it was exported for.
      max_new_tokens: N, fixed at export.
      settings: the sampling settings, fixed at export.
    """

    exported: jax_export.Exported
    config: ModelConfig
    max_new_tokens: int
    settings: decode.SamplingSettings

    def __call__(self, params: decode.Params, tokens: Any, lengths: Any, key_data: Any
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Runs the exported program on padded arrays (see the module docstring for shapes).

        Raises:
          ValueError: if ``t + max_new_tokens > max_seq_len`` (the export's shape constraint) or
            a length is outside [1, t].
        """
        t = np.shape(tokens)[-1]
        if t + self.max_new_tokens > self.config.max_seq_len:
            raise ValueError(f"padded prompt length {t} + max_new_tokens {self.max_new_tokens} "
                             f"exceeds max_seq_len {self.config.max_seq_len}")
        lengths_np = np.asarray(lengths)
        if lengths_np.size and not ((lengths_np >= 1) & (lengths_np <= t)).all():
            raise ValueError(f"lengths must be in [1, {t}] (the padded length), got {lengths_np}")
        return self.exported.call(params, jnp.asarray(tokens, jnp.int32),
                                  jnp.asarray(lengths, jnp.int32),
                                  jnp.asarray(key_data, jnp.uint32))

    def generate(self, params: decode.Params, prompts: Sequence[Sequence[int]],
                 seed: int | Sequence[int] = 0) -> generation.GenerateResult:
        """Validates and pads ``prompts`` like ``generation.generate``, then runs the export.

        Args:
          params: parameters of ``config`` (the layout it was exported with).
          prompts: B non-empty lists of ids in [0, V).
          seed: an int or one int per prompt (see ``prompt_lib.sequence_keys``).

        Returns:
          A ``generation.GenerateResult``.
        """
        c, n = self.config, self.max_new_tokens
        arrays = prompt_lib.validate_prompts(prompts, c.vocab_size)
        prompt_lib.validate_capacity(c, [len(a) for a in arrays], n)
        longest = max(len(a) for a in arrays)
        t = max(longest, min(prompt_lib.prompt_bucket(longest), c.max_seq_len - n))
        tokens, lengths = prompt_lib.pad_prompts(arrays, t, self.settings.pad_id)
        keys = prompt_lib.sequence_keys(seed, len(arrays))
        out, logprobs, num = jax.device_get(self(params, tokens, lengths, keys))
        return generation.result_from_arrays(out, logprobs, num)

    def save(self, path: str | Path) -> None:
        """Writes the header and the serialized program to ``path``."""
        header = json.dumps({"config": self.config.to_dict(), "max_new_tokens": self.max_new_tokens,
                             "settings": dataclasses.asdict(self.settings)}).encode()
        payload = self.exported.serialize()
        with open(path, "wb") as f:
            f.write(_MAGIC + struct.pack("<Q", len(header)) + header + bytes(payload))

    @classmethod
    def load(cls, path: str | Path) -> ExportedGenerate:
        """Reads a file written by ``save``.

        Raises:
          FileNotFoundError: no such file.
          ValueError: the file is not an exported generate of this format.
        """
        data = Path(path).read_bytes()
        if not data.startswith(_MAGIC):
            raise ValueError(f"{path} is not a transformer_jax exported generate file")
        start = len(_MAGIC)
        (size,) = struct.unpack("<Q", data[start:start + 8])
        header = json.loads(data[start + 8:start + 8 + size])
        exported = jax_export.deserialize(bytearray(data[start + 8 + size:]))
        settings = header["settings"]
        settings["stop_tokens"] = tuple(settings["stop_tokens"])
        return cls(exported=exported, config=ModelConfig.from_dict(header["config"]),
                   max_new_tokens=header["max_new_tokens"],
                   settings=decode.SamplingSettings(**settings))


def export_generate(config: ModelConfig, *, max_new_tokens: int, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None,
                    min_p: float | None = None, stop_tokens: Sequence[int] = (),
                    pad_id: int = 0, platforms: Sequence[str] | None = None
                    ) -> ExportedGenerate:
    """Exports generate for ``config`` with symbolic batch and prompt-length dims.

    Args:
      config: the model config (its ``scan_layers`` decides the params layout expected).
      max_new_tokens: N, fixed in the program; must leave room: N < ``config.max_seq_len``.
      temperature, top_k, top_p, min_p, stop_tokens, pad_id: the sampling settings fixed in
        the program (as ``generation.generate`` takes them).
      platforms: platforms to export for (e.g. ``["cpu", "cuda"]``); default the current one.

    Returns:
      An ``ExportedGenerate``.

    Raises:
      ValueError: for bad settings or an N that leaves no room for a prompt.
    """
    settings = decode.SamplingSettings(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        stop_tokens=tuple(stop_tokens), pad_id=pad_id)
    settings.validate(config.vocab_size)
    if not prompt_lib.is_int(max_new_tokens) or not 0 < max_new_tokens < config.max_seq_len:
        raise ValueError(f"max_new_tokens must be an int in [1, max_seq_len={config.max_seq_len})"
                         f", got {max_new_tokens!r}")
    b, t = jax_export.symbolic_shape(
        "b, t", constraints=(f"t + {max_new_tokens} <= {config.max_seq_len}",))
    fn = jax.jit(functools.partial(decode.generate_padded, config,
                                   max_new_tokens=max_new_tokens, settings=settings))
    args = (abstract_params(config), jax.ShapeDtypeStruct((b, t), jnp.int32),
            jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b, 2), jnp.uint32))
    exported = jax_export.export(fn, platforms=platforms)(*args)
    logger.info("exported generate: in %s -> out %s", exported.in_avals[-3:], exported.out_avals)
    return ExportedGenerate(exported=exported, config=config, max_new_tokens=max_new_tokens,
                            settings=settings)


def load(path: str | Path) -> ExportedGenerate:
    """``ExportedGenerate.load``."""
    return ExportedGenerate.load(path)

