"""The Pallas paged-attention kernels behind ``attention_impl="pallas"``
(``ops/paged_attention.py``): each equals the paged cache's gather reference on this CPU, and
lowers for its backend.

- The Triton kernel (GPU decode) and the Mosaic TPU paged kernel (TPU decode) run in Pallas
  interpret mode (``kernel_target(..., interpret=True)``), called through ``PagedKVCache.attend``
  as the model calls it, over page sizes, prior lengths, GQA / MQA / MHA, key layouts and
  stacked or unrolled layers.
- The TPU ragged kernel (TPU prefill chunks and windowed decode) does not run in interpret mode
  with jax 0.10.2: its adapter's operands (``ragged_inputs``) are checked with the pure-jnp
  ``ref_ragged_paged_attention`` JAX ships beside it, and the kernel itself by lowering.
- Every kernel lowers for its backend from this CPU (``jax.export``), through ``attend``.
- The engine, its decode steps on the interpreted Triton kernel, gives ``generate``'s tokens.
"""

import contextlib
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, random_params, run_until_idle
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from transformer_jax.decode import generation
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.ops import paged_attention as pa
from transformer_jax.model.transformer import init_params
from transformer_jax.serving import Engine, SamplingParams, step
from transformer_jax.serving.page_pool import NULL_PAGE, pages_for
from transformer_jax.serving.paged_cache import PagedKVCache

B, S_MAX = 3, 24  # decode rows, positions a row may hold before its query
LAYER = 1

SMALL_BLOCKS = dict(GPU_PAGES_PER_BLOCK=2, GPU_MIN_BLOCK_KEYS=1, GPU_MAX_SPLITS=2,
                    TPU_BLOCK_POSITIONS=4)
#: The structure of a case (compiled once per kernel); the data vary under hypothesis.
STRUCTURES = {
    # Small kernel blocks: each row's pages in several blocks (and Triton partitions).
    "page2-gqa-scan-blocks": dict(page_size=2, heads=(4, 2), scan=True, blocks=SMALL_BLOCKS),
    "page4-mqa": dict(page_size=4, heads=(4, 1), scan=False, blocks={}),
    "page8-mha": dict(page_size=8, heads=(2, 2), scan=False, blocks={}),
}
#: kernel -> the backend it is interpreted for.
INTERPRETED = {"gpu_paged": "gpu", "tpu_paged": "tpu"}


def _config(n_heads, n_kv_heads, scan_layers, **fields):
    fields = dict(dict(head_dim=8), **fields)
    return ModelConfig(vocab_size=16, d_model=8 * n_heads, n_layers=2, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, d_ff=16, max_seq_len=64,
                       scan_layers=scan_layers, **fields)


def _table(rng, lengths, page_size, width, num_pages):
    """Each row's pages (only those its positions fill) in a random order of the pool."""
    order = rng.permutation(np.arange(1, num_pages))
    table = np.full((len(lengths), width), NULL_PAGE, np.int32)
    for row, length in enumerate(lengths):
        used = pages_for(length, page_size)
        table[row, :used] = order[row * width:row * width + used]
    return table


_RUNS: dict = {}


def _decode_fn(structure, kernel):
    """The jitted pair (kernel, gather reference) of one structure: rows write their earlier
    positions and a decode token, then attend it through ``attend``."""
    if (structure, kernel) in _RUNS:
        return _RUNS[structure, kernel]
    s = STRUCTURES[structure]
    config = _config(*s["heads"], s["scan"])
    # Wider than any row needs, a power of two (as the engine's tables).
    width = 1 << pages_for(S_MAX + 1, s["page_size"]).bit_length()
    num_pages = 1 + B * width

    @jax.jit
    def run(table, prior, pk, pv, q, k, v):
        cache = PagedKVCache.init(config, num_pages, s["page_size"]).with_table(table, prior)
        cache = cache.write(LAYER, pk, pv, jnp.broadcast_to(jnp.arange(S_MAX), (B, S_MAX)))
        positions = prior[:, None]
        # The block sizes are read when the kernel is traced, i.e. here.
        blocks = mock.patch.multiple(pa, **s["blocks"]) if s["blocks"] else \
            contextlib.nullcontext()
        with pa.kernel_target(INTERPRETED[kernel], interpret=True), blocks:
            assert pa.plan("pallas", 1, None).kernel == kernel
            got, _ = cache.attend(LAYER, q, k, v, positions, window=None, impl="pallas")
        want, _ = cache.replace(view="gather").attend(LAYER, q, k, v, positions, window=None,
                                                      impl="xla")
        return got, want

    _RUNS[structure, kernel] = (run, config, width, num_pages)
    return _RUNS[structure, kernel]


