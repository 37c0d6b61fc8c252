"""lm-eval benchmark: ``transformer-jax bench eval [--docs N] [--d-model D] ...``.

Times one multiple-choice task's loglikelihood requests through our ``JaxLM`` and lm-eval's own
``hf`` backend on one random Llama checkpoint, both float32 in one run; reports the seconds, the
largest log-likelihood difference and both accuracies. Needs the ``eval`` and ``hf`` extras.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax.bench import args as a

WORDS = ("the of and to in is was for on as with by at from his her they this that which "
         "time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city").split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_bpe(directory: Path, corpus: list[str], vocab_size: int, pad_to: int = 0) -> Any:
    """A byte-level BPE tokenizer of ``vocab_size`` trained on ``corpus`` (bos ``<s>``, eos
    ``</s>``; with ``pad_to``, padded with added tokens to that many), saved in ``directory``
    as an HF tokenizer; returns it."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([f"<x{i}>" for i in range(pad_to - tok.get_vocab_size())])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}))
    return tok


def write_checkpoint(directory: Path, args: argparse.Namespace, corpus: list[str]) -> None:
    """A random Llama (``save_pretrained``) and a BPE tokenizer trained on ``corpus``."""
    import torch
    import transformers

    tok = write_bpe(directory, corpus, args.vocab)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=args.d_model,
        intermediate_size=args.d_ff or 4 * args.d_model, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_len, tie_word_embeddings=False, initializer_range=0.1)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)


def check_model_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses (``parser.error``) a Llama shape ``write_checkpoint`` cannot build: heads that do
    not divide ``--d-model`` into even head sizes, kv heads that do not divide the heads."""
    if args.d_model % args.heads or args.d_model // args.heads % 2:
        parser.error(f"argument --heads: must divide --d-model ({args.d_model}) into heads of "
                     f"an even size (rotary embeddings), got {args.heads}")
    if args.heads % args.kv_heads:
        parser.error(f"argument --kv-heads: must divide --heads ({args.heads}), got "
                     f"{args.kv_heads}")


def main(argv: list[str]) -> int:
    p = a.parser("eval", __doc__)
    positive = a.positive_int
    p.add_argument("--docs", type=positive, default=200, help="questions (default: %(default)s)")
    p.add_argument("--choices", type=a.int_at_least(2), default=4, help="choices per question "
                   "(default: %(default)s)")
    p.add_argument("--d-model", type=positive, default=256, help="(default: %(default)s)")
    p.add_argument("--d-ff", type=a.nonnegative_int, default=0, help="(default: 4 x d-model)")
    p.add_argument("--layers", type=positive, default=4, help="(default: %(default)s)")
    p.add_argument("--heads", type=positive, default=8, help="(default: %(default)s)")
    p.add_argument("--kv-heads", type=positive, default=4, help="(default: %(default)s)")
    p.add_argument("--vocab", type=positive, default=2000, help="BPE vocabulary "
                   "(default: %(default)s)")
    p.add_argument("--max-len", type=positive, default=512, help="the model's window "
                   "(default: %(default)s)")
    p.add_argument("--batch-size", type=positive, default=8, help="our packed rows per forward "
                   "and the hf backend's requests per batch (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    check_model_args(p, args)

    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from transformer_jax.evaluate.harness import JaxLM
    from transformer_jax.evaluate.local_tasks import write_multiple_choice_task

    rng = random.Random(0)
    records = [{"question": _text(rng, rng.randint(10, 150)),
                "choices": [_text(rng, rng.randint(1, 12)) for _ in range(args.choices)],
                "answer": rng.randrange(args.choices)} for _ in range(args.docs)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        corpus = [r["question"] + " " + " ".join(r["choices"]) for r in records]
        write_checkpoint(tmp_path / "ckpt", args, corpus)
        write_multiple_choice_task(tmp_path, "bench_mc", records)
        task = TaskManager(include_path=tmp, include_defaults=False).load(
            ["bench_mc"])["tasks"]["bench_mc"]
        task.build_all_requests(rank=0, world_size=1)
        requests = task.instances

        start = time.perf_counter()
        ours_lm = JaxLM(str(tmp_path / "ckpt"), batch_size=args.batch_size)
        ours_lm.loglikelihood(requests, disable_tqdm=True)
        ours_first = time.perf_counter() - start
        ours_warm, ours = a.timed(lambda: ours_lm.loglikelihood(requests, disable_tqdm=True))
        hf_seconds, theirs = a.timed(lambda: HFLM(
            pretrained=str(tmp_path / "ckpt"), device="cpu", batch_size=args.batch_size,
            dtype="float32").loglikelihood(requests, disable_tqdm=True))
        tokens = sum(len(ours_lm.tok_encode(r.args[0] + r.args[1])) for r in requests)

    diff = max(abs(a[0] - b[0]) for a, b in zip(ours, theirs, strict=True))

    def accuracy(scores: list[tuple[float, bool]]) -> float:
        by_doc: dict[int, list[float]] = {}
        for req, (lp, _) in zip(requests, scores, strict=True):
            by_doc.setdefault(req.doc_id, []).append(lp)
        return float(np.mean([int(np.argmax(v)) == records[d]["answer"]
                              for d, v in by_doc.items()]))

    result = {
        "requests": len(requests), "tokens": tokens,
        "model": {k: getattr(args, k) for k in ("d_model", "layers", "heads", "kv_heads",
                                                "max_len")},
        "vocab": ours_lm.config.vocab_size, "batch_size": args.batch_size,
        "ours_s": ours_first, "ours_warm_s": ours_warm, "hf_s": hf_seconds,
        "speedup": hf_seconds / ours_first, "speedup_warm": hf_seconds / ours_warm,
        "max_abs_diff": diff, "acc_ours": accuracy(ours), "acc_hf": accuracy(theirs),
        "torch_threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{len(requests)} loglikelihood requests ({tokens} tokens), Llama d_model "
          f"{args.d_model}, {args.layers} layers, vocab {result['vocab']}, float32, CPU")
    print(f"  transformer_jax JaxLM: {ours_first:.2f} s ({ours_warm:.2f} s compiled)")
    print(f"  lm-eval hf backend:    {hf_seconds:.2f} s")
    print(f"  speedup {result['speedup']:.2f}x ({result['speedup_warm']:.2f}x compiled); "
          f"max |dlogprob| {diff:.2e}; acc {result['acc_ours']:.3f} vs {result['acc_hf']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
