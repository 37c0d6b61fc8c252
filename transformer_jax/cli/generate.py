"""Command line generation: ``transformer-jax generate --checkpoint PATH --prompt TEXT``.

PATH is a HF checkpoint directory or a training run, read-only (``checkpoint.loading``). Text
is streamed as it is generated; ``--prompt-ids`` and ``--json`` are for scripts;
``--json-schema``, ``--json-object``, ``--regex`` and ``--choice`` hold every output to a
grammar (``serving.grammar``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax.checkpoint import loading
from transformer_jax.checkpoint.files import CheckpointError
from transformer_jax.cli.common import PROG, fail
from transformer_jax.decode import generation
from transformer_jax.hf.generation_config import generation_stop_ids
from transformer_jax.model.quant_spec import parse_quant
from transformer_jax.parallel import sharding
from transformer_jax.tokenizer import detokenize
from transformer_jax.tokenizer.prompt import chat_turn_end_id, encode_chat_prompt, encode_text


def _ids(text: str) -> list[int]:
    parts = text.replace(" ", "").split(",")
    try:
        return [int(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expects comma-separated ints such as 1,2,3, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The CLI's arguments; each help states its default once."""
    p = argparse.ArgumentParser(prog=f"{PROG} generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="HF checkpoint directory or orbax checkpoint of a training run (run "
                   "directory, its checkpoints/ or a step directory)")
    p.add_argument("--tokenizer", help="tokenizer.json, SentencePiece .model or a directory "
                   "holding one (default: found with the checkpoint)")
    p.add_argument("--prompt", action="append", default=[],
                   help="prompt text; repeat for a batch (default: none)")
    p.add_argument("--prompt-ids", action="append", default=[], type=_ids,
                   help="prompt as comma-separated token ids; repeat for a batch (default: none)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens (default: all)")
    p.add_argument("--top-p", type=float, help="sample from the smallest set of tokens "
                   "whose probability reaches p (default: 1, off)")
    p.add_argument("--min-p", type=float, help="drop tokens less likely than min-p times the "
                   "most likely one (default: 0, off)")
    p.add_argument("--chat", action="store_true",
                   help="each --prompt is a user message, rendered with the tokenizer's chat "
                   "template; stops at the end of the assistant's turn too (default: plain text)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, a signed 64-bit "
                   "integer (default: %(default)s)")
    p.add_argument("--stop-token", type=int, action="append", dest="stop_tokens",
                   help="id that ends a sequence; repeatable (default: the tokenizer's eos)")
    p.add_argument("--no-stop", action="store_true", help="ignore eos: always generate "
                   "--max-new-tokens tokens (default: stop at eos)")
    p.add_argument("--no-bos", action="store_true", help="do not prepend the tokenizer's bos "
                   "to text prompts (default: as its add_bos_token says)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--cache-dtype", choices=("float32", "bfloat16", "float16", "int8"),
                   help="KV cache storage dtype; int8 stores a scale per token and kv head "
                   "(default: the compute dtype)")
    p.add_argument("--quant", metavar="SCHEME",
                   help="store the weights quantised: int8 (a scale per output channel), int4 "
                   "or int4:G (a scale per G inputs, G even, default up to 64), nf4 or nf4:G "
                   "(QLoRA's 16 levels, grouped as int4); default: float")
    p.add_argument("--tensor", type=int, default=1, metavar="T",
                   help="decode tensor-parallel over T devices (T divides the model's kv heads, "
                   "heads and FFN width); on CPU the host is split into T devices, 0 = one per "
                   "core (default: %(default)s)")
    p.add_argument("--expert", type=int, default=1, metavar="X",
                   help="split a mixture's experts over X devices (E/X each; X divides "
                   "moe.n_experts), times the --tensor devices (default: %(default)s)")
    g = p.add_argument_group("structured outputs (one of these; the checkpoint's HF "
                             "tokenizer.json)").add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE_OR_JSON",
                   help="every output is JSON valid under this schema (a file, or the "
                   "schema's JSON text); ends when the JSON is complete (default: free text)")
    g.add_argument("--json-object", action="store_true",
                   help="every output is a JSON object (default: free text)")
    g.add_argument("--regex", metavar="PATTERN",
                   help="every output matches this regular expression (default: free text)")
    g.add_argument("--choice", metavar="A,B,C",
                   help="every output is one of these comma-separated strings (default: free text)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with ids, text, logprobs and timings; no "
                   "streaming (default: stream text)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log at INFO level (default: warnings only)")
    return p


