"""Shared test setup: programs compiled with the cheap XLA:CPU code generation.

The tests check values, not speed: XLA:CPU without LLVM optimisations and fusion emitters
(``helpers.FAST_COMPILE``) compiles several times faster and computes the same values. The flags
are added to ``XLA_FLAGS`` here, before JAX creates its CPU backend, so that every program of
this pytest process and of the subprocesses it starts (which inherit the environment) gets them.
An ``XLA_FLAGS`` that already sets ``xla_backend_optimization_level`` is left as it is.
"""

import os

from helpers import FAST_COMPILE, with_fast_flags

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = with_fast_flags(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402
import pytest  # noqa: E402

from transformer_jax.decode import loop as decode  # noqa: E402

__all__ = ["FAST_COMPILE"]


@pytest.fixture(scope="module")
def shared_compilation_cache(tmp_path_factory):
    """A persistent compilation cache for a module: runs that build new closures of the same
    programs (``training.run`` called again) load them instead of compiling them again."""
    from jax.experimental.compilation_cache import compilation_cache

    old = (jax.config.jax_compilation_cache_dir,
           jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()  # jax decides once whether to use it; decide again
    yield
    jax.config.update("jax_compilation_cache_dir", old[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def fast_generate_compiles():
    """``decode.generate`` compiles with ``FAST_COMPILE`` (same static arguments) for a module."""
    original = decode._generate_jit
    decode._generate_jit = jax.jit(decode.generate_padded, compiler_options=FAST_COMPILE,
                                   static_argnames=decode.GENERATE_STATIC_ARGNAMES)
    yield
    decode._generate_jit = original


@pytest.fixture(scope="module")
def fast_engine_compiles():
    """The serving engine's step compiles with ``FAST_COMPILE`` for a module."""
    from transformer_jax.serving import step

    original = step.step_jit
    step.step_jit = step.jit_step(compiler_options=FAST_COMPILE)
    yield
    step.step_jit = original
