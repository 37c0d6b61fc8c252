"""Helpers shared by the tests (one definition each): the cheap XLA:CPU compile options, the tiny
model config, random parameters drawn with numpy, a numpy attention reference and a random
HuggingFace model builder.

Importing this module touches no device (``multihost_worker.py`` imports it before
``jax.distributed.initialize``) and needs neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from transformer_jax.model.config import ModelConfig

# The tests check values, not speed: XLA:CPU code generation without LLVM optimisations and
# without the fusion emitters compiles several times faster and computes the same values (to
# float rounding). One LLVM module per program, not split 32 ways for parallel code generation:
# the tiny programs' parts cost more to set up than they save, and the suite keeps both cores
# busy (about an eighth less compile CPU, same values). ``FAST_COMPILE`` is for
# ``jax.jit(..., compiler_options=FAST_COMPILE)``;
# ``FAST_XLA_FLAGS`` is the same as ``XLA_FLAGS`` text, for subprocesses (and this pytest
# process: conftest.py adds it to ``XLA_FLAGS`` before JAX creates its CPU backend).
FAST_COMPILE: dict[str, int | bool] = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
    "xla_cpu_parallel_codegen_split_count": 1,
}
FAST_XLA_FLAGS = " ".join(f"--{key}={str(value).lower()}" for key, value in FAST_COMPILE.items())


# Python's cyclic garbage collector less often, in every process that imports this module (the
# pytest processes through conftest.py, and the multi-device worker scripts): tracing allocates
# millions of small objects, and with the default thresholds (700, 10, 10) a pytest process that
# has imported torch, transformers and every test module spent some 5% of its CPU in collections
# that free little (measured with gc.callbacks on test_decode: 2.2 s of 37 s; 0.7 s with these).
GC_THRESHOLDS = (20000, 20, 20)
gc.set_threshold(*GC_THRESHOLDS)


def with_fast_flags(xla_flags: str = "") -> str:
    """``xla_flags`` (e.g. a device count) followed by ``FAST_XLA_FLAGS``."""
    return f"{xla_flags} {FAST_XLA_FLAGS}".strip()


def fast_everywhere() -> bool:
    """Whether every program of this process compiles with ``FAST_COMPILE``'s options already
    (``XLA_FLAGS`` carries them: conftest.py puts them there). Then a fixture that re-jits a
    library function with them should leave it alone: a jit given the same options explicitly
    is another cache entry (in memory and in the persistent cache), so a program that modules
    with and without the fixture both ran would compile twice."""
    import os

    return FAST_XLA_FLAGS in os.environ.get("XLA_FLAGS", "")


# train.py arguments of a tiny, fast run (char tokenizer, checkpoints every 2 steps), to which
# tests add the corpus, the run directory and the steps.
TINY_RUN_ARGS = [
    "--no-progress", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
    "model.n_kv_heads=1", "model.d_ff=64", "model.max_seq_len=32", "train.seq_len=16",
    "train.batch_size=4", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
    "train.sample_tokens=0", "train.ckpt_every=2", "data.tokenizer=char", "data.val_fraction=0.1"]

# ``python train.py`` (the train CLI's ``main``, in a fresh process) without its loss plot:
# matplotlib's import and a draw are some 1 s of a tiny run's CPU here, and the plot is
# test_plot's subject. Tests append the CLI's arguments.
TRAIN_CLI_NO_PLOT = [
    sys.executable, "-c",
    "import sys; from transformer_jax.train import plot; plot.plot_run = lambda run_dir: None; "
    "from transformer_jax.cli.train import main; sys.exit(main())"]

# Runs each job of the JSON list on stdin, [name, directory or null, argv], one after another in
# this one process, as ``python ARGV`` would in that directory (argv[0] a script, or "-c" and
# code); prints {name: {returncode, stdout, stderr}} as its last line. A job that replaced the
# training run's loss plot (``-c`` code that stubs ``run._plot``) does not leave it replaced for
# the next job. One process for several CLI runs: the imports and compiles are paid once.
SCRIPTS_DRIVER = r"""
import contextlib, io, json, os, runpy, sys, traceback
from transformer_jax.train import run