class _TextStreamer:
    """Prints each sequence's new text as decode steps arrive (one sequence: inline)."""

    def __init__(self, tokenizer: Any, batch: int):
        self.tokenizer = tokenizer
        self.ids: list[list[int]] = [[] for _ in range(batch)]
        self.printed = [""] * batch

    def __call__(self, step: int, tokens: np.ndarray, active: np.ndarray) -> None:
        for b in np.flatnonzero(active):
            self.ids[b].append(int(tokens[b]))
        if len(self.ids) != 1:
            return
        if self.tokenizer is None:
            print(f" {int(tokens[0])}" if active[0] else "", end="", flush=True)
            return
        text = detokenize(self.tokenizer, self.ids[0])
        # A piece can end inside a multi-byte character; print only settled text.
        if not text.endswith("\ufffd") and text.startswith(self.printed[0]):
            print(text[len(self.printed[0]):], end="", flush=True)
            self.printed[0] = text


def grammar_from_args(args: argparse.Namespace) -> tuple[str, Any] | None:
    """The structured-output flag given and its compiled-checked ``serving.grammar.Grammar``,
    or None without one.

    Raises:
      ValueError: naming the flag, on one line: a schema that is not JSON (nor a file), a
        grammar that does not compile.
    """
    from transformer_jax.serving.grammar import Grammar  # (and the engine: not at start-up)

    if args.json_schema is not None:
        flag, text = "--json-schema", args.json_schema
        if not text.lstrip().startswith("{"):
            try:
                text = Path(text).read_text()
            except OSError as e:
                raise ValueError(f"{flag}: neither a JSON object nor a readable file: "
                                 f"{e.strerror}: {text!r:.80}") from None
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag}: not JSON: {e}") from None
        grammar = Grammar("json_schema", schema)
    elif args.json_object:
        flag, grammar = "--json-object", Grammar("json_object")
    elif args.regex is not None:
        flag, grammar = "--regex", Grammar("regex", args.regex)
    elif args.choice is not None:
        flag, grammar = "--choice", Grammar("choice", tuple(args.choice.split(",")))
    else:
        return None
    try:
        grammar.check()
    except ValueError as e:
        message = " ".join(str(e).removeprefix(f"{grammar.kind}: ").split())
        raise ValueError(f"{flag}: {message:.300}") from None
    return flag, grammar


