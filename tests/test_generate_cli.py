"""The generate CLI (HF and orbax checkpoints, text and id prompts, JSON, streaming) and the
callable ``transformer_jax.generate`` module."""

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers import FAST_COMPILE, FAST_XLA_FLAGS, TINY

from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.model.transformer import init_params

pytestmark = pytest.mark.usefixtures("fast_generate_compiles")

# The package exports the function ``generate``; the CLI is the module of the same name.
cli = importlib.import_module("transformer_jax.cli.generate")

REPO = Path(__file__).resolve().parent.parent
CONFIG = TINY
FAST_ENV = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS=FAST_XLA_FLAGS)


@pytest.fixture(scope="module")
def params():
    init = jax.jit(init_params, static_argnums=0, compiler_options=FAST_COMPILE)
    return init(CONFIG, jax.random.key(0))


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from transformer_jax.tokenizer import Tokenizer

    text = "the quick brown fox jumps over the lazy dog. " * 20
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    tok = Tokenizer.train([text], path, vocab_size=40, model_type="char")
    assert tok.vocab_size <= CONFIG.vocab_size
    return tok.path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, params, tokenizer_file):
    hf = pytest.importorskip("transformer_jax.hf")
    path = tmp_path_factory.mktemp("hf")
    hf.save(CONFIG, params, path)
    (path / "tokenizer.model").write_bytes(tokenizer_file.read_bytes())
    return path