draw = run._plot
results = {}
for name, cwd, argv in json.load(sys.stdin):
    run._plot = draw
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = argv[1:] if argv[0] == "-c" else list(argv)  # as python sets it
    sys.argv[0] = argv[0]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if argv[0] == "-c":
                exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
            else:
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
    results[name] = {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
print(json.dumps(results))
"""


def logged(call: Callable[[], object]) -> tuple[object, str]:
    """``call()``'s value and the ``transformer_jax`` log lines (INFO and above) it wrote."""
    import logging

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("transformer_jax")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        return call(), "\n".join(lines)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# A tiny random model: GQA (4 query heads, 2 kv heads of 8), 2 layers, weights at init_std 0.2 so
# that its logits are far from uniform. Tests change fields with ``TINY.replace(...)``.
TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   d_ff=48, max_seq_len=64, init_std=0.2)


def random_params(config: ModelConfig, seed: int = 0, std: float = 0.2) -> dict:
    """Random parameters of ``config`` (its layout, scanned or not) as numpy arrays, drawn with
    numpy from the shapes alone (``abstract_params``): no program compiles, where
    ``init_params`` op by op compiles one per op and shape. Every leaf is random, biases and
    norm gains included (gains ``1 - norm_offset`` plus noise), so a shard that used another
    shard's slice of any of them would change the output.
    """
    import jax

    from transformer_jax.model.transformer import abstract_params

    rng = np.random.default_rng(seed)

    def leaf(path: tuple, x: jax.ShapeDtypeStruct) -> np.ndarray:
        noise = rng.standard_normal(x.shape).astype(x.dtype)
        if len(path) > 1 and "norm" in str(path[-2].key):
            center = 1.0 - config.norm_offset if str(path[-1].key) == "scale" else 0.0
            return center + 0.1 * noise
        return std * noise

    return jax.tree_util.tree_map_with_path(leaf, abstract_params(config))


def numpy_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, *,
                    kv_layout: str = "BKSH", sinks: np.ndarray | None = None) -> np.ndarray:
    """Per-head textbook attention, one query at a time; head r reads kv head floor(r / (N/K)).

    Args:
      q: [B, T, N, H] queries.
      k, v: [B, K, S, H] (``kv_layout="BKSH"``, the KV cache's layout) or [B, S, K, H]
        (``"BSKH"``) keys and values.
      mask: [B, T, S] bool, whether query t sees key s.
      sinks: optional [N] sink logits: each joins its head's softmax as one more logit with
        no value.

    Returns:
      [B, T, N, H] float64; zeros for a query that sees no key.
    """
    if kv_layout == "BSKH":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    elif kv_layout != "BKSH":
        raise ValueError(f"kv_layout must be 'BKSH' or 'BSKH', got {kv_layout!r}")
    b, t, n, h = q.shape
    kv = k.shape[1]
    out = np.zeros((b, t, n, h))
    for bi in range(b):
        for r in range(n):
            g = r // (n // kv)
            for ti in range(t):
                if not mask[bi, ti].any():
                    continue
                logits = np.where(mask[bi, ti], k[bi, g] @ q[bi, ti, r] / math.sqrt(h), -np.inf)
                logits = np.append(logits, [] if sinks is None else [sinks[r]])
                w = np.exp(logits - logits.max())
                out[bi, ti, r] = (w / w.sum())[:k.shape[2]] @ v[bi, g]
    return out


HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def ragged_inputs(batch: int, length: int, vocab: int, offset: int = 300
                  ) -> tuple[np.ndarray, np.ndarray]:
    """[B, T] random tokens and their positions; the second row starts at ``offset`` (past a
    short original context, a window, a YaRN length)."""
    tokens = np.random.default_rng(0).integers(0, vocab, (batch, length)).astype(np.int32)
    starts = np.array([[0], [offset]] + [[0]] * (batch - 2))[:batch]
    return tokens, (np.arange(length)[None] + starts).astype(np.int32)


