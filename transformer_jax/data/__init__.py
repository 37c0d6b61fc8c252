"""Data: text -> tokens -> batches, deterministic in (seed, step).

``corpus`` (files -> a cached flat token memmap), ``batches`` (train/val split and the batches
of one step, pure in the seed and step), ``data.instruct_records`` + ``instruct`` (JSONL prompt/
completion and chat records -> packed rows with loss masks), ``data.eval_sets`` (held-out sets ->
packed windows), ``sources`` + ``build`` (inputs -> ArrayRecord shards) and ``shards`` (shards
-> packed rows or windows, mixtures).
"""

from transformer_jax.data.batches import (
    Batches,
    HostBatch,
    StepBatches,
    batch_offsets,
    eval_batches,
    get_batch,
    split,
)

__all__ = ["Batches", "HostBatch", "StepBatches", "batch_offsets", "eval_batches", "get_batch",
           "split"]
