"""Tokens (from ``data/corpus.py``) -> deterministic fixed-length batches: ``split`` into
train/val, random windows whose global batch is a pure function of (seed, step)
(``get_batch`` / ``Batches``), and ``eval_batches`` over the validation tokens in order.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterator

import numpy as np

#: A batch on the host: numpy arrays by name (``inputs``, ``targets`` ...), before placement.
HostBatch = dict[str, np.ndarray]


def split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Splits tokens [N] into views ``(train [N - M], val [M])``, ``M = int(N val_fraction)``;
    ValueError for ``val_fraction`` outside ``[0, 1)`` or an unwanted empty part."""
    tokens = _check_tokens(tokens)
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    num_val = int(len(tokens) * val_fraction)
    if val_fraction > 0 and num_val == 0:
        raise ValueError(f"val_fraction={val_fraction} of {len(tokens)} tokens leaves no "
                         "validation tokens")
    if num_val == len(tokens):
        raise ValueError(f"val_fraction={val_fraction} of {len(tokens)} tokens leaves no train "
                         "tokens")
    cut = len(tokens) - num_val
    return tokens[:cut], tokens[cut:]


def batch_offsets(seed: int, step: int, batch_size: int, num_tokens: int, seq_len: int
                  ) -> np.ndarray:
    """Start offsets [B] int64, each in ``[0, N - T - 1]``, of the windows (T + 1 tokens of
    N) of the global batch of B rows for (seed, step); ValueError on bad arguments."""
    seed, step = check_non_negative("seed", seed), check_non_negative("step", step)
    _check_batch_args(num_tokens, batch_size, seq_len, process_index=0, process_count=1)
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, num_tokens - seq_len, size=batch_size, dtype=np.int64)


def get_batch(tokens: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int, *,
              process_index: int = 0, process_count: int = 1) -> HostBatch:
    """This process's rows ``[p B / P, (p + 1) B / P)`` of the global batch for (seed, step):
    ``{"inputs", "targets"}`` [B / P, T] int32, random windows of T + 1 tokens [N] (T < N).

    Raises:
      ValueError: On a non-1-D token array, ``seq_len >= N``, indivisible ``batch_size`` or an
        out-of-range ``process_index``.
    """
    tokens = _check_tokens(tokens)
    local = _check_batch_args(len(tokens), batch_size, seq_len, process_index, process_count)
    offsets = batch_offsets(seed, step, batch_size, len(tokens), seq_len)
    mine = offsets[process_index * local : (process_index + 1) * local]
    return _windows(tokens, mine, seq_len)


class StepBatches:
    """What every batch source shares: ``get(step)``, this process's rows ``[p B / P, (p + 1)
    B / P)`` of the global batch, is a pure function of (seed, step), so a resume sees the same."""

    batch_size: int
    seed: int
    process_index: int
    process_count: int

    def get(self, step: int) -> HostBatch:
        raise NotImplementedError

    def iterate(self, start_step: int = 0) -> Iterator[HostBatch]:
        """Yields ``get(step)`` for ``step = start_step, start_step + 1, ...`` without end."""
        step = check_non_negative("start_step", start_step)
        while True:
            yield self.get(step)
            step += 1

    def _check_split(self) -> int:
        """Validates the seed and the split over processes; returns B / P."""
        check_non_negative("seed", self.seed)
        return check_split(self.batch_size, self.process_index, self.process_count)

    def _mine(self, rows: np.ndarray) -> np.ndarray:
        """This process's share of the global batch's [B] rows (or offsets)."""
        local = self.batch_size // self.process_count
        return rows[self.process_index * local : (self.process_index + 1) * local]


