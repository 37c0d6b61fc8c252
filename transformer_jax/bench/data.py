"""Shard build throughput: tokens/s of ``transformer-jax data build`` with 1 and N
worker processes on one generated corpus, and the build's peak memory.

The corpus is the standard library's sources repeated into jsonl files up to ``--mb``.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformer_jax.bench import args as args_lib
from transformer_jax.data import corpus


def make_corpus(directory: Path, megabytes: float, files: int = 8) -> int:
    """Writes ``files`` jsonl files of standard-library sources, ``megabytes`` in all."""
    texts = [p.read_text(encoding="utf-8") for p in corpus.default_corpus()]
    target = int(megabytes * 2**20 / files)
    total = 0
    for i in range(files):
        size = 0
        with open(directory / f"part-{i:02d}.jsonl", "w") as f:
            k = i
            while size < target:
                line = json.dumps({"text": texts[k % len(texts)]}) + "\n"
                f.write(line)
                size += len(line)
                k += files
        total += size
    return total


def work_dir(text: str) -> str:
    """An argparse type: ``--dir``, a directory or a path where one can be made."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a directory")
    try:
        args_lib.check_output_file(path / "corpus" / "part-00.jsonl")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def main(argv: list[str] | None = None) -> int:
    parser = args_lib.parser("data", __doc__)
    parser.add_argument("--mb", type=args_lib.megabytes, default=200.0, help="corpus size in MB")
    parser.add_argument("--workers", type=args_lib.int_at_least(2), default=2,
                        help="the parallel build's workers (>= 2; 1 is always run)")
    parser.add_argument("--tokenizer", type=args_lib.existing_path, default=None,
                        help="tokenizer file/dir (default: a bpe of 4096 trained on the "
                        "default corpus)")
    parser.add_argument("--shard-mb", type=args_lib.megabytes, default=8.0)
    parser.add_argument("--dir", type=work_dir, default=None,
                        help="work directory, kept (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    if args.dir:
        return run(Path(args.dir).expanduser(), args)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as work:  # removed on any failure
        return run(Path(work), args)


def run(work: Path, args: argparse.Namespace) -> int:
    """Builds the corpus in ``work`` with 1 and ``args.workers`` workers; prints the rates."""
    (work / "corpus").mkdir(parents=True, exist_ok=True)
    size = make_corpus(work / "corpus", args.mb)
    tokenizer = args.tokenizer
    if not tokenizer:
        from transformer_jax.tokenizer import Tokenizer

        tok = Tokenizer.train_or_load(corpus.default_corpus(), Path("~/.cache/transformer_jax")
                                      .expanduser(), 4096, "bpe")
        tokenizer = str(tok.path)
    print(f"corpus: {size / 2**20:.0f} MB of jsonl in {work / 'corpus'}; tokenizer {tokenizer}")
    rates = {}
    for workers in (1, args.workers):
        out = work / f"out-{workers}"
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "transformer_jax.data", "build", "--input",
             str(work / "corpus"), "--out", str(out), "--tokenizer", tokenizer, "--workers",
             str(workers), "--shard-mb", str(args.shard_mb), "--no-progress"],
            capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        meta = json.loads((out / "metadata.json").read_text())
        tokens = meta["train_tokens"] + meta["val_tokens"]
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        rates[workers] = tokens / seconds
        print(f"workers {workers}: {tokens:,} tokens in {seconds:.1f} s = "
              f"{rates[workers]:,.0f} tokens/s ({size / 2**20 / seconds:.1f} MB/s); "
              f"{len(meta['shards'])} shards; peak MB so far {peak:.0f}")
    print(f"speed-up with {args.workers} workers: {rates[args.workers] / rates[1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
