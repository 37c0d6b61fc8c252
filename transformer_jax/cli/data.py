"""``transformer-jax data build --input ... --out DIR --tokenizer TOK``: inputs -> shards.

The shards are what ``data.path=DIR`` trains on (``transformer_jax.data.build``, ``.shards``).
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Sequence

from transformer_jax import storage
from transformer_jax.cli.common import PROG, fail
from transformer_jax.data import sources as sources_lib
from transformer_jax.data.build import BuildOptions, build, resolve_tokenizer


def _shard_mb(text: str) -> float:
    """``--shard-mb``: a finite number of MB above 0."""
    try:
        mb = float(text)
    except ValueError:
        mb = math.nan
    if not (math.isfinite(mb) and mb > 0 and math.isfinite(mb * 2**20)):
        raise argparse.ArgumentTypeError(f"must be a finite number of MB above 0, got {text!r}")
    return mb


def main(argv: Sequence[str] | None = None) -> int:
    """The ``build`` command line (see ``--help``)."""
    parser = argparse.ArgumentParser(prog=f"{PROG} data",
                                     description="Tokenize a corpus into shards for training "
                                                 "(data.path=OUT).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="inputs -> ArrayRecord shards + metadata.json")
    p.add_argument("--input", nargs="+", action="extend", required=True,
                   help="files, directories, globs, .jsonl, .parquet, or save_to_disk dirs")
    p.add_argument("--out", required=True, help="the build directory")
    p.add_argument("--tokenizer", required=True,
                   help="a tokenizer file/dir, or bpe|unigram|char to train on the text inputs")
    p.add_argument("--vocab-size", type=int, default=4096, help="of a trained tokenizer")
    p.add_argument("--cache-dir", default="~/.cache/transformer_jax",
                   help="where a trained tokenizer is cached")
    p.add_argument("--field", default="text", help="text field of jsonl/parquet/dataset rows")
    p.add_argument("--text-docs", choices=sources_lib.TEXT_DOCS, default="file",
                   help="a text file is one document, or one per blank-line paragraph")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="share of documents held out (by a hash of each document)")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument("--shard-mb", type=_shard_mb, default=64.0, help="input MB per shard (above 0)")
    p.add_argument("--bos", action="store_true", help="put bos before each document")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip (and name) a bad input file instead of failing")
    p.add_argument("--overwrite", action="store_true",
                   help="build into an --out that holds a finished build of other inputs or "
                        "options, or other files (only the build's own files are replaced)")
    p.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        options = BuildOptions(field=args.field, text_docs=args.text_docs,
                               val_fraction=args.val_fraction,
                               shard_bytes=max(1, round(args.shard_mb * 2**20)),
                               add_bos=args.bos, skip_bad=args.skip_bad)
        if args.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {args.workers}")
        tokenizer = resolve_tokenizer(args.tokenizer, args.input, args.vocab_size, args.cache_dir,
                                      exclude=() if storage.is_remote(args.out) else (args.out,))
        build(args.input, args.out, tokenizer, options=options, workers=args.workers,
              progress=not args.no_progress, overwrite=args.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        return fail(str(e))
    return 0
