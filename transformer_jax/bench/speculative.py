"""Speculative decoding benchmark: ``transformer-jax bench speculative --checkpoint RUN``.

Runs the same requests at batch 1 through ``generate`` without speculation, with the n-gram
proposer and with a draft model (``--draft RUN``), each request in every mode in turn, and
prints output tokens/s, the ratios to the plain decode and the acceptance; every mode gives the
same (greedy) tokens. Workloads: ``repeat`` (a passage, a blank line, then the passage again
with one token changed, cut ``--lead`` tokens in: the model mostly copies) and ``free``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax.bench import args as args_lib


def repeat_workload(ids: np.ndarray, count: int, passage: int, lead: int, rng: Any,
                    sep: list[int]) -> list[list[int]]:
    """``count`` prompts: a passage, ``sep``, then the passage again with one of its first ``lead``
    tokens changed, cut after ``lead`` tokens (the model goes on, mostly copying, as in an edit)."""
    out = []
    vocab = np.unique(ids)
    for _ in range(count):
        start = int(rng.integers(0, len(ids) - passage))
        text = ids[start:start + passage].tolist()
        copy = text[:lead]
        spot = int(rng.integers(0, lead))
        copy[spot] = int(rng.choice(vocab[vocab != copy[spot]]))
        out.append(text + sep + copy)
    return out


def workload_prompts(workload: str, ids: np.ndarray, count: int, passage: int, lead: int,
                     rng: Any, sep: list[int], bos: int | None = None) -> list[list[int]]:
    """``count`` prompts of ``workload`` (``repeat_workload`` or ``free_workload``), each with
    ``bos`` first when given (as ``generate`` encodes a text prompt for such a tokenizer)."""
    if workload == "repeat":
        prompts = repeat_workload(ids, count, passage, lead, rng, sep)
    else:
        prompts = free_workload(ids, count, passage, rng)
    return prompts if bos is None else [[bos, *p] for p in prompts]


def free_workload(ids: np.ndarray, count: int, passage: int, rng: Any) -> list[list[int]]:
    """``count`` passages of the text to continue."""
    starts = rng.integers(0, len(ids) - passage, count)
    return [ids[s:s + passage].tolist() for s in starts]


def _passage(text: str, alphabet: list[str], lengths: tuple[int, int], random_share: float,
             rng: Any) -> str:
    """A passage of ``lengths[0]`` to ``lengths[1] - 1`` characters: with probability
    ``random_share`` random characters of ``alphabet``, else cut from ``text``."""
    p = int(rng.integers(*lengths))
    if rng.random() < random_share:
        return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), p))
    s = int(rng.integers(0, len(text) - p))
    return text[s:s + p]


def copy_corpus(text: str, size: int, rng: Any, random_share: float = 0.33,
                lengths: tuple[int, int] = (24, 200), plain: int = 200, edits: bool = True,
                lines: bool = False) -> str:
    """A training text in which copying an input is most of what there is to learn (for a target
    and a draft that continue the repeat workload by copying, as LLMs do on edits).

    Blocks until ``size`` characters (a block's separators counted as 6): up to ``plain`` - 1
    characters of ``text``, a blank line, a passage (``_passage``), a blank line, the passage again
    with 0, 1 or 2 characters changed (40/40/20%; none without ``edits``), a blank line; with
    ``lines``, the passage and its copy on two lines instead (docs/benchmarks.md).
    """
    alphabet = sorted(set(text) - {"\n"})
    out, n, total = [], len(text), 0
    while total < size:
        cut = int(rng.integers(0, plain)) if plain else 0
        s = int(rng.integers(0, n - cut))
        out.append(text[s:s + cut])
        passage = _passage(text, alphabet, lengths, random_share, rng)
        p = len(passage)
        copy = list(passage)
        for _ in range(int(rng.choice(3, p=[0.4, 0.4, 0.2])) if edits else 0):
            i = int(rng.integers(0, p))
            copy[i] = alphabet[int(rng.integers(0, len(alphabet)))]
        if lines:
            out.append(passage + "\n" + "".join(copy) + "\n")
        else:
            out.append("\n\n" + passage + "\n\n" + "".join(copy) + "\n\n")
        total += cut + 2 * p + 6
    return "".join(out)


def copy_records(text: str, count: int, rng: Any, random_share: float = 0.5,
                 lengths: tuple[int, int] = (16, 200), lead: int = 16, edits: bool = True
                 ) -> list[dict[str, str]]:
    """``count`` instruction records of the repeat workload's task, for supervised fine-tuning: the
    prompt is a passage (``lengths`` and ``random_share`` as ``copy_corpus``'s), a blank line, and
    its first 1 to ``lead`` characters again, one of them changed (none without ``edits``); the
    completion, the rest of the passage, holds no edit, so all of it is learnable by copying."""
    alphabet = sorted(set(text) - {"\n"})
    records = []
    for _ in range(count):
        passage = _passage(text, alphabet, lengths, random_share, rng)
        cut = int(rng.integers(1, min(lead, len(passage) - 1) + 1))
        head = list(passage[:cut])
        if edits:
            i = int(rng.integers(0, cut))
            head[i] = alphabet[int(rng.choice([j for j, c in enumerate(alphabet) if c != head[i]]))]
        records.append({"prompt": passage + "\n\n" + "".join(head), "completion": passage[cut:]})
    return records


def distill_records(config: Any, weights: Any, tokenizer: Any, ids: np.ndarray, count: int,
                    rng: Any, lengths: tuple[int, int] = (32, 161), lead: int = 8,
                    output: int = 128, batch: int = 64) -> Iterator[dict[str, str]]:
    """``count`` instruction records whose completions are the target's own greedy outputs, to
    fine-tune a draft on (sequence-level distillation, as EAGLE and Medusa drafts are trained).

    Half the prompts are the repeat workload's, half the free one's, passages of ``lengths[0]`` to
    ``lengths[1] - 1`` tokens; ``output`` greedy tokens each, ``batch`` prompts a call, ending
    before the first special token. ``tokenizer`` must round-trip text (else a ValueError).
    """
    from transformer_jax.decode import generation
    from transformer_jax.tokenizer.prompt import adds_bos

    sep = tokenizer.encode("\n\n")
    prompts = []
    for _ in range(count):
        passage = int(rng.integers(*lengths))
        prompts += workload_prompts("repeat" if rng.random() < 0.5 else "free", ids, 1, passage,
                                    min(lead, passage), rng, sep)
    for p in prompts:  # checked before any generation
        _check_round_trip(tokenizer, p)
    bos = [tokenizer.bos_id] if adds_bos(tokenizer) else []
    specials = {t for t in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id,
                            getattr(tokenizer, "unk_id", -1)) if t >= 0}
    cut = 0
    for i in range(0, count, batch):
        chunk = prompts[i:i + batch]
        out = generation.generate(config, weights, [bos + p for p in chunk],
                                  max_new_tokens=output, stop_tokens=sorted(specials))
        for p, o in zip(chunk, out.tokens, strict=True):
            # A text record ends where the target stopped (eos: fine-tuning appends it
            # again) or emitted another special token, which no text spells.
            if o and o[-1] in specials:
                cut += o[-1] != tokenizer.eos_id
                o = o[:-1]
            yield {"prompt": tokenizer.decode(p), "completion": _check_round_trip(tokenizer, o)}
        logging.info("distill_records: %d of %d (%d cut at a special token other than eos)",
                     i + len(chunk), count, cut)


def _check_round_trip(tokenizer: Any, ids: list[int]) -> str:
    """``ids`` as text, or a ValueError if that text does not encode back to them."""
    text = tokenizer.decode(ids)
    if tokenizer.encode(text) != ids:
        raise ValueError("distill_records needs a tokenizer whose text round-trips (decode "
                         f"then encode gives the same ids); {text!r} does not")
    return text


def _passages(given: list[int], minimum: int, available: int, flag: str, unit: str
              ) -> tuple[int, int]:
    """``--copy-passage MIN,MAX`` checked for ``flag`` against a text of ``available`` units."""
    low, high = given
    if low < minimum or high <= low:
        raise SystemExit(f"--copy-passage {low},{high}: {flag} needs {minimum} <= MIN < MAX")
    if available < high:  # a passage of high - 1 needs a start in [0, available - high + 1)
        raise SystemExit(f"--text has {available:,} {unit}, too few for passages of up to "
                         f"{high - 1} (--copy-passage {low},{high})")
    return low, high


def _write_jsonl(path: str, records: Any) -> None:
    """Writes ``records`` one JSON object a line as they come, and says how many."""
    written = 0
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
            written += 1
    print(f"wrote {written:,} records to {path}")


def describe(config: Any, params: Any) -> str:
    """A model's shape in a few words: layers, widths, heads, parameters."""
    import jax

    count = sum(x.size for x in jax.tree.leaves(params))
    return (f"{config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads "
            f"({config.n_kv_heads or config.n_heads} kv), FFN {config.d_ff}, "
            f"{count / 1e6:.1f}M parameters")


#: The decoding modes the benchmark compares.
MODES = ("plain", "ngram", "draft")


def mode_list(text: str) -> list[str]:
    """A type: comma-separated ``MODES``, each once (at least one)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names or set(names) - set(MODES) or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"must be comma-separated modes among "
                                         f"{', '.join(MODES)}, each once, got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    a = args_lib
    p = a.parser("speculative", __doc__)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--checkpoint", type=a.checkpoint,
                        help="the target (a run or HF directory)")
    target.add_argument("--config", type=a.model_config, help="a target of this preset or "
                        "TOML with random weights (its outputs repeat: the loop's cost at an "
                        "acceptance near 1; random prompts)")
    p.add_argument("--draft", type=a.checkpoint,
                   help="a draft model's run or HF directory (the draft mode)")
    p.add_argument("--text", type=a.existing_file,
                   help="a text file the prompts are cut from (default: random ids)")
    p.add_argument("--workload", choices=("repeat", "free"), default="repeat")
    p.add_argument("--requests", type=a.positive_int, default=6)
    p.add_argument("--passage", type=a.positive_int, default=160)
    p.add_argument("--lead", type=a.positive_int, default=8)
    p.add_argument("--output", type=a.positive_int, default=128, help="new tokens per request")
    p.add_argument("--k", type=a.positive_int, default=4, help="tokens proposed per step")
    p.add_argument("--ngram-k", type=a.positive_int, default=None,
                   help="the n-gram mode's k (default: --k)")
    p.add_argument("--modes", type=mode_list, default=None, help="comma list of plain, ngram, "
                   "draft (default: plain,ngram, and draft with --draft)")
    p.add_argument("--seed", type=a.nonnegative_int, default=0)
    p.add_argument("--json", type=a.output_file, default=None)
    p.add_argument("--write-copy-corpus", metavar="FILE", type=a.output_file, default=None,
                   help="write a copy-dominated text from --text (copy_corpus) to FILE; exit")
    p.add_argument("--write-copy-sft", metavar="FILE", type=a.output_file, default=None,
                   help="write --copy-records records of the repeat workload's task from --text "
                   "(copy_records) to FILE (.jsonl); exit")
    p.add_argument("--copy-records", type=a.positive_int, default=50_000,
                   help="the number of records --write-copy-sft writes")
    p.add_argument("--copy-lead", type=a.positive_int, default=16,
                   help="--write-copy-sft's prompts end 1 to this many characters into the copy")
    p.add_argument("--write-distill-sft", metavar="FILE", type=a.output_file, default=None,
                   help="write --copy-records records of the --checkpoint target's greedy "
                   "outputs on prompts from --text (distill_records) to FILE (.jsonl); exit")
    p.add_argument("--copy-size", type=a.positive_int, default=6_000_000,
                   help="the corpus's size in characters (a block's separators counted as 6)")
    p.add_argument("--copy-random-share", type=float, default=0.33,
                   help="the share of the corpus's passages that are random characters")
    p.add_argument("--copy-passage", type=a.int_list(1), default=[24, 200], metavar="MIN,MAX",
                   help="the corpus's passage lengths, MIN to MAX - 1 characters")
    p.add_argument("--copy-plain", type=a.nonnegative_int, default=200,
                   help="at most this many characters of plain text before each block")
    p.add_argument("--copy-no-edits", action="store_true",
                   help="copy the corpus's passages exactly (no changed characters)")
    p.add_argument("--copy-lines", action="store_true",
                   help="blocks of a passage and its copy on two lines (no blank lines)")
    return p


def main(argv: list[str]) -> int:
    import jax

    from transformer_jax.checkpoint.loading import load
    from transformer_jax.decode import generation
    from transformer_jax.decode import loop as decode
    from transformer_jax.decode.speculative_loop import DraftModel
    from transformer_jax.model.config import ModelConfig
    from transformer_jax.model.transformer import init_params
    from transformer_jax.tokenizer.prompt import adds_bos

    parser = build_parser()
    args = parser.parse_args(argv)
    writer = next((f for f in ("copy_corpus", "copy_sft") if getattr(args, f"write_{f}")), None)
    if writer and not args.text:
        raise SystemExit(f"--write-{writer.replace('_', '-')} needs --text")
    text = Path(args.text).read_text() if writer else ""
    if args.write_copy_corpus:
        corpus = copy_corpus(text, args.copy_size, np.random.default_rng(args.seed),
                             args.copy_random_share, tuple(args.copy_passage), args.copy_plain,
                             not args.copy_no_edits, args.copy_lines)
        Path(args.write_copy_corpus).write_text(corpus)
        print(f"wrote {len(corpus):,} characters to {args.write_copy_corpus}")
        return 0
    if args.write_copy_sft:
        lengths = _passages(args.copy_passage, 3, len(text), "--write-copy-sft", "characters")
        _write_jsonl(args.write_copy_sft, copy_records(
            text, args.copy_records, np.random.default_rng(args.seed), args.copy_random_share,
            lengths, args.copy_lead, not args.copy_no_edits))
        return 0
    if args.write_distill_sft:
        if not (args.checkpoint and args.text):
            raise SystemExit("--write-distill-sft needs --checkpoint and --text")
        loaded = load(args.checkpoint)
        ids = np.asarray(loaded.tokenizer.encode(Path(args.text).read_text()), np.int64)
        lengths = _passages(args.copy_passage, 1, len(ids), "--write-distill-sft", "tokens")
        _write_jsonl(args.write_distill_sft, distill_records(
            loaded.config, decode.prepare(loaded.config, loaded.params), loaded.tokenizer, ids,
            args.copy_records, np.random.default_rng(args.seed), lengths, args.lead, args.output))
        return 0
    if not (args.checkpoint or args.config):
        parser.error("give the target: --checkpoint RUN or --config NAME")
    modes = args.modes or (["plain", "ngram", "draft"] if args.draft else ["plain", "ngram"])
    if "draft" in modes and not args.draft:
        parser.error("argument --modes: the draft mode needs --draft")
    if args.text and not args.checkpoint:
        parser.error("argument --text: needs the target's tokenizer: give --checkpoint")
    if args.workload == "repeat" and args.lead > args.passage:
        parser.error(f"argument --lead: must be at most --passage ({args.passage}), got "
                     f"{args.lead}")
    if args.checkpoint:
        loaded = load(args.checkpoint)
        config, params, tokenizer = loaded.config, loaded.params, loaded.tokenizer
    else:
        config, tokenizer = ModelConfig.preset(args.config), None
        params = init_params(config, jax.random.key(args.seed))
    weights = decode.prepare(config, params)
    draft = None
    if "draft" in modes:
        d = load(args.draft)
        draft = DraftModel(d.config, decode.prepare(d.config, d.params))
        draft.check_against(config)
    rng = np.random.default_rng(args.seed)
    sep: list[int] = []
    if args.text:
        if tokenizer is None:
            raise SystemExit("--text needs the checkpoint's tokenizer")
        ids = np.asarray(tokenizer.encode(Path(args.text).read_text()), np.int64)
        sep = tokenizer.encode("\n\n")
    else:
        ids = rng.integers(0, config.vocab_size, 100_000)
    bos = tokenizer is not None and adds_bos(tokenizer)  # as generate and fine-tuning encode
    prompts = workload_prompts(args.workload, ids, args.requests + 1, args.passage, args.lead,
                               rng, sep, tokenizer.bos_id if bos else None)
    specs = {"plain": None, "ngram": f"ngram:k={args.ngram_k or args.k}",
             "draft": f"draft:{args.draft}:k={args.k}"}
    tokens = dict.fromkeys(modes, 0)
    stats: dict[str, list[Any]] = {m: [] for m in modes}
    per_request: dict[str, list[float]] = {m: [] for m in modes}  # each request's seconds
    for i, prompt in enumerate(prompts):  # prompt 0 compiles every mode, untimed
        outs = {}
        for mode in modes:
            t = time.perf_counter()
            out = generation.generate(config, weights, [prompt], max_new_tokens=args.output,
                                      speculative=specs[mode], draft=draft)
            dt = time.perf_counter() - t
            outs[mode] = out.tokens[0]
            if i:
                per_request[mode].append(dt)
                tokens[mode] += out.lengths[0]
                if out.speculative:
                    stats[mode] += out.speculative
        if any(o != outs[modes[0]] for o in outs.values()):
            raise SystemExit(f"request {i}: the modes' tokens differ")
    target = args.checkpoint or f"random {args.config}"
    result: dict[str, Any] = {"checkpoint": target, "draft": args.draft,
                              "dtype": config.dtype, "backend": jax.default_backend(),
                              "args": vars(args), "modes": {}}
    print(f"{target} ({describe(config, weights.params)}, {config.dtype}, "
          f"{jax.default_backend()}), batch 1, {args.requests} requests, workload "
          f"{args.workload}: prompts of {len(prompts[0])} tokens, {args.output} new")
    if draft is not None:
        print(f"draft {args.draft} ({describe(draft.config, draft.weights.params)})")
    seconds = {mode: sum(per_request[mode], 0.0) for mode in modes}
    for mode in modes:
        r: dict[str, Any] = {"tokens": tokens[mode], "seconds": seconds[mode],
                             "tokens_per_s": tokens[mode] / seconds[mode]}
        line = f"{mode:<6} {r['tokens_per_s']:8.1f} tok/s"
        if mode != "plain" and "plain" in modes:
            r["ratio"] = r["tokens_per_s"] / (tokens["plain"] / seconds["plain"])
            r["median_request_ratio"] = float(np.median(
                np.asarray(per_request["plain"]) / np.asarray(per_request[mode])))
            line += (f"  {r['ratio']:.2f}x plain (median over requests "
                     f"{r['median_request_ratio']:.2f}x)")
        if stats[mode]:
            proposed = sum(s.proposed for s in stats[mode])
            accepted = sum(s.accepted for s in stats[mode])
            verifications = sum(s.verifications for s in stats[mode])
            r.update(acceptance_rate=accepted / max(proposed, 1),
                     mean_accepted_length=(accepted + verifications) / max(verifications, 1))
            line += (f"  acceptance {r['acceptance_rate']:.2f}, "
                     f"{r['mean_accepted_length']:.2f} tokens per verification")
        result["modes"][mode] = r
        print(line)
    args_lib.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