@dataclasses.dataclass(frozen=True, eq=False)
class Batches(StepBatches):
    """``get_batch`` with its fixed arguments bound (tokens [N], global batch size B, window
    length T, seed, process p of P); validated once at construction."""

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int = 0
    process_index: int = 0
    process_count: int = 1

    def __post_init__(self) -> None:
        _check_tokens(self.tokens)
        self._check_split()
        _check_batch_args(len(self.tokens), self.batch_size, self.seq_len, self.process_index,
                          self.process_count)

    def get(self, step: int) -> HostBatch:
        """The batch for ``step``: ``{"inputs", "targets"}``, each [B / P, T] int32."""
        return get_batch(self.tokens, self.seed, step, self.batch_size, self.seq_len,
                         process_index=self.process_index, process_count=self.process_count)


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int,
                 max_batches: int | None = None, *, process_index: int = 0,
                 process_count: int = 1) -> Iterator[HostBatch]:
    """Sequential eval batches over tokens [N]: ``{"inputs", "targets"}`` [B / P, T] int32 of
    window ``w`` = tokens ``[w T, w T + T]``, split as by ``eval_row_batches`` (a last
    incomplete batch dropped); at most ``max_batches`` (None: all). Checked when called.

    Raises:
      ValueError: On bad arguments or when the tokens do not fill a single batch.
    """
    tokens = _check_tokens(tokens)
    local = _check_batch_args(len(tokens), batch_size, seq_len, process_index, process_count)
    if max_batches is not None and max_batches <= 0:
        raise ValueError(f"max_batches must be positive or None, got {max_batches!r}")
    num_batches = (len(tokens) - 1) // seq_len // batch_size
    if num_batches == 0:
        raise ValueError(f"{len(tokens)} tokens do not fill one eval batch of batch_size="
                         f"{batch_size} x seq_len={seq_len} (need at least "
                         f"{batch_size * seq_len + 1})")
    return eval_row_batches((len(tokens) - 1) // seq_len, batch_size, max_batches,
                            lambda rows: _windows(tokens, rows * seq_len, seq_len),
                            process_index, local)


def eval_row_batches(num_rows: int, batch_size: int, max_batches: int | None,
                     read: Callable[[np.ndarray], HostBatch], process_index: int, local: int,
                     pad: bool = False) -> Iterator[HostBatch]:
    """Every one of ``num_rows`` rows once, in order: global batch ``i`` is rows ``i B ..
    i B + B - 1``, this process's ``local`` = B / P of them read by ``read(row indices)``; at
    most ``max_batches`` (None or 0: all). A last incomplete batch is dropped, or with ``pad``
    filled with copies of row 0 of zero ``mask`` (every batch then has a ``mask``)."""
    count = -(-num_rows // batch_size) if pad else num_rows // batch_size
    if max_batches:
        count = min(count, max_batches)
    for i in range(count):
        index = i * batch_size + process_index * local + np.arange(local, dtype=np.int64)
        real = index < num_rows
        batch = read(np.where(real, index, 0))
        if pad:
            mask = batch.get("mask", np.ones(batch["targets"].shape, np.float32))
            batch["mask"] = mask * real[:, None]
        yield batch


def _windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> HostBatch:
    index = offsets[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None, :]
    windows = np.asarray(tokens)[index].astype(np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def _check_tokens(tokens: np.ndarray) -> np.ndarray:
    tokens = np.asarray(tokens) if not isinstance(tokens, np.ndarray) else tokens
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must have an integer dtype, got {tokens.dtype}")
    return tokens


def check_non_negative(name: str, value: int) -> int:
    """``value`` as an int, or ValueError naming it when it is not a non-negative int."""
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")
    return value


def _check_batch_args(num_tokens: int, batch_size: int, seq_len: int, process_index: int,
                      process_count: int) -> int:
    """Validates batching arguments; returns the per-process batch size B / P."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if seq_len >= num_tokens:
        raise ValueError(f"seq_len={seq_len} must be smaller than the number of tokens "
                         f"({num_tokens})")
    return check_split(batch_size, process_index, process_count)


def check_split(batch_size: int, process_index: int, process_count: int) -> int:
    """Validates a global batch split over processes; returns the per-process size B / P."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if process_count <= 0:
        raise ValueError(f"process_count must be positive, got {process_count}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is outside [0, {process_count})")
    if batch_size % process_count:
        raise ValueError(f"batch_size={batch_size} is not divisible by process_count="
                         f"{process_count}")
    return batch_size // process_count


__all__ = ["StepBatches", "HostBatch", "Batches", "batch_offsets", "eval_batches", "get_batch",
           "split"]
