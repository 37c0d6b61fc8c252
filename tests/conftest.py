"""Shared test setup: programs compiled with the cheap XLA:CPU code generation.

The tests check values, not speed: XLA:CPU without LLVM optimisations and fusion emitters
(``helpers.FAST_COMPILE``) compiles several times faster and computes the same values. The flags
are added to ``XLA_FLAGS`` here, before JAX creates its CPU backend, so that every program of
this pytest process and of the subprocesses it starts (which inherit the environment) gets them.
An ``XLA_FLAGS`` that already sets ``xla_backend_optimization_level`` is left as it is.
"""

import os
import shutil
import tempfile

from helpers import FAST_COMPILE, fast_everywhere, with_fast_flags  # (and its GC thresholds)

# The suite runs on the CPU (several devices are simulated there). With libtpu installed (the
# tpu extra: the TPU compiler for tests/test_tpu_compile.py), JAX would otherwise look for a TPU
# in every process and write its failure to stderr.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = with_fast_flags(os.environ.get("XLA_FLAGS", ""))
# Then the fixtures below leave the library's jitted functions as they are (helpers).
FAST_EVERYWHERE = fast_everywhere()

# One persistent compilation cache for the whole run, empty at its start: the pytest-xdist
# workers and every subprocess a test starts inherit it, so a program that several of them
# compile (a tiny model's train step in each CLI run, the same decode programs in several
# modules) compiles once per run (a quarter less time in the subprocess-heavy modules, measured
# on this project's 2-core CPU). The process that made it removes it at the end.
_RUN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _RUN_CACHE = tempfile.mkdtemp(prefix="transformer_jax-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _RUN_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

from transformer_jax.decode import loop as decode  # noqa: E402

__all__ = ["FAST_COMPILE"]


@pytest.fixture(scope="module")
def shared_compilation_cache(tmp_path_factory):
    """A persistent compilation cache for a module: runs that build new closures of the same
    programs (``training.run`` called again) load them instead of compiling them again. That
    is the run's cache (above) when there is one, every program cached: a module's own cache
    would hide the programs other modules (and the other xdist worker) compiled."""
    from jax.experimental.compilation_cache import compilation_cache

    if jax.config.jax_compilation_cache_dir:
        old = jax.config.jax_persistent_cache_min_compile_time_secs
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        yield
        jax.config.update("jax_persistent_cache_min_compile_time_secs", old)
        return
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
    """``decode.generate`` compiles with ``FAST_COMPILE`` (same static arguments) for a module
    (as every program does when ``FAST_EVERYWHERE``)."""
    if FAST_EVERYWHERE:
        yield
        return
    original = decode._generate_jit
    decode._generate_jit = jax.jit(decode.generate_padded, compiler_options=FAST_COMPILE,
                                   static_argnames=decode.GENERATE_STATIC_ARGNAMES)
    yield
    decode._generate_jit = original


@pytest.fixture(scope="module")
def fast_engine_compiles():
    """The serving engine's step compiles with ``FAST_COMPILE`` for a module (as every program
    does when ``FAST_EVERYWHERE``)."""
    from transformer_jax.serving import step

    if FAST_EVERYWHERE:
        yield
        return
    from transformer_jax.serving import multistep

    original, rounds = step.step_jit, multistep.multi_decode_jit
    step.step_jit = step.jit_step(compiler_options=FAST_COMPILE)
    multistep.multi_decode_jit = multistep.jit_multi_decode(compiler_options=FAST_COMPILE)
    yield
    step.step_jit, multistep.multi_decode_jit = original, rounds


# The modules that take longest (seconds of their tests, fixtures included, summed over both
# workers of a fresh-clone run of the whole suite on the 2-core machine), heaviest first.
# ``pytest -n 2 --dist loadfile`` hands each worker one module at a time in collection order,
# and pytest-xdist by default reorders the modules by their number of tests, which left long
# modules of few tests (a subprocess each: test_decode_tp, test_tpu_compile's TPU compiles) to
# the end while the other worker sat idle. Longest first (and xdist's reordering off) leaves the
# short modules for the end, where they even out the two workers: from that run's figures, the
# later worker ends 21 s sooner in this order than with test_tpu_compile in collection order. A
# module not listed (each takes under 2 s) runs after these, in collection order.
LONGEST_FIRST = (
    "test_decode_tp", "test_tpu_compile", "test_readme_commands", "test_moe_decode",
    "test_speculative", "test_moe_parallel", "test_speculative_engine", "test_sharding",
    "test_object_storage", "test_run_faults", "test_finetune", "test_decode", "test_grpo",
    "test_model_families", "test_training", "test_serving_multi_prefill", "test_preference",
    "test_serving_engine", "test_moe_train", "test_serve", "test_hf_deepseek", "test_train_cli",
    "test_model", "test_multihost", "test_io_faults", "test_generate_cli", "test_faults",
    "test_hf_moe", "test_multi_lora", "test_tpu_remat", "test_faults_qlora", "test_hf_llama4",
    "test_moe_ops", "test_model_backends", "test_hf_families", "test_paged_kernels",
    "test_window_cache", "test_loading", "test_context_parallel", "test_checkpoint",
    "test_hf_gpt_oss", "test_sampling", "test_mtp", "test_layer_groups", "test_attention",
    "test_ops", "test_quant", "test_moe_deepseek", "test_serving_bench", "test_hf",
    "test_quant_train", "test_tools", "test_hf_sharded", "test_bench_decode", "test_docs",
    "test_structured", "test_export", "test_generate_structured", "test_attention_sinks",
    "test_compiled_step", "test_moe_bias", "test_plot", "test_hf_export",
    "test_serving_paged_cache", "test_mtp_engine", "test_config", "test_kv_quant", "test_lora",
    "test_structured_schemas", "test_attention_kernels", "test_lm_loss", "test_no_hang",
    "test_eval_sets", "test_evaluate", "test_ops_softcap_yarn", "test_data_shards",
    "test_legacy_run", "test_tokenizer", "test_faults_engine", "test_faults_serve",
    "test_data_build")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's --loadscope-reorder
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: modules intact


def pytest_sessionfinish(session, exitstatus):
    if _RUN_CACHE is not None and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(_RUN_CACHE, ignore_errors=True)
