"""GPT-OSS (``gpt_oss``) against transformers: a tiny random ``GptOssForCausalLM`` written by
``save_pretrained`` loads with its logits (sinks, q/k/v/o biases, sliding and full layers,
YaRN, the biased router and experts, the clamped SwiGLU), each feature moves them, export
reads back in transformers, and greedy generation equals transformers'."""

import dataclasses
import functools
import json

import numpy as np
import pytest
from helpers import FAST_COMPILE, LoadedHF, ragged_inputs, run_until_idle, torch_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformer_jax import hf  # noqa: E402
from transformer_jax.decode import generation  # noqa: E402
from transformer_jax.decode import loop as decode  # noqa: E402
from transformer_jax.model.fields import MoE  # noqa: E402
from transformer_jax.serving import Engine, SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_generate_compiles", "fast_engine_compiles")

B, T, V, D, H, F = 2, 12, 97, 32, 8, 16
WINDOW, LIMIT = 4, 1.0  # a window shorter than T; a clamp the unit-scale activations reach
TOL = 1e-4
INPUTS = ragged_inputs(B, T, V)  # the second row starts at position 300: past the window


def random_gpt_oss(seed: int = 0):
    """Tiny GptOssForCausalLM, eager attention, unit-scale random weights, sinks of std 1."""
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(
        vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=H, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=1024,
        swiglu_limit=LIMIT, attn_implementation="eager")
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
            elif p.ndim == 1 or name.endswith("_bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, p.shape[-2 if "experts" in name else -1] ** -0.5)
    return model


@functools.cache
def _forward(config):
    """The jitted forward ``(params, tokens, positions) -> logits`` of a config, one per
    config (the logits and export tests run one program)."""
    import jax

    from transformer_jax.model.transformer import Transformer

    return jax.jit(lambda p, t, pos: Transformer(config).apply({"params": p}, t,
                                                               positions=pos).logits,
                   compiler_options=FAST_COMPILE)


def _logits(config, params, tokens=INPUTS[0], positions=INPUTS[1]) -> np.ndarray:
    return np.asarray(_forward(config)(params, tokens, positions))


Loaded = LoadedHF


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Loaded:
    model = random_gpt_oss()
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path)
    config, params = hf.load(path)
    return Loaded(model, path, torch_logits(model, *INPUTS), config, params)


def test_config_reads_every_feature(gpt_oss):
    c = gpt_oss.config
    assert c.moe == MoE(n_experts=4, top_k=2, d_ff=F, router_bias=True, expert_bias=True)
    assert (c.attn_sinks, c.qkv_bias, c.o_bias) == (True, True, True)
    assert (c.sliding_window, c.layer_pattern) == (WINDOW, ("local", "global"))
    assert (c.swiglu_limit, c.swiglu_alpha, c.swiglu_up_offset) == (LIMIT, 1.702, 1.0)
    assert c.rope_scaling is not None and c.rope_scaling.kind == "yarn"


@pytest.mark.parametrize("scan", [False, True])
def test_logits_match_transformers(gpt_oss, scan):
    config, params = hf.load(gpt_oss.path, scan_layers=scan) if scan else (
        gpt_oss.config, gpt_oss.params)
    diff = float(np.max(np.abs(_logits(config, params) - gpt_oss.logits)))
    assert diff <= TOL, diff


def _without(params, *names):
    """params with the named leaves (at any depth) dropped."""
    if not isinstance(params, dict):
        return params
    return {k: _without(v, *names) for k, v in params.items() if k not in names}


@pytest.mark.parametrize("change", ["sinks", "attn_biases", "router_bias", "expert_bias",
                                    "clamp", "up_offset"])
def test_each_feature_moves_the_logits(gpt_oss, change):
    c, p = gpt_oss.config, gpt_oss.params
    config, params = {
        "sinks": (c.replace(attn_sinks=False), _without(p, "sinks")),
        "attn_biases": (c.replace(qkv_bias=False, o_bias=False),
                        _without(p, "q_bias", "k_bias", "v_bias", "o_bias")),
        "router_bias": (c.replace(moe=dataclasses.replace(c.moe, router_bias=False)),
                        _without(p, "router_bias")),
        "expert_bias": (c.replace(moe=dataclasses.replace(c.moe, expert_bias=False)),
                        _without(p, "gate_bias", "up_bias", "down_bias")),
        "clamp": (c.replace(swiglu_limit=None), p),
        "up_offset": (c.replace(swiglu_up_offset=0.0), p),
    }[change]
    assert float(np.max(np.abs(_logits(config, params) - gpt_oss.logits))) > 1e-2


def test_export_reads_back_in_transformers(gpt_oss, tmp_path):
    hf.save(gpt_oss.config, gpt_oss.params, tmp_path)
    saved = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    assert (saved["model_type"], saved["architectures"]) == ("gpt_oss", ["GptOssForCausalLM"])
    reread = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    theirs, mine = gpt_oss.model.state_dict(), reread.state_dict()
    assert theirs.keys() == mine.keys()
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0, msg=key)
    ours = _logits(gpt_oss.config, gpt_oss.params)
    np.testing.assert_allclose(torch_logits(reread, *INPUTS), ours, rtol=0, atol=1e-5)
    assert hf.load(tmp_path)[0] == gpt_oss.config


def test_greedy_generation_equals_transformers(gpt_oss):
    """Prefill + cached decode (the window's ring, sinks in every step) on ragged,
    left-padded prompts, generating past the window."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, V, n).tolist() for n in (3, 7)]
    new = 6
    ours = generation.generate(gpt_oss.config, gpt_oss.params, prompts, max_new_tokens=new)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = gpt_oss.model.generate(ids, attention_mask=mask, max_new_tokens=new,
                                     do_sample=False, pad_token_id=0, eos_token_id=None)
    assert [out[i, width:].tolist() for i in range(len(prompts))] == ours.tokens


def test_engine_equals_generate(gpt_oss):
    """The serving engine (paged full layers and window rings, sinks on both, a chunked
    prompt, decode past the window) gives each prompt what transformers' greedy generate
    gives it alone (as ours does: the test above; no generate program compiled here)."""
    config, params = gpt_oss.config, gpt_oss.params
    engine = Engine(config, decode.prepare(config, params), num_slots=2, num_pages=12,
                    page_size=4, token_budget=10, min_context=16)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, V, n).tolist() for n in (13, 3, 6)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=5)) for p in prompts]
    done = run_until_idle(engine)
    with torch.no_grad():
        want = [gpt_oss.model.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False,
                                       pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
                for p in prompts]
    assert [done[rid].tokens for rid in ids] == want
    engine.check_no_leaks()


@pytest.mark.parametrize("name, total, active", [
    # openai/gpt-oss-20b and -120b: 20.91B / 3.61B and 116.83B / 5.13B, the model card's
    # counts (its active count leaves out the input embedding, a lookup, and keeps the head);
    # the totals are transformers' GptOssForCausalLM's parameters for the published configs.
    ("gpt_oss_20b", 20_914_757_184, 3.61e9),
    ("gpt_oss_120b", 116_829_156_672, 5.13e9),
])
def test_presets_have_the_published_parameter_counts(name, total, active):
    from transformer_jax.model.config import ModelConfig
    from transformer_jax.train.perf import param_counts

    config = ModelConfig.preset(name)
    counted, active_counted = param_counts(config)
    assert counted == total
    assert abs(active_counted - config.vocab_size * config.d_model - active) < 0.005e9
    assert hf.config_to_hf(config)["model_type"] == "gpt_oss"