@pytest.mark.parametrize("kernel", INTERPRETED)
@pytest.mark.parametrize("structure", STRUCTURES)
@settings(max_examples=2, deadline=None)
@given(prior=st.lists(st.integers(0, S_MAX), min_size=B, max_size=B),
       seed=st.integers(0, 2 ** 16))
def test_interpreted_decode_kernel_equals_gather_reference(structure, kernel, prior, seed):
    """Rows with their own lengths (pages in a random order of the pool, a table wider than
    needed) decode one token: the kernel, interpreted, gives the gather view's output."""
    run, config, width, num_pages = _decode_fn(structure, kernel)
    kv, n, h = config.n_kv_heads, config.n_heads, config.head_dim
    rng = np.random.default_rng(seed)
    table = _table(rng, [p + 1 for p in prior], STRUCTURES[structure]["page_size"], width,
                   num_pages)

    def normal(*shape):
        # The TPU kernel reads pages as bfloat16 (its loader casts them): values that bfloat16
        # holds exactly keep the comparison at float32 precision.
        # (numpy's bfloat16, ml_dtypes': eager casts of device arrays compile a program each)
        return rng.normal(size=shape).astype(jnp.bfloat16).astype(np.float32)

    got, want = run(table, np.asarray(prior, np.int32), normal(B, S_MAX, kv, h),
                    normal(B, S_MAX, kv, h), normal(B, 1, n, h), normal(B, 1, kv, h),
                    normal(B, 1, kv, h))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size, heads, window, chunk", [
    (4, (4, 2), None, 6),  # a prefill chunk, right-padded past the row's pages
    (2, (4, 1), 5, 6),  # with a sliding window
    (8, (2, 2), 3, 1),  # windowed decode rows
])
def test_ragged_operands_give_the_gather_reference(page_size, heads, window, chunk):
    """The ragged kernel's operands (``ragged_inputs``: interleaved kv pages, lengths, padded
    table, cumulative query lengths), fed to JAX's pure-jnp ``ref_ragged_paged_attention``, give
    the gather view's output at every real query (the kernel itself only lowers here)."""
    config = _config(*heads, False)
    kv, n, h = config.n_kv_heads, config.n_heads, config.head_dim
    rng = np.random.default_rng(page_size)
    prior = np.asarray([0, 9, S_MAX - chunk], np.int32)
    real = np.asarray([chunk, max(chunk - 2, 1), chunk])  # real tokens of each row's chunk
    width = pages_for(S_MAX, page_size)
    num_pages = 1 + B * width
    table = _table(rng, prior + real, page_size, width, num_pages)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    positions = jnp.asarray(prior[:, None] + np.arange(chunk), jnp.int32)

    @jax.jit
    def run(pk, pv, q, k, v):
        cache = PagedKVCache.init(config, num_pages, page_size)
        cache = cache.with_table(table, prior)
        cache = cache.write(LAYER, pk, pv, jnp.broadcast_to(jnp.arange(S_MAX), (B, S_MAX)))
        want, written = cache.replace(view="gather").attend(LAYER, q, k, v, positions,
                                                            window=window, impl="xla")
        return want, pa.ragged_inputs(q, written.k[LAYER], written.v[LAYER], table, positions)

    want, (queries, kv_pages, *meta) = run(
        normal(B, S_MAX, kv, h), normal(B, S_MAX, kv, h), normal(B, chunk, n, h),
        normal(B, chunk, kv, h), normal(B, chunk, kv, h))
    # The reference loops over the sequences in Python: their lengths must be concrete.
    meta = [np.asarray(x) for x in meta]
    got = jax.jit(lambda q, kv: ref_ragged_paged_attention(
        q, kv, *meta, sm_scale=h ** -0.5, sliding_window=window))(queries, kv_pages)
    got = got.reshape(B, chunk, n, h)
    for row in range(B):
        np.testing.assert_allclose(np.asarray(got[row, :real[row]]),
                                   np.asarray(want[row, :real[row]]), rtol=1e-5, atol=1e-5)


