"""A run's evaluation and samples: the validation loss, a sampled continuation of
``train.sample_prompt``, and the batching of evaluation."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from transformer_jax.data.eval_sets import EvalSet, evaluate_sets
from transformer_jax.model.config import ModelConfig
from transformer_jax.tokenizer import TextTokenizer
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.data import RunData
from transformer_jax.train.log import RunLog
from transformer_jax.train.step import Batch, Metrics, Params, ParamsLayout, TrainState


def evaluate(eval_step: Callable[[Params, Batch], Metrics], params: Params,
             batches: Iterator[dict[str, np.ndarray]]) -> float:
    """Mean cross-entropy over all target tokens of ``batches`` (nats per token)."""
    loss_sum = tokens = 0.0
    for batch in batches:
        # One batch in flight at a time: queueing them all makes XLA:CPU's multi-device
        # collectives wait on each other until its rendezvous times out (seen with 2 devices).
        sums = jax.device_get(eval_step(params, batch))
        loss_sum += float(sums["loss_sum"])
        tokens += float(sums["tokens"])
    return loss_sum / max(tokens, 1.0)


def sample_text(model_config: ModelConfig, params: Params, tokenizer: TextTokenizer, prompt: str,
                max_new_tokens: int, temperature: float, seed: int) -> str:
    """Generates a continuation of ``prompt`` (KV-cached decode) and returns prompt + it."""
    from transformer_jax.decode.generation import generate

    ids = tokenizer.encode(prompt) or [max(tokenizer.bos_id, 0)]
    ids = ids[-(model_config.max_seq_len // 2):]
    max_new_tokens = min(max_new_tokens, model_config.max_seq_len - len(ids))
    if max_new_tokens <= 0:
        return prompt
    result = generate(model_config, params, [ids], max_new_tokens=max_new_tokens,
                      temperature=temperature, seed=seed)
    return tokenizer.decode(ids + list(result.tokens[0]))


def placing(step_fn: Callable[[Params, Batch], Metrics], place: Callable[[np.ndarray], Any]
             ) -> Callable[[Params, Batch], Metrics]:
    return lambda params, batch: step_fn(params, jax.tree.map(place, batch))


def evaluate_and_sample(state: TrainState, step: int, eval_step, data: RunData,
                         eval_kw: dict[str, Any], tokenizer: TextTokenizer,
                         model_config: ModelConfig, tc: TrainConfig, log: RunLog,
                         times: dict[str, float], eval_sets: Sequence[EvalSet] = ()
                         ) -> float | None:
    """The validation loss (None without a validation split; a mixture's weighted mean), each
    ``train.eval_sets`` set's loss and bits per byte, and a sample, all logged."""
    val_loss = None
    start = time.perf_counter()
    sources = {name: evaluate(eval_step, state.params, batches)  # a mixture's
               for name, batches in data.source_eval_batches(**eval_kw).items()}
    if sources:  # weights renormalised over the sources evaluated
        weights = dict(zip(data.shards.mixture.names, data.shards.mixture.weights, strict=True))
        val_loss = (sum(weights[name] * loss for name, loss in sources.items())
                    / sum(weights[name] for name in sources))
        log.record_eval(step, val_loss, of=f"the weighted mean over {len(sources)} sources")
    elif data.num_val_tokens:
        val_loss = evaluate(eval_step, state.params, data.eval_batches(**eval_kw))
        log.record_eval(step, val_loss)
    for name, loss in sources.items():
        log.record_source_eval(step, name, loss)
    scores = evaluate_sets(lambda batches: evaluate(eval_step, state.params, batches),
                           eval_sets, eval_kw)
    for name, (loss, bpb) in scores.items():
        log.record_eval_set(step, name, loss, bpb)
    times["eval"] += time.perf_counter() - start
    # The sample decodes on one host's devices, so it needs the params whole on each process.
    if tc.sample_tokens and jax.process_count() == 1:
        start = time.perf_counter()
        params = ParamsLayout.of(tc).model_params(state.params)  # LoRA: the adapted weights
        text = sample_text(model_config, params, tokenizer, tc.sample_prompt,
                           tc.sample_tokens, tc.sample_temperature, seed=step)
        log.record_sample(step, text)
        times["sample"] += time.perf_counter() - start
    return val_loss


#: Evaluation batches are up to this many micro-batches (forward only: no activations kept).
EVAL_BATCH_FACTOR = 4


def eval_batching(tc: TrainConfig, num_val_tokens: int) -> tuple[int, int | None]:
    """``(batch_size, max_batches)`` of evaluation: the windows of ``train.eval_batches``
    micro-batches, in batches of up to ``EVAL_BATCH_FACTOR`` micro-batches."""
    micro = tc.micro_batch_size
    for factor in range(EVAL_BATCH_FACTOR, 1, -1):
        fits = (num_val_tokens - 1) // tc.seq_len >= factor * micro
        if fits and (not tc.eval_batches or tc.eval_batches % factor == 0):
            return factor * micro, (tc.eval_batches // factor) or None
    return micro, tc.eval_batches or None
