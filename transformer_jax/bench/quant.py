"""Quantisation quality benchmark: ``transformer-jax bench quant --run RUN_DIR``.

For a trained run, the held-out loss with float, int8 and int4 weights and with an int8 KV
cache, the greedy continuations' agreement with float's (also each token judged on float's
prefix), and the bytes of each. Prints a table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.bench import args as args_lib
from transformer_jax.checkpoint import loading
from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.model.kv_cache import KVCache, cache_bytes
from transformer_jax.train.config import DataConfig, config_from_dict
from transformer_jax.train.data import prepare_data


def held_out_windows(run_dir: Path, loaded: loading.Loaded, length: int, most: int) -> np.ndarray:
    """Up to ``most`` non-overlapping [length] windows of the run's validation split."""
    data = json.loads((run_dir / "config.json").read_text())["data"]
    _, _, val = prepare_data(config_from_dict(DataConfig, data, "data"),
                             loaded.config.vocab_size, tokenizer=loaded.tokenizer)
    n = min(most, len(val) // length)
    return np.asarray(val[:n * length], np.int32).reshape(n, length)


def mean_loss(weights: decode.DecodeWeights, windows: np.ndarray, batch: int,
              cache_dtype: str | None) -> float:
    """Mean next-token cross-entropy (nats) over the windows, through the decode forward."""
    config = weights.config
    model = decode.decode_model(config)

    @jax.jit
    def loss(params: Any, tokens: jax.Array) -> jax.Array:
        cache = None if cache_dtype is None else KVCache.init(
            config, tokens.shape[0], tokens.shape[1], cache_dtype)
        logits = model.apply({"params": params}, tokens, cache=cache).logits[:, :-1]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).sum()

    total = sum(float(loss(weights.params, windows[i:i + batch]))
                for i in range(0, len(windows) - batch + 1, batch))
    used = (len(windows) // batch) * batch
    return total / (used * (windows.shape[1] - 1))


def forced_agreement(weights: decode.DecodeWeights, prompts: list[list[int]],
                     reference: np.ndarray) -> float:
    """The fraction of the reference tokens ([B, N], float's greedy continuation) that are also
    these weights' argmax given the prompt and the reference tokens before them."""
    model = decode.decode_model(weights.config)
    tokens = np.concatenate([np.asarray(prompts, np.int32), reference[:, :-1]], axis=1)
    logits = jax.jit(lambda p, t: model.apply({"params": p}, t).logits)(weights.params, tokens)
    start = len(prompts[0]) - 1  # the logits at position i predict token i + 1
    return float(np.mean(np.asarray(jnp.argmax(logits[:, start:], axis=-1)) == reference))


def training_run(text: str) -> str:
    """An argparse type: a training run's directory (with its ``config.json``)."""
    args_lib.existing_dir(text)
    if not (Path(text).expanduser() / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a training run (no config.json)")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = args_lib.parser("quant", __doc__)
    parser.add_argument("--run", type=training_run, required=True, help="a training run directory")
    parser.add_argument("--quant", type=args_lib.quant_schemes, default=["int8", "int4"],
                        help="comma-separated weight schemes (decode.prepare's quant) "
                        "(default: int8,int4)")
    parser.add_argument("--windows", type=args_lib.positive_int, default=1024,
                        help="the most held-out windows the loss runs over")
    parser.add_argument("--batch", type=args_lib.positive_int, default=32)
    parser.add_argument("--prompts", type=args_lib.positive_int, default=32,
                        help="held-out greedy prompts")
    parser.add_argument("--prompt-len", type=args_lib.positive_int, default=32)
    parser.add_argument("--new-tokens", type=args_lib.positive_int, default=64,
                        help="tokens per continuation (capped at max_seq_len - prompt-len)")
    parser.add_argument("--out", type=args_lib.output_file, default=None,
                        help="JSON file (default bench_quant_RUN.json)")
    args = parser.parse_args(argv)
    args_lib.default_output(parser, args, f"bench_quant_{Path(args.run).name}.json")

    run_dir = Path(args.run).expanduser()
    loaded = loading.load(run_dir)
    config, params = loaded.config, loaded.params
    if args.prompt_len >= config.max_seq_len:
        parser.error(f"--prompt-len {args.prompt_len} leaves no room for a new token in the "
                     f"model's max_seq_len {config.max_seq_len}")
    windows = held_out_windows(run_dir, loaded, config.max_seq_len, args.windows)
    if len(windows) < args.batch:
        parser.error(f"--batch {args.batch}: the run's validation split has only {len(windows)} "
                     f"windows of {config.max_seq_len} tokens; give a smaller --batch")
    new_tokens = min(args.new_tokens, config.max_seq_len - args.prompt_len)
    prompts = windows[-args.prompts:, :args.prompt_len].tolist()
    print(f"quantisation quality: {run_dir} step {loaded.step}, {config.dtype}, "
          f"{len(windows)} held-out windows of {config.max_seq_len} tokens; greedy: "
          f"{len(prompts)} prompts of {args.prompt_len} x {new_tokens} new tokens")

    float_weights = decode.prepare(config, params)
    variants: dict[str, tuple[decode.DecodeWeights, str | None]] = {
        "float": (float_weights, None),
        **{s: (decode.prepare(config, params, quant=s), None) for s in args.quant},
        "int8 cache": (float_weights, "int8")}
    rows, reference = {}, None
    for name, (weights, cache_dtype) in variants.items():
        start = time.perf_counter()
        loss = mean_loss(weights, windows, args.batch, cache_dtype)
        out = generation.generate(config, weights, prompts, max_new_tokens=new_tokens,
                                  cache_dtype=cache_dtype).token_array
        reference = out if reference is None else reference
        cache_ratio = (cache_bytes(config, 1, config.max_seq_len, cache_dtype)
                       / cache_bytes(config, 1, config.max_seq_len, "bfloat16")
                       if cache_dtype else None)
        forced = forced_agreement(weights, prompts, reference) if cache_dtype is None else None
        rows[name] = dict(loss=loss, greedy_agreement=float(np.mean(out == reference)),
                          forced_agreement=forced, weight_bytes=weights.nbytes,
                          weight_bytes_vs_float32=weights.nbytes / float_weights.nbytes,
                          cache_bytes_vs_bfloat16=cache_ratio, seconds=time.perf_counter() - start)
    float_loss = rows["float"]["loss"]
    for name, r in rows.items():
        r["loss_increase"] = r["loss"] / float_loss - 1
        size = (f"cache {r['cache_bytes_vs_bfloat16']:.3f}x bfloat16"
                if r["cache_bytes_vs_bfloat16"] else
                f"weights {r['weight_bytes'] / 1e6:.2f} MB = {r['weight_bytes_vs_float32']:.3f}x")
        forced = ("" if r["forced_agreement"] is None else
                  f" (each token on float's prefix: {r['forced_agreement']:.1%})")
        print(f"  {name:>10}: loss {r['loss']:.4f} ({r['loss_increase']:+.2%}), greedy agreement "
              f"{r['greedy_agreement']:.1%}{forced}, {size}")
    args_lib.write_json(args.out, dict(run=str(run_dir), step=loaded.step, windows=len(windows),
                                       prompts=len(prompts), prompt_len=args.prompt_len,
                                       new_tokens=new_tokens, results=rows))
    print(f"wrote {args.out}")
    return 0
