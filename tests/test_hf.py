"""HuggingFace conversion: parity with transformers' own Llama / Mistral / Qwen2 models.

Tiny random models are built with transformers' classes, saved with ``save_pretrained`` and read
with ``hf.load``; our logits must match torch's (eager attention, float32) within 1e-4. Weights
are drawn at unit scale (not HF's 0.02 init) and one batch row starts at position 300, so that
attention is peaked and RoPE scaling, windows and head layouts change the logits visibly.

Needs the ``hf`` extra (torch, transformers, safetensors); skipped without it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HF_CLASSES, our_logits, ragged_inputs, random_hf_model, torch_logits
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from transformer_jax import hf  # noqa: E402  (needs the optional extra checked above)
from transformer_jax.hf import tensors  # noqa: E402
from transformer_jax.model.config import ModelConfig, RopeScaling  # noqa: E402

B, T, V, D = 2, 16, 128, 64
TOL = 1e-4
WINDOW = 5  # shorter than T, so the window changes the logits
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}
LINEAR = {"rope_type": "linear", "factor": 4.0}

def _hf_model(kind: str, seed: int = 0, **overrides):
    """A tiny random transformers model with every weight (norms and biases too) randomised."""
    sizes = dict(hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=V, max_position_embeddings=1024)
    return random_hf_model(kind, seed, **{**sizes, **overrides})


def _inputs() -> tuple[np.ndarray, np.ndarray]:
    """[B, T] tokens and positions; the second row starts at position 300."""
    return ragged_inputs(B, T, V)


def _torch_logits(model) -> np.ndarray:
    return torch_logits(model, *_inputs())


def _our_logits(config: ModelConfig, params) -> np.ndarray:
    return our_logits(config, params, *_inputs())


def _save_hf(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str
    hf_kwargs: dict
    expect: dict  # ModelConfig fields the loaded config must have
    ablate: dict | None = None  # dropping this must change the logits (the feature matters)
    scan_layers: bool = False
    zero_o_bias: bool = False


CASES = {
    "llama-mha-untied": Case("llama", dict(num_key_value_heads=4),
                             dict(n_kv_heads=4, tie_embeddings=False, qkv_bias=False)),
    "llama-gqa-tied-geglu": Case("llama", dict(tie_word_embeddings=True, hidden_act="gelu"),
                                 dict(n_kv_heads=2, tie_embeddings=True, ffn="geglu")),
    "llama-mqa-llama3": Case(
        "llama", dict(num_key_value_heads=1, rope_scaling=LLAMA3),
        dict(n_kv_heads=1, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 256)),
        ablate=dict(rope_scaling=None)),
    "llama-linear-theta-headdim": Case(
        "llama", dict(rope_scaling=LINEAR, rope_theta=500.0, head_dim=8),
        dict(head_dim=8, rope_base=500.0, rope_scaling=RopeScaling("linear", 4.0)),
        ablate=dict(rope_scaling=None)),
    "llama-attention-bias-zero-o": Case("llama", dict(attention_bias=True), dict(qkv_bias=True),
                                        zero_o_bias=True),
    "qwen2-gqa-bias-tied-scanned": Case(
        "qwen2", dict(tie_word_embeddings=True),
        dict(qkv_bias=True, tie_embeddings=True, sliding_window=None, scan_layers=True),
        scan_layers=True),
    "qwen2-mha-bias-window": Case(
        "qwen2", dict(num_key_value_heads=4, use_sliding_window=True, sliding_window=WINDOW,
                      max_window_layers=0),
        dict(qkv_bias=True, sliding_window=WINDOW), ablate=dict(sliding_window=None)),
    "mistral-gqa-window": Case("mistral", dict(sliding_window=WINDOW),
                               dict(sliding_window=WINDOW, qkv_bias=False),
                               ablate=dict(sliding_window=None)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name, tmp_path):
    case = CASES[name]
    model = _hf_model(case.kind, **case.hf_kwargs)
    if case.zero_o_bias:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.bias.zero_()
    config, params = hf.load(_save_hf(model, tmp_path), scan_layers=case.scan_layers)
    for field, value in case.expect.items():
        assert getattr(config, field) == value, field
    assert config.rope_pairing == "half" and config.param_dtype == "float32"
    if case.scan_layers:
        assert "blocks" in params and "blocks_0" not in params
        chex.assert_shape(params["blocks"]["attn"]["q_proj"], (2, D, 4, config.head_dim))

    expected = _torch_logits(model)
    ours = _our_logits(config, params)
    diff = _max_diff(ours, expected)
    assert diff <= TOL, f"{name}: max abs diff {diff}"
    if case.ablate is not None:
        ablated = _max_diff(_our_logits(config.replace(**case.ablate), params), expected)
        assert ablated > 100 * TOL, f"{name}: {case.ablate} does not matter ({ablated})"


def test_sharded_checkpoint_loads(tmp_path):
    model = _hf_model("llama")
    _save_hf(model, tmp_path, max_shard_size="40KB")
    assert (tmp_path / hf.INDEX_FILE).is_file() and not (tmp_path / hf.SINGLE_FILE).exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    config, params = hf.load(tmp_path)
    assert _max_diff(_our_logits(config, params), _torch_logits(model)) <= TOL


def _assert_trees_identical(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kind, hf_kwargs, scan_layers, max_shard_bytes, architecture", [
    ("llama", dict(tie_word_embeddings=True, rope_scaling=LLAMA3), False, None,
     "LlamaForCausalLM"),
    ("mistral", dict(sliding_window=WINDOW, rope_scaling=LINEAR), True, 30_000,
     "MistralForCausalLM"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0), False,
     None, "Qwen2ForCausalLM"),
])
def test_round_trip_and_transformers_reads_ours(kind, hf_kwargs, scan_layers, max_shard_bytes,
                                                architecture, tmp_path):
    model = _hf_model(kind, **hf_kwargs)
    config, params = hf.load(_save_hf(model, tmp_path / "hf"), scan_layers=scan_layers)
    hf.save(config, params, tmp_path / "ours", max_shard_bytes=max_shard_bytes)
    saved = json.loads((tmp_path / "ours" / hf.CONFIG_FILE).read_text())
    assert saved["architectures"] == [architecture] and saved["model_type"] == kind
    if max_shard_bytes is not None:
        assert len(list((tmp_path / "ours").glob("model-*.safetensors"))) > 1

    config2, params2 = hf.load(tmp_path / "ours", scan_layers=scan_layers)
    assert config2 == config
    _assert_trees_identical(params2, params)

    reread = getattr(transformers, HF_CLASSES[kind][1]).from_pretrained(
        tmp_path / "ours", attn_implementation="eager").eval()
    theirs, ours = model.state_dict(), reread.state_dict()
    assert theirs.keys() == ours.keys()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)
    np.testing.assert_allclose(_torch_logits(reread), _torch_logits(model), rtol=0, atol=1e-6)


def test_bfloat16_checkpoint(tmp_path):
    model = _hf_model("qwen2")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    # A bfloat16 copy to save; the float32 model stays the reference, as .to(bfloat16) would
    # also round its RoPE frequency buffer.
    _save_hf(copy.deepcopy(model).to(torch.bfloat16), tmp_path / "hf")
    config, params = hf.load(tmp_path / "hf")
    assert config.param_dtype == "bfloat16" and config.dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    # Bit-exact against torch's own tensors, re-laid-out independently of hf.py.
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    n, h = config.n_heads, config.head_dim
    np.testing.assert_array_equal(params["embed"]["embedding"].astype(jnp.float32),
                                  state["model.embed_tokens.weight"])
    q = state["model.layers.1.self_attn.q_proj.weight"]  # [N*H, D]
    for head in range(n):
        np.testing.assert_array_equal(
            params["blocks_1"]["attn"]["q_proj"][:, head].astype(jnp.float32),
            q[head * h:(head + 1) * h].T)
    np.testing.assert_array_equal(params["blocks_1"]["attn"]["k_bias"].astype(jnp.float32),
                                  state["model.layers.1.self_attn.k_proj.bias"].reshape(-1, h))
    np.testing.assert_array_equal(params["lm_head"].astype(jnp.float32),
                                  state["lm_head.weight"].T)

    # Upcasting on load is exact: float32 logits match the upcast torch model.
    config32, params32 = hf.load(tmp_path / "hf", dtype="float32")
    assert config32.param_dtype == "float32"
    assert _max_diff(_our_logits(config32, params32), _torch_logits(model)) <= TOL

    hf.save(config, params, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / hf.CONFIG_FILE).read_text())["torch_dtype"] == \
        "bfloat16"
    config2, params2 = hf.load(tmp_path / "ours")
    assert config2 == config
    _assert_trees_identical(params2, params)


# ------------------------------------------------------------------------------------------------
# Errors


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory) -> Path:
    return _save_hf(_hf_model("llama"), tmp_path_factory.mktemp("base"))


def _copy(base: Path, dest: Path, **config_changes) -> Path:
    shutil.copytree(base, dest)
    if config_changes:
        hf_config = json.loads((dest / hf.CONFIG_FILE).read_text())
        hf_config.update(config_changes)
        (dest / hf.CONFIG_FILE).write_text(json.dumps(hf_config))
    return dest


@pytest.mark.parametrize("changes, message", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "yarn"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "dynamic"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "dynamic"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                           "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(model_type="gpt2"), "model_type"),
    (dict(architectures=["LlamaForSequenceClassification"]), "architectures"),
    (dict(hidden_act="gelu_pytorch_tanh"), "hidden_act"),
    (dict(quantization_config={"quant_method": "gptq"}), "quantiz"),
    (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
          sliding_window=4, max_window_layers=1), "mixed sliding"),
])
def test_unrepresentable_configs_are_refused(base_checkpoint, tmp_path, changes, message):
    path = _copy(base_checkpoint, tmp_path / "ckpt", **changes)
    with pytest.raises(ValueError, match=message):
        hf.load(path)


def _rewrite_weights(path: Path, edit) -> None:
    file = path / hf.SINGLE_FILE
    tensors = safetensors_numpy.load_file(str(file))
    edit(tensors)
    safetensors_numpy.save_file(tensors, str(file), metadata={"format": "pt"})


UP = "model.layers.1.mlp.up_proj.weight"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(UP), f"missing tensors: {UP}"),
    (lambda t: t.update({UP: t[UP].T.copy()}), rf"{UP} has shape \[64, 128\]"),
    (lambda t: t.update({"model.layers.0.mlp.extra.weight": t[UP]}),
     "unexpected tensors: model.layers.0.mlp.extra.weight"),
    (lambda t: t.update({UP: t[UP].astype(np.int8)}), f"{UP} has unsupported dtype"),
])
def test_bad_tensors_are_named(base_checkpoint, tmp_path, edit, message):
    path = _copy(base_checkpoint, tmp_path / "ckpt")
    _rewrite_weights(path, edit)
    with pytest.raises(ValueError, match=message):
        hf.load(path)


def test_nonzero_o_proj_bias_is_refused(tmp_path):
    path = _save_hf(_hf_model("llama", attention_bias=True), tmp_path)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.bias"):
        hf.load(path)


def test_bad_dtype_is_refused(base_checkpoint):
    with pytest.raises(ValueError, match="int8"):
        hf.load(base_checkpoint, dtype="int8")
    with pytest.raises(ValueError, match="float17"):
        hf.load(base_checkpoint, dtype="float17")


def test_missing_files(base_checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.load(tmp_path)
    path = _copy(base_checkpoint, tmp_path / "ckpt")
    (path / hf.SINGLE_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        hf.load(path)


@pytest.mark.parametrize("change", [
    dict(rope_pairing="adjacent"), dict(norm="layer"), dict(norm_position="post"),
    dict(position="sinusoidal"), dict(ffn="gelu"), dict(ffn="relu"),
])
def test_save_refuses_what_hf_cannot_represent(base_checkpoint, tmp_path, change):
    config, params = hf.load(base_checkpoint)
    with pytest.raises(ValueError, match=next(iter(change))):
        hf.save(config.replace(**change), params, tmp_path)


def test_save_checks_params(base_checkpoint, tmp_path):
    config, params = hf.load(base_checkpoint)
    with pytest.raises(ValueError, match="blocks_1/mlp/up"):
        hf.save(config, {**params, "blocks_1": {**params["blocks_1"], "mlp": {
            k: v for k, v in params["blocks_1"]["mlp"].items() if k != "up"}}}, tmp_path)
    with pytest.raises(ValueError, match="lm_head"):
        hf.save(config.replace(tie_embeddings=True), params, tmp_path)
    with pytest.raises(ValueError, match="final_norm/scale has shape"):
        hf.save(config, {**params, "final_norm": {"scale": jnp.ones(D + 1)}}, tmp_path)


# ------------------------------------------------------------------------------------------------
# Config mapping alone


def test_legacy_and_current_rope_keys_agree():
    base = dict(model_type="llama", vocab_size=V, hidden_size=D, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                max_position_embeddings=1024)
    legacy = hf.config_from_hf({**base, "rope_theta": 5e5, "rope_scaling": {
        "type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
        "original_max_position_embeddings": 256}})
    current = hf.config_from_hf({**base, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}})
    assert legacy == current
    assert current.rope_base == 5e5
    assert current.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 256)
    # transformers defaults llama3's original length to max_position_embeddings.
    no_original = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    assert hf.config_from_hf({**base, "rope_scaling": no_original}).rope_scaling == \
        RopeScaling("llama3", 8.0, 1.0, 4.0, 1024)
    # Qwen2 without use_sliding_window ignores its sliding_window; Mistral uses it.
    assert hf.config_from_hf({**base, "model_type": "qwen2", "sliding_window": 8,
                              "use_sliding_window": False}).sliding_window is None
    assert hf.config_from_hf({**base, "model_type": "mistral",
                              "sliding_window": 8}).sliding_window == 8
    # Keys whose transformers defaults are presets' values, not neutral ones, are required.
    with pytest.raises(ValueError, match="sliding_window"):
        hf.config_from_hf({**base, "model_type": "mistral"})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        hf.config_from_hf({**base, "model_type": "qwen2", "num_key_value_heads": None})
    with pytest.raises(ValueError, match="max_window_layers"):
        hf.config_from_hf({**base, "model_type": "qwen2", "use_sliding_window": True,
                           "sliding_window": 8})


@st.composite
def _representable_configs(draw) -> ModelConfig:
    n_kv = draw(st.sampled_from([1, 2, 4]))
    scaling = draw(st.sampled_from([
        None, RopeScaling("linear", 2.0), RopeScaling("llama3", 8.0, 1.0, 4.0, 512)]))
    return ModelConfig(
        vocab_size=draw(st.integers(1, 1000)), d_model=64, n_layers=draw(st.integers(1, 4)),
        n_heads=4 * draw(st.integers(1, 2)), n_kv_heads=n_kv,
        head_dim=draw(st.sampled_from([None, 8, 32])), d_ff=draw(st.integers(1, 300)),
        max_seq_len=draw(st.integers(1, 4096)), norm_eps=draw(st.sampled_from([1e-5, 1e-6])),
        ffn=draw(st.sampled_from(["swiglu", "geglu"])),
        rope_base=draw(st.sampled_from([1e4, 5e5])), rope_scaling=scaling,
        sliding_window=draw(st.none() | st.integers(1, 4096)), qkv_bias=draw(st.booleans()),
        tie_embeddings=draw(st.booleans()))


@settings(max_examples=50, deadline=None)
@given(_representable_configs())
def test_config_round_trips_through_hf_json(config):
    hf_config = json.loads(json.dumps(hf.config_to_hf(config)))
    assert hf.config_from_hf(hf_config) == config


def test_config_to_hf_picks_the_layout():
    base = ModelConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=4, d_ff=128)
    assert hf.config_to_hf(base)["architectures"] == ["LlamaForCausalLM"]
    mistral = hf.config_to_hf(base.replace(sliding_window=WINDOW))
    assert mistral["model_type"] == "mistral" and mistral["sliding_window"] == WINDOW
    # Llama's attention_bias would add an o_proj bias too, so q/k/v biases need Qwen2.
    qwen2 = hf.config_to_hf(base.replace(qkv_bias=True, sliding_window=WINDOW))
    assert qwen2["model_type"] == "qwen2" and qwen2["use_sliding_window"]
    assert qwen2["max_window_layers"] == 0 and qwen2["sliding_window"] == WINDOW
    assert not hf.config_to_hf(base.replace(qkv_bias=True))["use_sliding_window"]
    # transformers' LlamaConfig rejects hidden_size % num_attention_heads != 0.
    with pytest.raises(ValueError, match="divisible"):
        hf.config_to_hf(base.replace(d_model=60, n_heads=8, head_dim=8))


# ------------------------------------------------------------------------------------------------
# Reading blocks (the sharded load's building block)


@pytest.mark.parametrize("spec", [
    tensors._same("e", ("embed", "embedding"), (6, 4)),
    tensors._reshaped("b", ("q_bias",), (12,), (4, 3)),
    tensors._linear("l", ("mlp", "up"), 5, 7),
    tensors._heads_in("q", ("attn", "q_proj"), 6, 4, 3),
    tensors._heads_out("o", ("attn", "o_proj"), 6, 4, 3),
], ids=lambda s: s.hf_name)
def test_blocks_read_from_the_hf_layout_equal_the_converted_tensor(spec):
    rng = np.random.default_rng(0)
    tensor = rng.standard_normal(spec.hf_shape).astype(np.float32)
    ours = spec.to_ours(tensor)
    assert ours.shape == spec.shape
    np.testing.assert_array_equal(spec.to_hf(ours), tensor)
    for _ in range(20):  # random blocks, head_dim cut too (read whole, then sliced)
        starts = [int(rng.integers(0, n)) for n in spec.shape]
        index = tuple(slice(a, int(rng.integers(a + 1, n + 1)))
                      for a, n in zip(starts, spec.shape, strict=True))
        np.testing.assert_array_equal(spec.read(tensor, index), ours[index])


def test_load_onto_a_one_device_mesh_equals_the_plain_load(base_checkpoint):
    from transformer_jax.parallel import sharding

    mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
    for scan in (False, True):
        config, plain = hf.load(base_checkpoint, scan_layers=scan)
        config_m, sharded = hf.load(base_checkpoint, mesh=mesh, scan_layers=scan)
        assert config_m == config
        _assert_trees_identical(sharded, plain)
        want = sharding.param_shardings(config, mesh)
        assert jax.tree.leaves(jax.tree.map(lambda x, s: x.sharding == s, sharded, want))


def test_bad_input_fails_before_any_array_is_made(base_checkpoint, tmp_path, monkeypatch):
    from transformer_jax.parallel import sharding

    mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])

    def no_arrays(*args, **kwargs):
        raise AssertionError("an array was made before the input was checked")

    monkeypatch.setattr(jax, "device_put", no_arrays)
    monkeypatch.setattr(jnp, "asarray", no_arrays)
    no_weights = _copy(base_checkpoint, tmp_path / "no_weights")
    (no_weights / hf.SINGLE_FILE).unlink()
    unrepresentable = _copy(base_checkpoint, tmp_path / "yarn", rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    misshapen = _copy(base_checkpoint, tmp_path / "misshapen")
    _rewrite_weights(misshapen, lambda t: t.update({UP: t[UP].T.copy()}))
    for kwargs in ({}, {"mesh": mesh}):
        with pytest.raises(FileNotFoundError, match="model.safetensors"):
            hf.load(no_weights, **kwargs)
        with pytest.raises(ValueError, match="yarn"):
            hf.load(unrepresentable, **kwargs)
        with pytest.raises(ValueError, match=rf"{UP} has shape"):
            hf.load(misshapen, **kwargs)