def test_prompt_ids_json_from_hf_dir(hf_dir, params, capsys):
    argv = ["--checkpoint", str(hf_dir), "--prompt-ids", "1,2,3", "--prompt-ids", "4, 5",
            "--max-new-tokens", "5", "--no-stop", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    want = generation.generate(CONFIG, params, [[1, 2, 3], [4, 5]], max_new_tokens=5)
    assert out["tokens"] == want.tokens
    assert out["lengths"] == [5, 5]
    assert out["prompt_ids"] == [[1, 2, 3], [4, 5]]


def test_the_checkpoints_generation_config_eos_ids_stop_generation(hf_dir, params, tmp_path,
                                                                     capsys):
    """``generation_config.json``'s ``eos_token_id`` list (Llama 3.1's ``<|eom_id|>``) stops
    generation besides the tokenizer's eos; ``--no-stop`` ignores it."""
    import shutil

    from transformer_jax.tokenizer import load_tokenizer

    free = generation.generate(CONFIG, params, [[1, 2, 3]], max_new_tokens=6).tokens[0]
    stop = free[1]  # the token greedy decoding draws second
    path = tmp_path / "hf"
    shutil.copytree(hf_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop]}))
    eos = load_tokenizer(path).eos_id
    argv = ["--checkpoint", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "6",
            "--json"]
    assert cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)["tokens"]
    want = generation.generate(CONFIG, params, [[1, 2, 3]], max_new_tokens=6,
                               stop_tokens=[eos, stop]).tokens
    assert got == want and len(got[0]) <= 2 < len(free)
    assert cli.main([*argv, "--no-stop"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == [free]


def test_quantised_weights_and_cache_decode_as_generate_does(hf_dir, params, capsys):
    argv = ["--checkpoint", str(hf_dir), "--prompt-ids", "1,2,3", "--max-new-tokens", "5",
            "--no-stop", "--json", "--quant", "int8", "--cache-dtype", "int8"]
    assert cli.main(argv) == 0
    want = generation.generate(CONFIG, decode.prepare(CONFIG, params, quant="int8"),
                               [[1, 2, 3]], max_new_tokens=5, cache_dtype="int8")
    assert json.loads(capsys.readouterr().out)["tokens"] == want.tokens


def test_text_prompt_streams_the_decoded_text(hf_dir, params, tokenizer_file, capsys):
    from transformer_jax.tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer_file)
    argv = ["--checkpoint", str(hf_dir), "--prompt", "the lazy", "--max-new-tokens", "12",
            "--temperature", "0.8", "--top-k", "10", "--seed", "4"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    prompt = tok.encode("the lazy", add_bos=tok.bos_id >= 0)
    want = generation.generate(CONFIG, params, [prompt], max_new_tokens=12, temperature=0.8,
                           top_k=10, seed=4, stop_tokens=[tok.eos_id])
    assert printed == cli.detokenize(tok, want.tokens[0]) + "\n"
    assert any(t >= tok.vocab_size for t in want.tokens[0])  # shown, not an error


def test_streamer_prints_each_step_as_it_arrives(capsys):
    class Chars:  # a stand-in tokenizer: id i is the letter chr(97 + i)
        vocab_size = 26

        def decode(self, ids):
            return "".join(chr(97 + i) for i in ids)

    streamer = cli._TextStreamer(Chars(), batch=1)
    for step, tok in enumerate([0, 1, 2]):
        streamer(step, jnp.asarray([tok]), jnp.asarray([True]))
        assert capsys.readouterr().out == "abc"[step]


def test_orbax_checkpoint_of_a_training_run(tmp_path, params, tokenizer_file, capsys):
    optax = pytest.importorskip("optax")
    from transformer_jax.checkpoint.manager import CheckpointManager
    from transformer_jax.train.step import TrainState

    state = TrainState(step=jnp.int32(7), params=params, opt_state=optax.adam(1e-3).init(params),
                       rng=jnp.zeros(2, jnp.uint32))
    with CheckpointManager(tmp_path / "run" / "checkpoints", async_save=False) as manager:
        manager.save(7, state, meta={"model": dataclasses.asdict(CONFIG), "step": 7,
                                     "tokenizer": str(tokenizer_file)})
    # The shapes of the eos test's free decoding: its compiled program.
    want = generation.generate(CONFIG, params, [[7, 8, 9]], max_new_tokens=6)
    for path in (tmp_path / "run", tmp_path / "run" / "checkpoints",
                 tmp_path / "run" / "checkpoints" / "7"):
        assert cli.main(["--checkpoint", str(path), "--prompt-ids", "7,8,9",
                         "--max-new-tokens", "6", "--no-stop", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["tokens"] == want.tokens


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint", "/nonexistent/dir", "--prompt-ids", "1"], "does not exist"),
    (["--prompt-ids", "1,99"], "token id 99"),
    (["--prompt-ids", "1", "--top-p", "0"], "top_p"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], "max_new_tokens"),
    (["--prompt-ids", "1", "--tensor", "3"], "needs 3 devices"),
    (["--prompt-ids", "1", "--expert", "2"], "--tensor 1 --expert 2 needs 2 devices"),
    (["--prompt-ids", "1", "--max-new-tokens", "4", "--quant", "int3"],
     "quant must be one of 'int8', 'int4'"),
])
def test_errors_are_reported_with_exit_status_1(hf_dir, argv, message, capsys):
    if "--checkpoint" not in argv:
        argv = ["--checkpoint", str(hf_dir), *argv]
    assert cli.main(argv) == 1
    assert message in capsys.readouterr().err


# One fresh process for both tests below (a process start costs seconds of imports): first the
# package attribute before the CLI ran (its type only: a call would start JAX's CPU backend,
# whose devices --tensor 2 splits first), then ``python -m transformer_jax.generate`` (runpy's
# module run as ``__main__``, as ``-m`` does) with --tensor 2, then the attribute called before
# and after ``import transformer_jax.generate``.
FRESH_SCRIPT = """
import runpy, sys, types
import transformer_jax
assert callable(transformer_jax.generate)
assert not isinstance(transformer_jax.generate, types.ModuleType)
sys.argv = ["transformer_jax.generate", *ARGV]
try:
    runpy.run_module("transformer_jax.generate", run_name="__main__", alter_sys=True)
except SystemExit as e:
    assert e.code in (0, None), e.code
print("---")
import jax
import numpy as np
from transformer_jax.decode import generation
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import abstract_params
config = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=16, max_seq_len=16)
# Random weights from the shapes (init_params op by op compiles each of its ops).
rng = np.random.default_rng(0)
params = jax.tree.map(lambda x: 0.2 * rng.standard_normal(x.shape, x.dtype),
                      abstract_params(config))
kw = dict(max_new_tokens=3)
want = generation.generate(config, params, [[1, 2]], **kw).tokens
assert transformer_jax.generate(config, params, [[1, 2]], **kw).tokens == want
import transformer_jax.generate
assert isinstance(transformer_jax.generate, types.ModuleType)
assert transformer_jax.generate(config, params, [[1, 2]], **kw).tokens == want
from transformer_jax import generate
assert generate(config, params, [[1, 2]], **kw).tokens == want
print("ok")
"""


@pytest.fixture(scope="module")
def fresh_process(hf_dir):
    argv = ["--checkpoint", str(hf_dir), "--prompt-ids", "3,1,4", "--prompt-ids", "1,5",
            "--max-new-tokens", "4", "--no-stop", "--tensor", "2", "--json"]
    return subprocess.run([sys.executable, "-c", FRESH_SCRIPT.replace("ARGV", repr(argv))],
                          capture_output=True, text=True, env=FAST_ENV, timeout=300, cwd=REPO)


def test_cli_runs_as_a_module_tensor_parallel_over_two_cpu_devices(fresh_process, params):
    """``python -m transformer_jax.generate`` runs (exit 0, its JSON on stdout); --tensor 2
    splits the CPU into 2 devices (in the fresh process) and decodes over both, the tokens
    of ``generate`` on one."""
    proc = fresh_process
    assert "---" in proc.stdout.splitlines(), proc.stderr[-3000:]
    want = generation.generate(CONFIG, params, [[3, 1, 4], [1, 5]], max_new_tokens=4)
    out = json.loads(proc.stdout.split("---")[0])
    assert out["tensor"] == 2 and out["lengths"] == [4, 4]
    assert out["tokens"] == want.tokens


def test_package_attribute_generate_is_callable_before_and_after_importing_the_cli(
        fresh_process):
    proc = fresh_process
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("---")[1].strip() == "ok"