def torch_logits(model, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """A transformers model's float32 logits [B, T, V] at explicit positions."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor(tokens, dtype=torch.long),
                    position_ids=torch.tensor(positions, dtype=torch.long))
    return out.logits.float().numpy()


def our_logits(config, params, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``Transformer(config)``'s logits [B, T, V] at explicit positions."""
    import jax.numpy as jnp

    from transformer_jax.model.transformer import Transformer

    logits = Transformer(config).apply({"params": params}, jnp.asarray(tokens),
                                       positions=jnp.asarray(positions)).logits
    assert logits.shape == (*tokens.shape, config.vocab_size)
    return np.asarray(logits)


def jit_logits(config, params, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``our_logits`` as one jitted program (``FAST_COMPILE``): one compile, not one per op."""
    import jax
    import jax.numpy as jnp

    from transformer_jax.model.transformer import Transformer

    def run(params, tokens, positions):
        return Transformer(config).apply({"params": params}, tokens, positions=positions).logits

    return np.asarray(jax.jit(run, compiler_options=FAST_COMPILE)(
        params, jnp.asarray(tokens), jnp.asarray(positions)))


@dataclasses.dataclass(frozen=True)
class LoadedHF:
    """A random HF model written with ``save_pretrained``, its logits on a test's inputs, and
    the checkpoint as ``hf.load`` reads it."""

    model: object
    path: object
    logits: np.ndarray  # transformers'
    config: object
    params: dict


def spread_torch_params(model) -> None:
    """Draws a torch model's parameters in place (under the caller's seed): vectors (norm gains,
    biases) ``1 + 0.2 N(0, 1)``, matrices ``N(0, 1/fan_in)``; far from the init's ones and
    zeros, so a misplaced gain or bias shows in the logits."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)


def random_hf_model(kind: str, seed: int = 0, **config):
    """A tiny transformers model (eager attention, eval mode) with every weight randomised.

    Matrices are drawn at unit scale (std ``fan_in ** -0.5``, not HF's 0.02 init), norm weights
    around 1 and biases around 0 (std 0.2), so that attention is peaked and every weight changes
    the logits visibly.

    Args:
      kind: a key of ``HF_CLASSES`` (the HF ``model_type``).
      seed: torch's seed for the model's construction and weights.
      **config: the ``transformers`` config's fields (sizes, ``tie_word_embeddings``, ...).
    """
    import torch
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in HF_CLASSES[kind])
    gain = 0.0 if kind.startswith("gemma") else 1.0
    torch.manual_seed(seed)
    model = model_cls(config_cls(**config, attn_implementation="eager")).eval()
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma stores w of (1 + w)
                p.copy_(gain + 0.2 * torch.randn_like(p))
            elif p.ndim == 1:  # biases
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


