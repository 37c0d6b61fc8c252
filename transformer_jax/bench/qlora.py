"""QLoRA on a HF checkpoint: the frozen base's bytes and the fine-tuning loss, against LoRA.

Fine-tunes a random Llama (or ``--hf DIR``) twice on one generated corpus, with a float32 base
and with ``train.lora_base_quant``. Needs the ``hf`` extra.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax.bench import args as a
from transformer_jax.bench.eval import check_model_args, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
#: The runs' learning-rate warmup steps.
WARMUP = 10


def corpus(path: Path, words: int, seed: int) -> list[str]:
    """Writes lines of phrases drawn from 60 fixed 8-word phrases; returns the lines."""
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(words)]
    phrases = [" ".join(rng.choice(vocab, 8)) for _ in range(60)]
    lines = [" ".join(rng.choice(phrases, 6)) for _ in range(3000)]
    path.write_text("\n".join(lines))
    return lines


def finetune_overrides(hf: Path, data: Path, run: Path, args: argparse.Namespace,
                       extra: list[str]) -> list[str]:
    """The ``finetune`` preset's overrides of one LoRA run."""
    return [f"train.init_from={hf}", f"data.path={data}", f"train.lora_rank={args.rank}",
            f"train.steps={args.steps}", f"train.seq_len={args.seq_len}",
            "train.batch_size=8", "train.grad_accum=1", f"train.lr={args.lr}",
            f"train.min_lr={args.lr / 10}", f"train.warmup_steps={WARMUP}",
            f"train.eval_every={args.steps // 2}", "train.eval_batches=4",
            f"train.ckpt_every={args.steps}", f"train.run_dir={run}", *extra]


def finetune(hf: Path, data: Path, run: Path, args: argparse.Namespace, extra: list[str]
             ) -> dict[str, Any]:
    """One LoRA run; its losses and the bytes of the base it saved."""
    import jax

    from transformer_jax.checkpoint.manager import CheckpointManager

    start = time.perf_counter()
    command = [sys.executable, str(ROOT / "train.py"), "--no-progress", "--config", "finetune",
               *finetune_overrides(hf, data, run, args, extra)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    with CheckpointManager(run / "checkpoints", read_only=True) as reader:
        params, _ = reader.restore_params(None)
    return {"first_train_loss": next(r["loss"] for r in rows if r.get("split") == "train"),
            "last_train_loss": [r["loss"] for r in rows if r.get("split") == "train"][-1],
            "val_loss": {r["step"]: r["loss"] for r in rows if r.get("split") == "val"},
            "base_bytes": sum(np.asarray(x).nbytes for x in jax.tree.leaves(params["base"])),
            "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    p = a.parser("qlora", __doc__)
    positive = a.positive_int
    p.add_argument("--hf", type=a.checkpoint, default=None,
                   help="an existing HF checkpoint (default: write one)")
    p.add_argument("--quant", type=a.quant_scheme, default="nf4",
                   help="train.lora_base_quant (int8, int4, nf4, int4:G, nf4:G)")
    p.add_argument("--d-model", type=positive, default=256)
    p.add_argument("--d-ff", type=positive, default=704)
    p.add_argument("--layers", type=positive, default=4)
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--kv-heads", type=positive, default=2)
    p.add_argument("--words", type=positive, default=400, help="distinct words of the corpus")
    p.add_argument("--vocab", type=positive, default=1000, help="the BPE tokenizer's vocabulary")
    p.add_argument("--rank", type=positive, default=8)
    p.add_argument("--steps", type=a.int_at_least(WARMUP + 1), default=200,
                   help=f"(more than the {WARMUP} warmup steps)")
    p.add_argument("--seq-len", type=positive, default=128)
    p.add_argument("--lr", type=a.positive_float(), default=3e-3)
    p.add_argument("--seed", type=a.nonnegative_int, default=0)
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--json", type=a.output_file, default=None,
                   help="write the results to this file")
    args = p.parse_args(argv)
    check_model_args(p, args)
    try:
        here = Path("unused")
        a.check_runs(*(("finetune", finetune_overrides(here, here, here, args, extra))
                       for extra in ([], [f"train.lora_base_quant={args.quant}"])))
    except ValueError as e:  # ConfigError: the setting named
        p.error(" ".join(str(e).split()))
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-qlora-"))
    work.mkdir(parents=True, exist_ok=True)
    hf = Path(args.hf) if args.hf else work / "hf"
    lines = corpus(work / "corpus.txt", args.words, args.seed)
    if not args.hf:  # bench eval's random Llama, with a BPE tokenizer trained on the corpus
        write_checkpoint(hf, argparse.Namespace(
            vocab=args.vocab, d_model=args.d_model, d_ff=args.d_ff, layers=args.layers,
            heads=args.heads, kv_heads=args.kv_heads, max_len=2 * args.seq_len), lines)
    from safetensors.numpy import load_file

    values = sum(v.size for f in sorted(hf.glob("*.safetensors")) for v in load_file(f).values())
    results: dict[str, Any] = {"hf": str(hf), "values": int(values), "bf16_bytes": 2 * values}
    for name, extra in (("lora", []), (f"qlora_{args.quant}",
                                       [f"train.lora_base_quant={args.quant}"])):
        r = finetune(hf, work / "corpus.txt", work / f"run_{name}", args, extra)
        r["base_vs_bf16"] = r["base_bytes"] / (2 * values)
        results[name] = r
        print(f"{name:12s} base {r['base_bytes'] / 1e6:7.2f} MB ({r['base_vs_bf16']:.3f}x its "
              f"bfloat16 size); train loss {r['first_train_loss']:.4f} -> "
              f"{r['last_train_loss']:.4f}; val {r['val_loss']}; {r['seconds']:.0f} s", flush=True)
    q = results[f"qlora_{args.quant}"]
    results["loss_ratio"] = q["last_train_loss"] / results["lora"]["last_train_loss"]
    print(f"final train loss {args.quant} / float base: {results['loss_ratio']:.4f}")
    a.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
