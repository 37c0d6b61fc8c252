"""DeepSeek-V3's multi-head latent attention (``deepseek_v3``, ``fields.MLA``) against
transformers: tiny random all-dense ``DeepseekV3ForCausalLM`` checkpoints written by
``save_pretrained`` (the query's low rank set and unset, interleaved and half RoPE pairs, YaRN
with ``mscale_all_dim``) and one with 2 dense then 2 mixture-of-experts layers (grouped sigmoid
routing with a non-zero correction bias, shared experts) load with their logits, unrolled and
scanned; each feature moves them; export reads back in transformers; greedy generation equals
transformers'; the cached decode (attention over the latents, the up-projections absorbed)
equals the cacheless forward; the cache holds kv_lora_rank + qk_rope_head_dim values per token
per layer, in generate and in the serving engine's pages (the engine equals generate with
preemption); the presets' active counts; LoRA on the latent projections."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FAST_COMPILE,
    LoadedHF,
    jit_logits,
    ragged_inputs,
    run_until_idle,
    spread_torch_params,
    torch_logits,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformer_jax import hf  # noqa: E402
from transformer_jax.decode import generation  # noqa: E402
from transformer_jax.model.fields import MLA, MoE  # noqa: E402
from transformer_jax.model.kv_cache import KVCache, cache_bytes  # noqa: E402
from transformer_jax.model.ops import latent_attention  # noqa: E402
from transformer_jax.model.transformer import Transformer  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_generate_compiles")

B, T, V, D, L = 2, 10, 97, 32, 2
R, NOPE, P, VD, Q = 16, 8, 4, 6, 12  # kv_lora_rank, qk_nope, qk_rope, v_head_dim, q_lora_rank
TOL = 1e-4
INPUTS = ragged_inputs(B, T, V)  # the second row starts at 300: past YaRN's original length
# 2 dense then 2 sparse layers: 8 experts in 4 groups, each token's 2 within its 2 best groups.
MOE = dict(num_hidden_layers=4, first_k_dense_replace=2, n_routed_experts=8,
           num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=16,
           n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True)
VARIANTS = {"q_lora": dict(q_lora_rank=Q, rope_interleave=True),
            "q_proj": dict(q_lora_rank=None, rope_interleave=False),
            "moe": dict(q_lora_rank=Q, rope_interleave=True, **MOE)}
DENSE = ("q_lora", "q_proj")


def random_deepseek(q_lora_rank, rope_interleave, seed=0, **moe):
    """Tiny DeepseekV3ForCausalLM (all dense, first_k_dense_replace = L, unless ``moe`` keys
    are given), eager attention, unit-scale random weights, YaRN with mscale and
    mscale_all_dim; a random correction bias (a buffer) on the sparse layers."""
    torch.manual_seed(seed)
    kw = dict(num_hidden_layers=L, first_k_dense_replace=L) | moe
    config = transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=D, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=R, q_lora_rank=q_lora_rank,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=P, v_head_dim=VD,
        rope_interleave=rope_interleave, max_position_embeddings=1024,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=256, mscale=0.8,
                             mscale_all_dim=0.6),
        attn_implementation="eager", **kw)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    spread_torch_params(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model


def _logits(config, params, tokens=INPUTS[0], positions=INPUTS[1]) -> np.ndarray:
    return jit_logits(config, params, tokens, positions)


Loaded = LoadedHF


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> dict[str, Loaded]:
    out = {}
    for name, kw in VARIANTS.items():
        model = random_deepseek(**kw)
        path = tmp_path_factory.mktemp(f"deepseek_{name}")
        model.save_pretrained(path)
        config, params = hf.load(path)
        out[name] = Loaded(model, path, torch_logits(model, *INPUTS), config, params)
    return out


def test_config_reads_every_feature(deepseek):
    for name in DENSE:
        kw = VARIANTS[name]
        c = deepseek[name].config
        assert c.mla == MLA(kv_lora_rank=R, qk_nope_head_dim=NOPE, qk_rope_head_dim=P,
                            v_head_dim=VD, q_lora_rank=kw["q_lora_rank"])
        assert c.rope_pairing == ("adjacent" if kw["rope_interleave"] else "half")
        assert c.rope_scaling.kind == "yarn" and c.rope_scaling.mscale_all_dim == 0.6
        assert set(c.layer_kinds()) == {"latent"} and c.moe is None


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("scan", [False, True])
def test_logits_match_transformers(deepseek, variant, scan):
    d = deepseek[variant]
    config, params = hf.load(d.path, scan_layers=True) if scan else (d.config, d.params)
    diff = float(np.max(np.abs(_logits(config, params) - d.logits)))
    assert diff <= TOL, diff


def test_moe_config_reads_the_routing(deepseek):
    c = deepseek["moe"].config
    assert c.moe == MoE(n_experts=8, top_k=2, d_ff=16, renormalize=True, shared_d_ff=32,
                        score="sigmoid", correction_bias=True, n_groups=4, top_groups=2,
                        routed_scale=2.5, dense_layers=(0, 1))
    assert [c.moe.is_sparse(i) for i in range(4)] == [False, False, True, True]
    # Scanned: the dense layers and the sparse ones are two groups of two repeats.
    groups = c.replace(scan_layers=True).layer_groups()
    assert [(g.start, [s.ffn for s in g.period], g.repeats) for g in groups] == [
        (0, ["dense"], 2), (2, ["moe"], 2)]
    _, scanned = hf.load(deepseek["moe"].path, scan_layers=True)
    assert "moe" in scanned["scan_1"] and "mlp" in scanned["scan_0"], list(scanned)
    bias = scanned["scan_1"]["moe"]["correction_bias"]
    assert bias.shape == (2, 8) and bias.dtype == jnp.float32
    want = [deepseek["moe"].model.model.layers[i].mlp.gate.e_score_correction_bias.numpy()
            for i in (2, 3)]
    np.testing.assert_array_equal(np.asarray(bias), np.stack(want))


@pytest.mark.parametrize("change", ["pairing", "mscale_all_dim", "yarn", "correction_bias",
                                    "groups"])
def test_each_feature_moves_the_logits(deepseek, change):
    d = deepseek["moe" if change in MOE_CHANGES else "q_lora"]
    c, params = d.config, d.params
    if change == "correction_bias":
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: jnp.zeros_like(x) if "correction_bias" in jax.tree_util.keystr(path)
            else x, params)
    config = {
        "pairing": c.replace(rope_pairing="half"),
        "mscale_all_dim": c.replace(
            rope_scaling=dataclasses.replace(c.rope_scaling, mscale_all_dim=None)),
        "yarn": c.replace(rope_scaling=None),
        "groups": c.moe and c.replace(moe=dataclasses.replace(c.moe, top_groups=4)),
        "correction_bias": c,
    }[change]
    assert float(np.max(np.abs(_logits(config, params) - d.logits))) > 1e-2


MOE_CHANGES = ("correction_bias", "groups")


@pytest.mark.parametrize("variant", ["q_lora", "moe"])
def test_export_reads_back_in_transformers(deepseek, tmp_path, variant):
    d = deepseek[variant]
    hf.save(d.config, d.params, tmp_path)
    saved = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    assert (saved["model_type"], saved["architectures"]) == (
        "deepseek_v3", ["DeepseekV3ForCausalLM"])
    reread = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    theirs, mine = d.model.state_dict(), reread.state_dict()
    assert theirs.keys() == mine.keys()
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0, msg=key)
    # The same tensors give transformers the same logits, bit for bit (ours against them:
    # test_logits_match_transformers, within TOL).
    np.testing.assert_array_equal(torch_logits(reread, *INPUTS), d.logits)
    assert hf.load(tmp_path)[0] == d.config


def test_moe_export_refuses_what_the_family_cannot_hold_in_one_line(deepseek):
    c = deepseek["moe"].config
    for moe, message in [(dict(dense_layers=(1,)), "dense layers first"),
                         (dict(dense_layers=()), None),
                         (dict(shared_d_ff=24), "not a multiple"),
                         (dict(correction_bias=False), "moe.correction_bias=True")]:
        config = c.replace(moe=dataclasses.replace(c.moe, **moe))
        if message is None:  # every layer sparse: first_k_dense_replace 0
            assert hf.config_to_hf(config)["first_k_dense_replace"] == 0
            continue
        with pytest.raises(ValueError, match=message) as e:
            hf.config_to_hf(config, "deepseek_v3")
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generation_equals_transformers(deepseek, variant):
    """Prefill (expanded) + cached decode (absorbed) on ragged, left-padded prompts."""
    d = deepseek[variant]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, V, n).tolist() for n in (3, 7)]
    new = 6
    ours = generation.generate(d.config, d.params, prompts, max_new_tokens=new)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = d.model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
    assert [out[i, width:].tolist() for i in range(len(prompts))] == ours.tokens


def test_absorbed_decode_equals_the_expanded_forward(deepseek):
    """A 4-token prefill then one-token steps through the scanned model's stacked latent cache
    (generate covers the unrolled one's) give the cacheless forward's logits at every
    position; the cache holds R + P values per token per layer."""
    d = deepseek["q_lora"]
    config, params = hf.load(d.path, scan_layers=True)
    tokens = jnp.asarray(INPUTS[0])
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    model = Transformer(config)
    run = jax.jit(lambda p, t, pos, c=None: model.apply({"params": p}, t, positions=pos,
                                                        cache=c),
                  compiler_options=FAST_COMPILE)
    want = np.asarray(run(params, tokens, positions).logits)
    start, slots = 4, 16
    out = run(params, tokens[:, :start], positions[:, :start], KVCache.init(config, B, slots))
    got = [np.asarray(out.logits)]
    for t in range(start, T):
        out = run(params, tokens[:, t:t + 1], positions[:, t:t + 1], out.cache)
        got.append(np.asarray(out.logits))
    np.testing.assert_allclose(np.concatenate(got, 1), want, rtol=0, atol=1e-5)
    cache = out.cache
    per_token = sum(x.size for x in jax.tree.leaves(cache.latent)) // (B * slots * L)
    assert per_token == R + P  # not N * 2 * head widths
    assert sum(x.size for x in jax.tree.leaves((cache.k, cache.v))) == 0
    assert cache.nbytes == cache_bytes(config, B, slots) == L * B * slots * (R + P) * 4


def test_absorbed_equals_expanded_op():
    """The two orders of the products, on random entries with a causal mask."""
    rng = np.random.default_rng(0)
    n, s = 3, 9
    q_nope, q_rope = (jnp.asarray(rng.normal(size=(2, s, n, w)), jnp.float32)
                      for w in (NOPE, P))
    entries = jnp.asarray(rng.normal(size=(2, s, R + P)), jnp.float32)
    kv_b = jnp.asarray(rng.normal(size=(R, n, NOPE + VD)) / 4, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(s), (2, s))
    a, e = (jax.jit(lambda *x, f=f: f(*x, q_positions=pos, scale=0.3, impl="xla"),
                    compiler_options=FAST_COMPILE)(q_nope, q_rope, entries, kv_b)
            for f in (latent_attention.absorbed, latent_attention.expanded))
    # A textbook softmax over explicit per-head keys and values.
    k = np.concatenate([np.einsum("bsr,rnk->bnsk", entries[..., :R], kv_b[..., :NOPE]),
                        np.broadcast_to(np.asarray(entries[:, None, :, R:]), (2, n, s, P))], -1)
    v = np.einsum("bsr,rnv->bnsv", entries[..., :R], kv_b[..., NOPE:])
    q = np.concatenate([q_nope, q_rope], -1)
    logits = np.einsum("btnk,bnsk->bnts", q, k) * 0.3
    logits = np.where(np.tril(np.ones((s, s), bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("bnts,bnsv->btnv", w / w.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(np.asarray(e), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(a), want, rtol=1e-5, atol=1e-5)


def test_engine_equals_generate(deepseek):
    """The serving engine's latent pages (R + P values a token a layer), absorbed decode
    through them and expanded prefill chunks, on the scanned MoE model (stacked pages, as the
    presets' are) with a pool small enough to preempt: each prompt gets what the unrolled
    model's generate gives it."""
    from transformer_jax.decode import loop as decode
    from transformer_jax.serving import Engine, SamplingParams
    from transformer_jax.serving.paged_cache import page_bytes

    d = deepseek["moe"]
    config, params = hf.load(d.path, scan_layers=True)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, V, n).tolist() for n in (3, 7)]
    engine = Engine(config, decode.prepare(config, params), num_slots=2, num_pages=5,
                    page_size=4, token_budget=6, min_context=16)
    assert engine.cache_bytes == 5 * page_bytes(config, 4) == 5 * 4 * 4 * (R + P) * 4
    # 6 new tokens: the greedy test's generate (same prompts), one program for both.
    ids = [engine.add_request(p, SamplingParams(max_tokens=6)) for p in prompts]
    done = run_until_idle(engine)
    want = generation.generate(d.config, d.params, prompts, max_new_tokens=6)
    assert [done[rid].tokens for rid in ids] == want.tokens
    assert engine.scheduler.preemptions > 0
    engine.check_no_leaks()


