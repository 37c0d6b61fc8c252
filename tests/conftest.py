"""Shared test setup: decode programs compiled without LLVM optimisations.

The tests check values, not speed: compiling with ``xla_backend_optimization_level=0`` is 3-4x
faster here and computes the same values.
"""

import jax
import pytest

from transformer_jax import decode

FAST_COMPILE = {"xla_backend_optimization_level": 0}


@pytest.fixture(scope="module")
def fast_generate_compiles():
    """``decode.generate`` compiles with ``FAST_COMPILE`` (same static arguments) for a module."""
    original = decode._generate_jit
    decode._generate_jit = jax.jit(decode.generate_padded, compiler_options=FAST_COMPILE,
                                   static_argnames=decode.GENERATE_STATIC_ARGNAMES)
    yield
    decode._generate_jit = original
