"""Llama 4 text (``llama4_text``) against transformers: a tiny random ``Llama4ForCausalLM``
written by ``save_pretrained`` loads with its logits (chunked layers, a NoPE layer with the
query temperature, the weightless QK-norm, MoE layers interleaved with dense ones, the
input-scaled top-1 experts and the shared expert), each feature moves them, export reads back
in transformers, greedy generation equals transformers', and the chunked layers' cache holds
only their chunk."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from helpers import LoadedHF, jit_logits, ragged_inputs, run_until_idle

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformer_jax import hf  # noqa: E402
from transformer_jax.decode import generation  # noqa: E402
from transformer_jax.decode import loop as decode  # noqa: E402
from transformer_jax.model.fields import MoE  # noqa: E402
from transformer_jax.model.kv_cache import KVCache  # noqa: E402
from transformer_jax.serving import Engine, SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_generate_compiles", "fast_engine_compiles")

B, T, V, D, H, F, F_MLP = 2, 12, 97, 32, 8, 16, 24
CHUNK, FLOOR = 4, 2  # a chunk shorter than T; a temperature that changes every 2 positions
TOL = 1e-4
INPUTS = ragged_inputs(B, T, V)  # the second row starts at position 300 (a chunk boundary)


def random_llama4(seed: int = 0):
    """Tiny Llama4ForCausalLM (eager attention, unit-scale random weights): layers 0 and 2
    chunked with RoPE and QK-norm and dense, layers 1 and 3 NoPE, global and sparse."""
    torch.manual_seed(seed)
    config = transformers.Llama4TextConfig(
        vocab_size=V, hidden_size=D, intermediate_size=F, intermediate_size_mlp=F_MLP,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=H,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
        no_rope_layer_interval=2,
        attention_chunk_size=CHUNK, floor_scale=FLOOR, attn_scale=0.1,
        max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
        attn_implementation="eager")
    model = transformers.Llama4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, p.shape[-2 if "experts" in name else -1] ** -0.5)
    return model


def hf_logits(model, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """transformers' logits, each row at its own start position p: run behind p masked
    padding tokens (transformers' query temperature and chunks count the cache's slots)."""
    rows = []
    for row, pos in zip(tokens, positions, strict=True):
        pad = int(pos[0])
        ids = torch.tensor([[0] * pad + row.tolist()])
        mask = torch.tensor([[0] * pad + [1] * len(row)])
        with torch.no_grad():
            out = model(ids, attention_mask=mask, position_ids=torch.arange(pad + len(row))[None])
        rows.append(out.logits[0, pad:].float().numpy())
    return np.stack(rows)


def _logits(config, params, tokens=INPUTS[0], positions=INPUTS[1]) -> np.ndarray:
    return jit_logits(config, params, tokens, positions)


Loaded = LoadedHF


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> Loaded:
    model = random_llama4()
    path = tmp_path_factory.mktemp("llama4")
    model.save_pretrained(path)
    config, params = hf.load(path)
    return Loaded(model, path, hf_logits(model, *INPUTS), config, params)


def test_config_reads_every_feature(llama4):
    c = llama4.config
    assert c.moe == MoE(n_experts=4, top_k=1, d_ff=F, renormalize=False, shared_d_ff=F,
                        sparse_step=2, score="sigmoid", scale_input=True)
    assert (c.d_ff, c.rope_pairing, c.qk_norm) == (F_MLP, "adjacent", "weightless")
    assert c.layer_pattern == ("chunked", "global")
    assert (c.attention_chunk, c.nope_layers) == (CHUNK, (1, 3))
    assert (c.nope_temperature_floor, c.nope_temperature_scale) == (FLOOR, 0.1)
    assert c.sparse_layers == (1, 3)


@pytest.fixture(scope="module")
def scanned(llama4):
    """The checkpoint loaded as the scanned stack: (config, params)."""
    return hf.load(llama4.path, scan_layers=True)


@pytest.mark.parametrize("scan", [False, True])
def test_logits_match_transformers(llama4, scanned, scan):
    config, params = scanned if scan else (llama4.config, llama4.params)
    diff = float(np.max(np.abs(_logits(config, params) - llama4.logits)))
    assert diff <= TOL, diff


def _without(params, *names):
    """params with the named leaves (at any depth) dropped."""
    if not isinstance(params, dict):
        return params
    return {k: _without(v, *names) for k, v in params.items() if k not in names}


@pytest.mark.parametrize("change", ["chunks", "nope", "temperature", "qk_norm", "scale_input",
                                    "shared_expert"])
def test_each_feature_moves_the_logits(llama4, change):
    c, p = llama4.config, llama4.params
    config, params = {
        "chunks": (c.replace(layer_pattern=(), attention_chunk=None), p),
        "nope": (c.replace(nope_layers=(), nope_temperature_floor=None), p),
        "temperature": (c.replace(nope_temperature_floor=None), p),
        "qk_norm": (c.replace(qk_norm=None), p),
        "scale_input": (c.replace(moe=dataclasses.replace(c.moe, scale_input=False)), p),
        "shared_expert": (c.replace(moe=dataclasses.replace(c.moe, shared_d_ff=0)),
                          _without(p, "shared")),
    }[change]
    assert float(np.max(np.abs(_logits(config, params) - llama4.logits))) > 1e-2


def test_export_reads_back_in_transformers(llama4, tmp_path):
    hf.save(llama4.config, llama4.params, tmp_path)
    saved = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    assert (saved["model_type"], saved["architectures"]) == ("llama4_text",
                                                             ["Llama4ForCausalLM"])
    reread = transformers.Llama4ForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    theirs, mine = llama4.model.state_dict(), reread.state_dict()
    assert theirs.keys() == mine.keys()
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0, msg=key)
    # The same tensors give transformers the same logits, bit for bit (ours against them:
    # test_logits_match_transformers; a 1e-5 bound between two frameworks' float orders held
    # here by a factor of 2 only).
    np.testing.assert_array_equal(hf_logits(reread, *INPUTS), llama4.logits)
    assert hf.load(tmp_path)[0] == llama4.config


PROMPTS = [np.random.default_rng(3).integers(1, V, n).tolist() for n in (3, 7)]
NEW = 7  # past the prompts' chunks


def test_greedy_generation_equals_transformers(llama4):
    """Prefill + cached decode (the chunk rings, the NoPE layers' temperature) on ragged
    prompts, generating across chunk boundaries; transformers runs each prompt alone (its
    temperature counts left padding as positions)."""
    ours = generation.generate(llama4.config, llama4.params, PROMPTS, max_new_tokens=NEW)
    for prompt, tokens in zip(PROMPTS, ours.tokens, strict=True):
        with torch.no_grad():
            out = llama4.model.generate(torch.tensor([prompt]), max_new_tokens=NEW,
                                        do_sample=False, pad_token_id=0, eos_token_id=None)
        assert out[0, len(prompt):].tolist() == tokens


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_chunk_mask_equals_numpy(impl):
    """``attention(chunk=C)`` against a numpy softmax over the mask ``n <= m``,
    ``n // C == m // C`` (and equal packed segments)."""
    from transformer_jax.model.ops.attention import attention

    rng = np.random.default_rng(0)
    b, t, n, k, h, c = 2, 10, 4, 2, 8, 3
    q = rng.standard_normal((b, t, n, h)).astype(np.float32)
    keys, values = (rng.standard_normal((b, k, t, h)).astype(np.float32) for _ in range(2))
    pos = np.stack([np.arange(t), np.r_[np.arange(6), np.arange(4)] + 5]).astype(np.int32)
    seg = np.array([[1] * t, [1] * 6 + [2] * 4], np.int32)
    # Jitted (one program): op by op, the attention compiles a program per op.
    out = np.asarray(jax.jit(lambda q, k, v, pos, seg: attention(
        q, k, v, q_positions=pos, k_positions=pos, q_segments=seg, k_segments=seg, chunk=c,
        impl=impl))(q, keys, values, pos, seg))
    mask = ((pos[:, None, :] <= pos[:, :, None]) & (pos[:, None, :] // c == pos[:, :, None] // c)
            & (seg[:, None, :] == seg[:, :, None]))  # [B, T, S]
    kv = np.repeat(keys, n // k, axis=1), np.repeat(values, n // k, axis=1)
    logits = np.einsum("btnh,bnsh->bnts", q, kv[0]) / np.sqrt(h)
    logits = np.where(mask[:, None], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("bnts,bnsh->btnh", probs / probs.sum(-1, keepdims=True), kv[1])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_chunked_layers_cache_only_their_chunk(llama4):
    cache = KVCache.init(llama4.config, batch=2, max_len=64)
    assert cache.ring is not None and cache.ring.local == (True, False, True, False)
    rings = jax.tree.leaves((cache.k_local, cache.v_local))
    full = jax.tree.leaves((cache.k, cache.v))
    assert len(rings) == 4 and all(x.shape[-2] == CHUNK or x.shape[-1] == CHUNK
                                   for x in rings)
    assert len(full) == 4 and all(64 in x.shape for x in full)


def test_engine_equals_generate(llama4, scanned):
    """The serving engine on the scanned stack (chunk rings per slot found by ``LayerRef``,
    paged NoPE layers, decode across chunks, a pool small enough to preempt) gives each
    prompt what generate gives it."""
    config, params = scanned
    engine = Engine(config, decode.prepare(config, params), num_slots=2, num_pages=5,
                    page_size=4, token_budget=6, min_context=16)
    ids = [engine.add_request(p, SamplingParams(max_tokens=NEW)) for p in PROMPTS]
    done = run_until_idle(engine)
    want = generation.generate(llama4.config, llama4.params, PROMPTS, max_new_tokens=NEW)
    assert [done[rid].tokens for rid in ids] == want.tokens
    assert engine.scheduler.preemptions > 0
    engine.check_no_leaks()


@pytest.mark.parametrize("name, total, active", [
    # transformers' Llama4ForCausalLM built on the meta device from each preset's config.json:
    # the text models of Llama-4-Scout-17B-16E (published 109B with its vision tower, 17B
    # active) and Llama-4-Maverick-17B-128E (400B, 17B active).
    ("llama4_scout", 107_769_861_120, 17_172_894_720),
    ("llama4_maverick", 400_711_848_960, 17_184_691_200),
])
def test_presets_have_the_published_parameter_counts(name, total, active):
    from transformer_jax.model.config import ModelConfig
    from transformer_jax.train.perf import param_counts

    config = ModelConfig.preset(name)
    assert param_counts(config) == (total, active)
    assert hf.config_to_hf(config)["model_type"] == "llama4_text"


@pytest.mark.parametrize("changes, message", [
    (dict(attention_chunk=4, sliding_window=8), "attention_chunk and sliding_window"),
    (dict(layer_pattern=("chunked", "global")), "attention_chunk is not set"),
    (dict(attention_chunk=0), "attention_chunk"),
    (dict(nope_layers=(4,)), "nope_layers"),
    (dict(nope_temperature_floor=8), "needs nope_layers"),
    (dict(moe=dict(n_experts=4, top_k=2, d_ff=8, scale_input=True)), "scale_input needs"),
])
def test_bad_fields_are_refused_in_one_line(changes, message):
    from transformer_jax.model.config import ModelConfig

    with pytest.raises(ValueError, match=message) as info:
        ModelConfig(n_layers=4, **changes)
    assert "\n" not in str(info.value)


def test_llama3_rope_with_equal_factors_equals_transformers():
    """Scout's RoPE scaling (llama3, factor 16, low and high frequency factors both 1: no
    ramp) against transformers' frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from transformer_jax.model.ops import rope_frequencies
    from transformer_jax.model.ops.positions import RopeScaling

    rope = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
            "high_freq_factor": 1.0, "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0}
    config = transformers.Llama4TextConfig(head_dim=128, hidden_size=256,
                                           num_attention_heads=2, rope_parameters=rope)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_frequencies(128, 500000.0, RopeScaling("llama3", 16.0, low_freq_factor=1.0,
                                                       high_freq_factor=1.0))
    np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), rtol=1e-6)
    plain = np.asarray(rope_frequencies(128, 500000.0))
    divided = np.isclose(np.asarray(ours), plain / 16.0, rtol=1e-6)
    assert divided.any() and not divided.all()  # the long wavelengths only


def test_text_model_of_a_vision_checkpoint_loads(llama4, tmp_path):
    """A ``Llama4ForConditionalGeneration`` directory (a tiny vision tower beside the text
    model's weights) loads as its text model: the config and params of the text checkpoint."""
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32, image_size=28, patch_size=14, vision_output_dim=16,
                  projector_input_dim=16, projector_output_dim=16, pixel_shuffle_ratio=0.5)
    config = transformers.Llama4Config(text_config=llama4.model.config.to_dict(),
                                       vision_config=vision)
    model = transformers.Llama4ForConditionalGeneration(config)
    model.language_model.load_state_dict(llama4.model.state_dict(), strict=True)
    model.save_pretrained(tmp_path)
    loaded, params = hf.load(tmp_path)
    assert loaded == llama4.config
    jax.tree.map(np.testing.assert_array_equal, params, llama4.params)