def test_engine_refuses_int8_latent_pages_in_one_line(deepseek):
    from transformer_jax.serving import Engine

    d = deepseek["q_proj"]
    with pytest.raises(ValueError, match="latent attention") as e:
        Engine(d.config, d.params, num_slots=2, num_pages=8, page_size=4, token_budget=8,
               cache_dtype="int8")
    assert "\n" not in str(e.value)


def test_latent_attention_config_is_checked_in_one_line():
    from transformer_jax.model.config import ModelConfig

    mla = dict(kv_lora_rank=R, qk_nope_head_dim=NOPE, qk_rope_head_dim=P, v_head_dim=VD)
    base = dict(vocab_size=V, d_model=D, n_layers=L, n_heads=4, d_ff=48, mla=mla)
    config = ModelConfig(**base)
    assert (config.head_dim, config.n_kv_heads) == (P, 4)
    for extra, message in [(dict(sliding_window=4), "sliding_window"),
                           (dict(head_dim=8), "head_dim must be 4"),
                           (dict(n_kv_heads=2), "n_kv_heads must be 4"),
                           (dict(mla={**mla, "qk_rope_head_dim": 3}), "must be even"),
                           (dict(mla={**mla, "rank": 3}), "unknown model.mla option")]:
        with pytest.raises(ValueError, match=message) as e:
            ModelConfig(**{**base, **extra})
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="int8 is not supported"):
        KVCache.init(config, 1, 8, "int8")


