"""The arguments of ``bench decode`` (``decode.py``): parsed and checked before any weights are
made or devices configured, each bad value one argparse error line (``bench/args.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from transformer_jax.bench import args as a
from transformer_jax.model.config import ModelConfig, load_toml


def build_parser(description: str) -> argparse.ArgumentParser:
    """The benchmark's arguments, each checked by its type."""
    parser = a.parser("decode", description)
    parser.add_argument("--config", type=a.model_config, default="decode_25m",
                        help="preset name or TOML path")
    parser.add_argument("--batch", type=a.int_list(1), default=[1, 8])
    parser.add_argument("--prompt-len", type=a.int_list(1), default=[16, 512])
    parser.add_argument("--new-tokens", type=a.int_list(1), default=[128])
    parser.add_argument("--cache-size", type=a.int_list(0), default=[0],
                        help="KV cache slots S_max; 0 = generate's default (padded prompt + new "
                        "tokens, as tight as the request allows)")
    parser.add_argument("--tensor", type=a.int_list(0), default=[0],
                        help="tensor-parallel sizes to run (decode.generate's mesh); 0 = one "
                        "device per CPU core, 1 = a single device")
    parser.add_argument("--cache-dtype", default=None, choices=("float32", "bfloat16", "int8"),
                        help="KV cache storage dtype (default: the model's compute dtype)")
    parser.add_argument("--quant", type=a.quant_scheme, default=None, metavar="SCHEME",
                        help="also run every point with the weights quantised (decode.prepare's "
                        "quant: int8, int4, int4:G) and compare it with the float run")
    parser.add_argument("--peak-gb-s", type=a.positive_float(), default=None,
                        help="the device's peak memory bandwidth in GB/s (default: the published "
                        "figure for known GPUs/TPUs; none on CPU)")
    parser.add_argument("--repeats", type=a.positive_int, default=3)
    parser.add_argument("--no-hf", action="store_true", help="skip HuggingFace transformers")
    parser.add_argument("--no-baseline", action="store_true", help="skip the no-cache baseline")
    parser.add_argument("--out", "--json", type=a.output_file, default=None,
                        help="JSON file (default bench_decode_NAME.json)")
    parser.add_argument("--compile-time", action="store_true",
                        help="only time lowering + compiling generate at --layers depths "
                        "(bfloat16, B=1, prompt 128, 64 new tokens); write {compile_s, ratio}")
    parser.add_argument("--layers", type=a.int_list(1), default=[4, 32],
                        help="depths for --compile-time (default 4,32; ratio: last / first)")
    return parser


def parse(argv: list[str], description: str) -> tuple[argparse.Namespace, ModelConfig]:
    """The arguments (``out`` filled in) and the model config, or an argparse error (exit 2)."""
    parser = build_parser(description)
    args = parser.parse_args(argv)
    config = ModelConfig.from_dict(load_toml(args.config)["model"])  # checked by its type
    kind = "compile" if args.compile_time else "decode"
    a.default_output(parser, args, f"bench_{kind}_{Path(args.config).stem}.json")
    if args.compile_time:
        return args, config
    # Every grid point must be one a generate call can run.
    longest = max(args.prompt_len) + max(args.new_tokens)
    if longest > config.max_seq_len:
        parser.error(f"--prompt-len {max(args.prompt_len)} + --new-tokens {max(args.new_tokens)} = "
                     f"{longest} exceeds the model's max_seq_len {config.max_seq_len}")
    for size in args.cache_size:
        if size and size < longest:
            parser.error(f"--cache-size {size} is smaller than --prompt-len + --new-tokens = "
                         f"{longest}")
    return args, config
