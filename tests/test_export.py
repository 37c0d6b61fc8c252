"""Exported generate: symbolic batch and prompt length, serialized, reloaded in a fresh process
and run for several shapes, with outputs equal to the jitted path."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.serialization
import jax
import numpy as np
import pytest
from helpers import FAST_COMPILE, FAST_XLA_FLAGS, TINY

from transformer_jax.decode import export, generation
from transformer_jax.decode import loop as decode
from transformer_jax.decode import prompts as prompt_lib
from transformer_jax.model.transformer import init_params

pytestmark = pytest.mark.usefixtures("fast_generate_compiles")

REPO = Path(__file__).resolve().parent.parent
CONFIG = TINY.replace(max_seq_len=48)
N_NEW = 6
SAMPLING = dict(temperature=0.9, top_k=20, top_p=0.9, stop_tokens=(5,))
# (B, T): one row at a bucket's length, several at a length that is not a bucket (each shape
# compiles its own program, in the fresh process and on the jitted path).
SHAPES = [(1, 8), (3, 5)]


@pytest.fixture(scope="module")
def params():
    init = jax.jit(init_params, static_argnums=0, compiler_options=FAST_COMPILE)
    return init(CONFIG, jax.random.key(0))


def _inputs(b, t, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, b).astype(np.int32)
    lengths[0] = t
    tokens = rng.integers(0, CONFIG.vocab_size, (b, t)).astype(np.int32)
    return tokens, lengths, prompt_lib.sequence_keys(seed, b)


@pytest.fixture(scope="module")
def exported():
    return export.export_generate(CONFIG, max_new_tokens=N_NEW, **SAMPLING)


def test_exported_has_symbolic_batch_and_prompt_length(exported):
    tokens, lengths, keys = exported.exported.in_avals[-3:]
    assert str(tokens.shape) == "(b, t)" and str(lengths.shape) == "(b,)"
    assert [str(a.shape) for a in exported.exported.out_avals] == [
        f"(b, {N_NEW})", f"(b, {N_NEW})", "(b,)"]


def test_reloaded_in_a_fresh_process_equals_the_jitted_path(exported, params, tmp_path):
    exported.save(tmp_path / "generate.export")
    (tmp_path / "params.msgpack").write_bytes(flax.serialization.msgpack_serialize(
        jax.tree.map(np.asarray, params)))
    cases = []
    for i, (b, t) in enumerate(SHAPES):
        tokens, lengths, keys = _inputs(b, t, seed=i)
        np.savez(tmp_path / f"in{i}.npz", tokens=tokens, lengths=lengths, keys=keys)
        cases.append((tokens, lengths, keys))
    script = textwrap.dedent(f"""
        import flax.serialization, numpy as np
        from transformer_jax.decode import export
        fn = export.load({str(tmp_path / "generate.export")!r})
        params = flax.serialization.msgpack_restore(
            open({str(tmp_path / "params.msgpack")!r}, "rb").read())
        for i in range({len(SHAPES)}):
            x = np.load({str(tmp_path)!r} + f"/in{{i}}.npz")
            out = fn(params, x["tokens"], x["lengths"], x["keys"])
            np.savez({str(tmp_path)!r} + f"/out{{i}}.npz", *[np.asarray(o) for o in out])
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS=FAST_XLA_FLAGS)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jitted = decode._generate_jit
    for i, (tokens, lengths, keys) in enumerate(cases):
        want = jitted(CONFIG, params, tokens, lengths, keys, max_new_tokens=N_NEW,
                      settings=exported.settings)
        got = np.load(tmp_path / f"out{i}.npz")
        np.testing.assert_array_equal(got["arr_0"], want[0], err_msg=f"shape {SHAPES[i]}")
        np.testing.assert_allclose(got["arr_1"], want[1], atol=1e-6)
        np.testing.assert_array_equal(got["arr_2"], want[2])


def test_generate_helper_and_constraint(exported, params):
    prompts = [[1, 2, 3], [4] * 11]
    got = exported.generate(params, prompts, seed=3)
    want = generation.generate(CONFIG, params, prompts, max_new_tokens=N_NEW, seed=3, **SAMPLING)
    assert got.tokens == want.tokens
    with pytest.raises(ValueError, match="max_seq_len"):
        exported.generate(params, [[1] * 43])
    with pytest.raises(ValueError):  # t + N > max_seq_len violates the export's constraint
        exported(params, np.zeros((1, 43), np.int32), np.ones(1, np.int32),
                 prompt_lib.sequence_keys(0, 1))


def test_load_rejects_other_files(tmp_path):
    (tmp_path / "x").write_bytes(b"not an export")
    with pytest.raises(ValueError, match="not a transformer_jax exported"):
        export.load(tmp_path / "x")