@pytest.mark.parametrize("name, published", [("deepseek_v3", (671e9, 37e9)),
                                             ("kimi_k2", (1.0e12, 32e9))])
def test_presets_active_counts_and_export(name, published):
    """Total (transformers' count: tests/test_config.py) and active parameters: the total less
    the E - k routed experts a token does not use in each sparse layer; both within 3% of the
    published round figures; the preset exports as a deepseek_v3 checkpoint."""
    from transformer_jax.model.config import ModelConfig
    from transformer_jax.train.perf import param_counts

    c = ModelConfig.preset(name)
    m = c.moe
    total, active = param_counts(c)
    unused = len(c.sparse_layers) * (m.n_experts - m.top_k) * 3 * c.d_model * m.d_ff
    assert active == total - unused
    assert all(abs(ours / theirs - 1) < 0.03
               for ours, theirs in zip((total, active), published, strict=True))
    out = hf.config_to_hf(c)
    assert (out["model_type"], out["first_k_dense_replace"]) == (
        "deepseek_v3", len(m.dense_layers))
    assert hf.config_from_hf(out) == c.replace(scan_layers=False)


def test_lora_adapts_the_latent_projections(deepseek):
    """LoRA targets q_a/q_b/kv_a/kv_b (and o): adapter shapes per matrix, and the adapted
    model's logits equal those of the weights plus (alpha / r) A @ B computed with numpy."""
    from transformer_jax.model import lora

    d = deepseek["q_lora"]
    cfg = lora.LoraConfig(rank=2, alpha=4.0, targets=("q_a", "q_b", "kv_a", "kv_b", "o"))
    adapters = lora.init_adapters(d.config, cfg, d.params, jax.random.key(0))
    ab = adapters["blocks_1"]["attn"]
    assert {k: (v["a"].shape, v["b"].shape) for k, v in ab.items()} == {
        "q_a_proj": ((D, 2), (2, Q)), "q_b_proj": ((Q, 2), (2, 4, NOPE + P)),
        "kv_a_proj": ((D, 2), (2, R + P)), "kv_b_proj": ((R, 2), (2, 4, NOPE + VD)),
        "o_proj": ((4, VD, 2), (2, D))}
    rng = np.random.default_rng(1)
    adapters = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.3, x.dtype),
                            adapters)
    want = jax.tree.map(np.asarray, d.params)
    for block, mods in adapters.items():
        for name, f in mods["attn"].items():
            a, b = np.asarray(f["a"]), np.asarray(f["b"])
            w = want[block]["attn"][name]
            want[block]["attn"][name] = w + 2.0 * np.tensordot(a, b, axes=1)
    got = _logits(d.config, lora.apply_adapters(d.params, adapters, cfg))
    np.testing.assert_allclose(got, _logits(d.config, want), rtol=0, atol=1e-4)
    assert float(np.max(np.abs(got - d.logits))) > 1e-2


@pytest.mark.parametrize("field, value", [("sliding_window", 8), ("attention_chunk", 8),
                                          ("nope_layers", (1,)), ("attn_sinks", True),
                                          ("o_bias", True)])
def test_latent_attention_refuses_the_other_kinds_fields_in_one_line(field, value):
    from transformer_jax.model.config import ModelConfig

    mla = MLA(kv_lora_rank=R, qk_nope_head_dim=NOPE, qk_rope_head_dim=P, v_head_dim=VD)
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64)
    ModelConfig(**base, mla=mla)  # the plain latent model is accepted
    with pytest.raises(ValueError, match=f"mla .*cannot be combined with {field}"):
        ModelConfig(**base, mla=mla, **{field: value})
    with pytest.raises(ValueError, match="layer_pattern entry"):  # latent layers: only mla's
        ModelConfig(**base, layer_pattern=("latent",))