# Lowering ----------------------------------------------------------------------------------------

#: (target backend, export platform, T, window, custom call, the kernel's name in the module)
LOWERINGS = {
    "gpu_paged": ("gpu", "cuda", 1, None, "__gpu$xla.gpu.triton", "paged_attention_block_h"),
    "tpu_paged": ("tpu", "tpu", 1, None, "tpu_custom_call", "paged_flash_attention_kernel"),
    "tpu_ragged": ("tpu", "tpu", 16, None, "tpu_custom_call", "ragged_paged_attention_kernel"),
    "tpu_ragged-window-decode": ("tpu", "tpu", 1, 64, "tpu_custom_call",
                                 "ragged_paged_attention_kernel"),
}


@pytest.mark.parametrize("case", LOWERINGS)
def test_kernel_lowers_for_its_backend(case):
    """Exported from this CPU for its platform through ``attend`` (bfloat16, head dim 128,
    pages of 16, GQA 8/2, as on an accelerator): the step's attention is the kernel's call."""
    backend, platform, t, window, call, name = LOWERINGS[case]
    config = _config(8, 2, False, head_dim=128, dtype="bfloat16")
    b, w, ps, num_pages = 4, 8, 16, 33
    cache = PagedKVCache.init(config, num_pages, ps)

    def attend(k_pages, v_pages, table, q, k, v, start):
        paged = PagedKVCache(k=k_pages, v=v_pages, page_table=table, lengths=start)
        positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)
        with pa.kernel_target(backend):
            return paged.attend(0, q, k, v, positions, window=window, impl="pallas")

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    args = (cache.k, cache.v, spec((b, w), jnp.int32), spec((b, t, 8, 128)),
            spec((b, t, 2, 128)), spec((b, t, 2, 128)), spec((b,), jnp.int32))
    with _tpu_device() if platform == "tpu" else contextlib.nullcontext():
        exported = jax.export.export(
            jax.jit(attend), platforms=[platform],
            # Triton calls carry no serialisation compatibility guarantee; this only lowers.
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(call)])(*args)
    module = exported.mlir_module()
    assert set(re.findall(r"custom_call @([\w$.]+)", module)) == {call}
    assert name in module


def _tpu_device():
    """The Mosaic lowering asks the device's kind (a CPU has none): an abstract TPU v5e."""
    return use_abstract_mesh(AbstractMesh((1,), ("x",),
                                          abstract_device=AbstractDevice("TPU v5 lite", 1, "tpu")))


