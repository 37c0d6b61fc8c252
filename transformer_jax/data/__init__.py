"""Data: text -> tokens -> batches, deterministic in (seed, step): ``corpus`` + ``batches``
(text files), ``instruct`` (JSONL records), ``preference`` (pairs), ``eval_sets`` (held-out
sets), ``build`` (inputs -> ArrayRecord shards) and ``shards`` (shards -> batches, mixtures)."""

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