# A ChatML chat template (Qwen2's format), and a word-level HF tokenizer directory using it.
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def write_chatml_tokenizer(directory: Path, words: Sequence[str], **config: object) -> Path:
    """``directory`` holding a word-level ``tokenizer.json`` (the specials, then ``words``, split
    on whitespace) and a ``tokenizer_config.json`` with bos ``<s>``, eos ``</s>``, bos added,
    the ChatML template and ``config``'s further keys (a key given None is left out)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = [*CHATML_SPECIALS, *words]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)},
                                                unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in CHATML_SPECIALS])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    settings = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                "pad_token": "</s>", "add_bos_token": True, "chat_template": CHATML, **config}
    (directory / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in settings.items() if v is not None}))
    return directory


def write_word_docs(root: Path, num_docs: int, num_words: int = 30, seed: int = 1
                    ) -> tuple[Path, Path]:
    """``root/docs.jsonl`` of ``num_docs`` documents of 1-29 random words ``w0 .. w{N-1}``
    (a ``text`` field each) and a word-level tokenizer of those words in ``root/tok``.

    Returns:
      ``(docs.jsonl, tokenizer directory)``.
    """
    words = [f"w{i}" for i in range(num_words)]
    rng = np.random.default_rng(seed)
    docs = root / "docs.jsonl"
    docs.write_text("".join(
        json.dumps({"text": " ".join(rng.choice(words, rng.integers(1, 30)))}) + "\n"
        for _ in range(num_docs)))
    return docs, write_chatml_tokenizer(root / "tok", words)


# Engine loops with a step limit (no test can hang) ---------------------------------------------

#: The most steps a test's engine loop runs before it fails: the tests' loads need well under a
#: hundred, so reaching it means a request that never finishes or pages that never come back.
ENGINE_STEP_LIMIT = 500


def _step_limit_error(engine: object, max_steps: int, what: str) -> AssertionError:
    return AssertionError(f"step limit: {what} not reached in {max_steps} engine steps "
                          f"({engine.scheduler.describe()})")


def step_until(engine: object, done: Callable[[], bool], max_steps: int = ENGINE_STEP_LIMIT,
               what: str = "the condition") -> None:
    """Calls ``engine.step()`` until ``done()`` holds; AssertionError (naming ``what`` and the
    scheduler's queues) when it still does not after ``max_steps`` steps."""
    for _ in range(max_steps):
        if done():
            return
        engine.step()
    if not done():
        raise _step_limit_error(engine, max_steps, what)


def run_until_idle(engine: object, max_steps: int = ENGINE_STEP_LIMIT) -> dict:
    """``engine.run_until_idle`` with a step limit: its completions, or AssertionError when the
    engine is still busy after ``max_steps`` steps."""
    done = engine.run_until_idle(max_steps=max_steps)
    if not engine.idle:
        raise _step_limit_error(engine, max_steps, "an idle engine")
    return done


#: Qwen2.5/3's added tokens for tool calls and thinking, as (text, special): ids 300-303 after
#: ``write_byte_tokenizer``'s 300 (Qwen marks them not special; two here are, to cover both).
QWEN_ADDED = (("<tool_call>", False), ("</tool_call>", False), ("<think>", True),
              ("</think>", True))


def write_byte_tokenizer(directory: Path, vocab_size: int = 300, chat_template: str = CHATML,
                         added: Sequence[tuple[str, bool]] = ()) -> Path:
    """``directory`` holding a byte-level BPE ``tokenizer.json`` (every byte a token, so any
    text, JSON included, can be spelled; merges learnt from a little JSON), the ChatML specials
    and a ``tokenizer_config.json`` as ``write_chatml_tokenizer`` writes it (with
    ``chat_template``: the ChatML one unless given); ``added`` tokens (text, special) after
    the ``vocab_size`` ids, e.g. ``QWEN_ADDED``."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHATML_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    sample = ['{"name": "ab", "id": 12, "tags": ["x", "y"], "ok": true, "v": null}',
              "user assistant system hello world yes no"]
    tok.train_from_iterator(sample * 20, trainer)
    for text, special in added:
        tok.add_tokens([tokenizers.AddedToken(text, special=special)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    settings = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                "pad_token": "</s>", "add_bos_token": True, "chat_template": chat_template}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


def free_socket():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


class Served:
    """uvicorn serving ``app`` on a thread, on a socket bound here (no port race)."""

    def __init__(self, app):
        import threading
        import time

        import uvicorn

        sock = free_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


def jaxpr_equations(jaxpr) -> int:
    """Equations of a jaxpr and of every jaxpr inside it (scan bodies, conds, ...)."""
    import jax  # here: importing helpers must not start JAX before conftest sets its flags

    return sum(1 + sum(jaxpr_equations(sub) for sub in jax.extend.core.jaxprs_in_params(
        eqn.params)) for eqn in jaxpr.eqns)


def jaxpr_primitives(jaxpr) -> set[str]:
    """The primitive names of a jaxpr and of every jaxpr inside it."""
    import jax

    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out |= jaxpr_primitives(sub)
    return out


def keys_in_order(keys):
    """A cache's keys as [..., S, H], whether stored so or ``SlotsLast`` ([..., H, S])."""
    from transformer_jax.model.ops.layouts import SlotsLast

    return keys.k.swapaxes(-1, -2) if isinstance(keys, SlotsLast) else keys


def must_not_run(what: str) -> Callable[..., None]:
    """A stand-in for an expensive function (a model build, a load, a training run) that
    fails the test when called: the bad argument was not refused before it."""
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran: the bad argument was not refused first")
    return fail


def exit_and_line(capsys, call: Callable[[list[str]], int | None], *argv: str
                  ) -> tuple[int | str | None, str]:
    """Runs ``call(argv)`` (a command's ``main``): its exit status (returned or raised) and its
    one error line (asserted: no traceback, exactly one line holding ``error: ``)."""
    try:
        code = call(list(argv))
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "error: " in line]
    assert len(lines) == 1, err[-3000:]
    return code, lines[0]


def check_top_logprobs(got, rows, k: int) -> list[list[int]]:
    """Asserts a reply's per-token log-probabilities against an independent forward's.

    ``got`` has ``tokens``, ``logprobs`` and ``top_logprobs`` (per token, K (id, logprob)
    pairs); ``rows`` [N, V] are the reference log-softmax rows at the reply's positions. The
    alternatives must be the K likeliest in order: their reference values equal the row's
    sorted top K (within 1e-5, so two logits closer than that may swap places: the two
    forwards add in different orders), and each reported value is its token's. Returns each
    position's alternative ids.
    """
    assert len(got.top_logprobs) == len(got.tokens) == len(rows)
    ids_per_position = []
    for top, token, lp, row in zip(got.top_logprobs, got.tokens, got.logprobs, rows,
                                   strict=True):
        ids = [t for t, _ in top]
        assert len(set(ids)) == len(ids) == k, top
        np.testing.assert_allclose(row[ids], np.sort(row)[::-1][:k], atol=1e-5)
        np.testing.assert_allclose([v for _, v in top], row[ids], atol=1e-5)
        np.testing.assert_allclose(lp, row[token], atol=1e-5)
        ids_per_position.append(ids)
    return ids_per_position