def test_engine_step_lowers_for_tpu_with_the_kernels():
    """The engine's whole step (the model's forward over the paged cache, then sampling),
    exported for TPU with ``attention_impl="pallas"``: the decode rows call the paged kernel and
    the prefill chunk the ragged one."""
    config = ModelConfig(vocab_size=64, d_model=128, n_layers=1, n_heads=4, n_kv_heads=2,
                         head_dim=128, d_ff=64, max_seq_len=256, dtype="bfloat16",
                         attention_impl="pallas")
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    b, w, ps, c = 4, 8, 16, 32
    k_pages = jax.eval_shape(lambda: PagedKVCache.init(config, 33, ps))
    i32 = jnp.int32
    decode_rows = step.DecodeRows(*(jax.ShapeDtypeStruct(s, i32) for s in ((b,), (b,), (b, w))))
    chunk = step.PrefillChunk(*(jax.ShapeDtypeStruct(s, i32) for s in ((1, c), (1,), (1, w),
                                                                       (1,))))
    rows = b + 1
    f32, u32 = jnp.float32, jnp.uint32
    sampling = step.RowSampling(*(jax.ShapeDtypeStruct(s, d) for s, d in (
        ((rows, 2), u32), ((rows,), i32), ((rows,), f32), ((rows,), i32), ((rows,), f32),
        ((rows,), f32))))
    with pa.kernel_target("tpu"), _tpu_device():
        exported = jax.export.export(
            jax.jit(step.engine_step, static_argnames=step.STEP_STATIC_ARGNAMES),
            platforms=["tpu"])(config, params, k_pages.k, k_pages.v, decode_rows, chunk,
                               sampling, sampler=step.Sampler())
    module = exported.mlir_module()
    assert "paged_flash_attention_kernel" in module
    assert "ragged_paged_attention_kernel" in module


def test_pallas_needs_a_backend_with_a_paged_kernel():
    config = _config(4, 2, False)
    cache = PagedKVCache.init(config, 4, 2).with_table(np.ones((1, 1), np.int32), np.zeros(1))
    q, k = jnp.zeros((1, 1, 4, 8)), jnp.zeros((1, 1, 2, 8))
    with pytest.raises(ValueError, match="'pallas' over a paged cache cannot run on backend "
                                         "'cpu'"):
        jax.eval_shape(lambda: cache.attend(0, q, k, k, jnp.zeros((1, 1), jnp.int32),
                                            window=None, impl="pallas"))
    with pytest.raises(ValueError, match="backend must be one of .* got 'cpu'"):
        with pa.kernel_target("cpu"):
            pass


def test_tpu_kernels_only_for_head_dims_they_compile():
    # Compiled for a TPU (jax 0.10.2), both kernels refuse H = 64 (tests/test_tpu_compile.py
    # compiles them at 128): the XLA views instead; interpreted, the paged kernel runs any H.
    with pa.kernel_target("tpu"):
        assert [pa.plan("pallas", t, None, h).kernel for t in (1, 16) for h in (64, 128, 256)
                ] == [None, "tpu_paged", "tpu_paged", None, "tpu_ragged", "tpu_ragged"]
    with pa.kernel_target("tpu", interpret=True):  # the ragged kernel does not interpret: XLA
        assert [pa.plan("pallas", t, None, 64) for t in (1, 16)] == [
            pa.Plan("tpu_paged", "pallas"), pa.Plan(None, "xla")]


# The engine on the kernel ------------------------------------------------------------------------

@pytest.mark.usefixtures("fast_generate_compiles")
def test_engine_on_the_interpreted_triton_kernel_gives_generates_tokens():
    """Greedy requests served with ``attention_impl="pallas"``, every decode step on the Triton
    paged kernel in interpret mode (prefill chunks on the gather view): ``generate``'s tokens."""
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=8, d_ff=48, max_seq_len=64, init_std=0.2)
    # Drawn with numpy from the shapes (helpers.random_params): no init program compiles.
    params = jax.device_put(random_params(config, seed=0))
    prompts = [[5, 9, 2, 33, 7, 1, 60], [12, 4]]
    new = 5
    engine = Engine(config.replace(attention_impl="pallas"), params, num_slots=2,
                    num_pages=9, page_size=4, token_budget=10, min_context=16)
    original = step.step_jit
    step.step_jit = step.jit_step(compiler_options=FAST_COMPILE)
    try:
        with pa.kernel_target("gpu", interpret=True):
            ids = [engine.add_request(p, SamplingParams(max_tokens=new)) for p in prompts]
            done = run_until_idle(engine)
    finally:
        step.step_jit = original
    engine.check_no_leaks()
    want = generation.generate(config, params, prompts, max_new_tokens=new).tokens
    assert [done[rid].tokens for rid in ids] == want