def _matchers(structured: tuple[str, Any], tokenizer: Any, vocab_size: int, batch: int
              ) -> list[Any]:
    """One fresh matcher of the flag's grammar per prompt (``generate``'s ``constraints``)."""
    from transformer_jax.serving.grammar import GrammarTokenizer

    flag, grammar = structured
    if tokenizer is None:
        raise ValueError(f"{flag} needs the checkpoint's HF tokenizer (tokenizer.json); pass "
                         "--tokenizer DIR")
    try:
        grammars = GrammarTokenizer(tokenizer, vocab_size)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    return [grammars.matcher(grammar) for _ in range(batch)]


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.prompt and not args.prompt_ids:
        return fail("give --prompt TEXT or --prompt-ids 1,2,3")
    if args.tensor < 0:
        return fail(f"--tensor must be >= 0, got {args.tensor}")
    if args.expert < 1:
        return fail(f"--expert must be >= 1, got {args.expert}")
    if not -(2**63) <= args.seed < 2**63:
        return fail(f"--seed must be a signed 64-bit integer (from -2**63 to 2**63 - 1), got "
                    f"{args.seed}")
    if args.chat and not args.prompt:
        return fail("--chat renders --prompt texts as user messages; give --prompt TEXT")
    try:  # before any weight is read
        structured = grammar_from_args(args)
    except ValueError as e:
        return fail(str(e))
    if structured is not None and args.tensor * args.expert != 1:
        return fail(f"{structured[0]}: structured outputs decode on one device; drop "
                    "--tensor / --expert")
    if args.tensor * args.expert != 1:  # before anything starts JAX's CPU backend
        sharding.configure_cpu_devices(devices=args.tensor * args.expert)
    try:
        parse_quant(args.quant, field="--quant")  # before any weight is read
        loaded, mesh = loading.load_for_decode(args.checkpoint, args.tensor, args.tokenizer,
                                                args.expert)
        config, params, tokenizer = loaded.config, loaded.params, loaded.tokenizer
        if args.prompt and tokenizer is None:
            raise ValueError("text prompts need a tokenizer: pass --tokenizer FILE_OR_DIR or "
                             "use --prompt-ids")
        if args.chat and not tokenizer.chat_template:
            raise ValueError(f"--chat needs a chat template; the tokenizer "
                             f"{loaded.tokenizer_path} has none (chat_template in "
                             "tokenizer_config.json or chat_template.jinja)")
        if args.dtype:
            config = config.replace(dtype=args.dtype)
        prompts = [encode_chat_prompt(tokenizer, [{"role": "user", "content": text}])
                   if args.chat else
                   encode_text(tokenizer, text, bos=False if args.no_bos else None)
                   for text in args.prompt]
        prompts.extend(args.prompt_ids)
        stop = [] if args.no_stop else args.stop_tokens or []
        if not (args.stop_tokens or args.no_stop):  # eos, the chat turn's end, the HF ids
            if tokenizer:
                stop = [tokenizer.eos_id if tokenizer.eos_id >= 0 else None,
                        chat_turn_end_id(tokenizer) if args.chat else None]
            if loaded.source.kind == loading.HF:  # e.g. Llama 3.1's <|eom_id|>
                stop += [i for i in generation_stop_ids(loaded.source.path)
                         if i < config.vocab_size]
            stop = list(dict.fromkeys(i for i in stop if i is not None))
        constraints = None if structured is None else _matchers(
            structured, tokenizer, config.vocab_size, len(prompts))
        streamer = None if args.json else _TextStreamer(tokenizer, len(prompts))
        start = time.perf_counter()
        result = generation.generate(
            config, params, prompts, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            min_p=args.min_p, seed=args.seed, stop_tokens=stop, stream=streamer, mesh=mesh,
            cache_dtype=args.cache_dtype, quant=args.quant, constraints=constraints)
        elapsed = time.perf_counter() - start
    except (ValueError, OSError, CheckpointError) as e:  # OSError: missing/unreadable files
        return fail(str(e), 1)
    texts = [detokenize(tokenizer, t) if tokenizer else None for t in result.tokens]
    if args.json:
        print(json.dumps({
            "prompt_ids": [list(map(int, p)) for p in prompts],
            "tokens": result.tokens, "text": texts, "logprobs": result.logprobs,
            "lengths": result.lengths, "seconds": elapsed,
            "tensor": 1 if mesh is None else mesh.devices.size}))
        return 0
    if len(prompts) == 1:
        if tokenizer is not None:  # whatever the streamer held back (an unfinished character)
            print(texts[0][len(streamer.printed[0]):], end="")
        print()
    else:
        for i, (p, toks) in enumerate(zip(prompts, result.tokens, strict=True)):
            shown = texts[i] if tokenizer else " ".join(map(str, toks))
            print(f"[{i}] {detokenize(tokenizer, p) if tokenizer else p} -> {shown}")
    n = sum(result.lengths)
    print(f"[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tokens/s including compilation]",
          file=sys.stderr)
    return 0

