"""GPT-OSS MXFP4 checkpoints (``hf.mxfp4``): a tiny random ``GptOssForCausalLM``'s experts are
packed into MXFP4 here, by this file's own quantiser, into a two-shard checkpoint (the scales in
the second shard). ``hf.load`` must give exactly transformers' dequantisation of those bytes
(``convert_moe_packed_tensors``), and the logits of transformers' model loaded from the same
directory; partial reads (a device's shard) must equal the whole tensor's block; bad blocks or
scales and other quantisation methods are refused in one line; export writes the dequantised
experts unquantised, which transformers reads back."""

import contextlib
import dataclasses
import json

import jax
import numpy as np
import pytest
from helpers import FAST_COMPILE, ragged_inputs, torch_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
mxfp4_integration = pytest.importorskip("transformers.integrations.mxfp4")

from transformer_jax import hf  # noqa: E402
from transformer_jax.hf import mxfp4  # noqa: E402
from transformer_jax.model.transformer import Transformer  # noqa: E402

B, T, V, D, H, F, E, LAYERS = 2, 10, 97, 32, 8, 32, 4, 2
TOL = 1e-4
INPUTS = ragged_inputs(B, T, V)
QUANT = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
PACKED = [f"model.layers.{i}.mlp.experts.{p}" for i in range(LAYERS)
          for p in ("gate_up_proj", "down_proj")]
GATE_UP, DOWN = PACKED[2], PACKED[3]  # layer 1's
# The OCP MX spec's e2m1 magnitudes by code (codes 8-15: the same, negative).
MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def quantise(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[E, I, O] float32 -> MXFP4 blocks [E, O, I/32, 16] and scales [E, O, I/32] (uint8), as the
    OCP MX spec quantises: a block's scale is 2^(floor(log2 amax) - 2), each value the nearest
    e2m1 (saturating at 6)."""
    x = np.swapaxes(w, -1, -2).reshape(*w.shape[:-2], w.shape[-1], -1, 32)
    exponent = np.floor(np.log2(np.maximum(np.abs(x).max(-1), 2.0 ** -100))) - 2
    scaled = x / np.exp2(exponent)[..., None]
    codes = np.abs(np.abs(scaled)[..., None] - MAGNITUDES).argmin(-1) + 8 * (scaled < 0)
    codes = codes.astype(np.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).astype(np.uint8)


def our_logits(config, params) -> np.ndarray:
    def run(params, tokens, positions):
        return Transformer(config).apply({"params": params}, tokens, positions=positions).logits

    return np.asarray(jax.jit(run, compiler_options=FAST_COMPILE)(params, *INPUTS))


def dequantised(blocks: np.ndarray, scales: np.ndarray, dtype=torch.float32) -> np.ndarray:
    """transformers' dequantisation [E, I, O] of the same bytes, as float32 numpy."""
    out = mxfp4_integration.convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype)
    return out.float().numpy()


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    path: object
    tensors: dict  # every tensor of the MXFP4 checkpoint, by name
    hf_config: dict
    logits: np.ndarray  # transformers' model loaded from ``path``


def write(path, tensors: dict, hf_config: dict, shards: bool = False) -> None:
    """A checkpoint directory: one file, or (``shards``) the scales in a second shard."""
    path.mkdir(parents=True, exist_ok=True)
    (path / hf.CONFIG_FILE).write_text(json.dumps(hf_config))
    if not shards:
        safetensors_numpy.save_file(tensors, str(path / hf.SINGLE_FILE), metadata={"format": "pt"})
        return
    files = {name: f"model-0000{1 + name.endswith('_scales')}-of-00002.safetensors"
             for name in tensors}
    for file in set(files.values()):
        safetensors_numpy.save_file({n: t for n, t in tensors.items() if files[n] == file},
                                    str(path / file), metadata={"format": "pt"})
    (path / hf.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": files}))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Checkpoint:
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=H, num_local_experts=E,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=1024,
        swiglu_limit=1.0, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.ndim == 1 or name.endswith("_bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, p.shape[-2 if "experts" in name else -1] ** -0.5)
    tensors = {name: p.detach().numpy().copy() for name, p in model.state_dict().items()}
    for name in PACKED:
        tensors[name + "_blocks"], tensors[name + "_scales"] = quantise(tensors.pop(name))
    hf_config = {**model.config.to_dict(), "quantization_config": QUANT}
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    write(path, tensors, hf_config, shards=True)
    theirs = transformers.GptOssForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    packed = tensors[PACKED[0] + "_blocks"], tensors[PACKED[0] + "_scales"]
    # transformers did dequantise them (not left them at its random init)
    np.testing.assert_array_equal(
        theirs.model.layers[0].mlp.experts.gate_up_proj.detach().numpy(), dequantised(*packed))
    return Checkpoint(path, tensors, hf_config, torch_logits(theirs, *INPUTS))


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return hf.load(checkpoint.path)


@pytest.fixture(scope="module")
def ours(loaded) -> np.ndarray:
    return our_logits(*loaded)


def test_e2m1_values_and_extreme_scales_are_transformers():
    """The e2m1 table, and every byte at the smallest scales (subnormal float32 values) and the
    largest that stays finite (2^125), equal transformers' dequantisation."""
    np.testing.assert_array_equal(mxfp4.E2M1, np.array(mxfp4_integration.FP4_VALUES, np.float32))
    assert list(np.signbit(mxfp4.E2M1)) == [False] * 8 + [True] * 8
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (1, 6, 1, 1))
    scales = np.tile(np.array([0, 1, 2, 126, 127, 252], np.uint8)[:, None], (1, 1, 16))
    ours = mxfp4.dequantize(blocks, scales)  # [1, 6, 512]
    np.testing.assert_array_equal(np.swapaxes(ours, -1, -2), dequantised(blocks, scales))
    with pytest.raises(ValueError, match="tensor w has MXFP4 values that are not finite"):
        mxfp4.dequantize(blocks, scales + 1, "w")  # 2^126 * 4 overflows, 255 is NaN


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_experts_equal_transformers_dequantisation(checkpoint, loaded, dtype):
    config, params = loaded if dtype == "float32" else hf.load(checkpoint.path, dtype=dtype)
    assert config.param_dtype == dtype  # (the rest of the checkpoint is float32)
    t = checkpoint.tensors
    for i in range(LAYERS):
        moe = {k: np.asarray(v, np.float32) for k, v in params[f"blocks_{i}"]["moe"].items()}
        experts = f"model.layers.{i}.mlp.experts"
        gate_up = dequantised(t[f"{experts}.gate_up_proj_blocks"],
                              t[f"{experts}.gate_up_proj_scales"], getattr(torch, dtype))
        down = dequantised(t[f"{experts}.down_proj_blocks"], t[f"{experts}.down_proj_scales"],
                           getattr(torch, dtype))
        assert gate_up.shape == (E, D, 2 * F) and down.shape == (E, F, D)
        np.testing.assert_array_equal(moe["gate"], gate_up[..., 0::2])
        np.testing.assert_array_equal(moe["up"], gate_up[..., 1::2])
        np.testing.assert_array_equal(moe["down"], down)


def test_logits_match_transformers(checkpoint, ours):
    diff = float(np.max(np.abs(ours - checkpoint.logits)))
    assert diff <= TOL, diff


def test_partial_reads_equal_the_whole_tensor():
    """A block of the value (a device's shard: any input range, output columns with a step as
    GPT-OSS's interleaved gate/up take them) reads only the 32-value blocks it needs and equals
    the whole tensor's block; random bytes over three blocks of input, scales 2^-27..2^22."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 10, 3, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (2, 10, 3), dtype=np.uint8)
    whole = dequantised(blocks, scales)  # [2, 96, 10]
    reads = []
    packed = mxfp4.Packed("w", whole.shape, lambda i: reads.append(i) or blocks[i],
                          lambda i: scales[i])
    for index, groups in [((slice(None),) * 3, slice(0, 3)),
                          ((slice(1, 2), slice(5, 40), slice(1, 10, 2)), slice(0, 2)),
                          ((slice(0, 2), slice(32, 64), slice(0, 9, 2)), slice(1, 2)),
                          ((slice(0, 1), slice(70, 71), slice(3, 4)), slice(2, 3))]:
        np.testing.assert_array_equal(packed[index], whole[index])
        assert reads[-1][-2] == groups


def test_a_device_shard_reads_from_the_files(checkpoint, loaded):
    """``load``'s reader on the two-shard checkpoint (blocks in one file, scales in the other)
    reads a device's block of the interleaved gate / up and of down: the loaded param's."""
    from transformer_jax.hf.reader import _open_safetensors, _Reader

    config, params = loaded
    files = hf._weight_files(checkpoint.path)
    specs = {s.path: s for s in hf._tensors(config, "gpt_oss") if s.path[0] == "blocks_1"}
    packed = mxfp4.packed_tensors(checkpoint.hf_config, [s.hf_name for s in specs.values()],
                                  files)
    assert sorted(packed) == [DOWN, GATE_UP]
    index = (slice(1, 3), slice(16, 32), slice(8, 24))
    with contextlib.ExitStack() as stack:
        reader = _Reader(files, {f: stack.enter_context(_open_safetensors(f))
                                 for f in set(files.values())}, packed)
        for param in ("gate", "up", "down"):
            with reader.reopened([GATE_UP if param != "down" else DOWN]) as fresh:
                block = fresh.block(specs[("blocks_1", "moe", param)], index)
            np.testing.assert_array_equal(block,
                                          np.asarray(params["blocks_1"]["moe"][param])[index])


def _refused(tmp_path, checkpoint, change) -> str:
    tensors = {name: t.copy() for name, t in checkpoint.tensors.items()}
    config = json.loads(json.dumps(checkpoint.hf_config))
    change(tensors, config)
    write(tmp_path, tensors, config)
    with pytest.raises(ValueError) as e:
        hf.load(tmp_path)
    assert "\n" not in str(e.value)
    return str(e.value)



@pytest.mark.parametrize("change, message", [
    (lambda t, c: t.pop(DOWN + "_scales"), f"missing tensors: {DOWN}_scales"),
    (lambda t, c: t.pop(GATE_UP + "_blocks"), f"missing tensors: {GATE_UP}_blocks"),
    (lambda t, c: t.update({GATE_UP + "_blocks": t[GATE_UP + "_blocks"].reshape(E, 2 * F, 2, 8)}),
     f"tensor {GATE_UP}_blocks has shape [4, 64, 2, 8], expected [4, 64, 1, 16]"),
    (lambda t, c: t.update({DOWN + "_scales": t[DOWN + "_scales"][:, :-1]}),
     f"tensor {DOWN}_scales has shape [4, 31, 1], expected [4, 32, 1]"),
    (lambda t, c: t.update({DOWN + "_scales": t[DOWN + "_scales"].astype(np.float32)}),
     f"tensor {DOWN}_scales has dtype F32, expected U8"),
    (lambda t, c: t[DOWN + "_scales"].__setitem__((1, 2, 0), 255), f"tensor {DOWN} has MXFP4 "
     "values that are not finite"),
    (lambda t, c: c["quantization_config"].update(quant_method="gptq"),
     "quantization_config with quant_method 'gptq') are not supported; gpt_oss reads mxfp4"),
    (lambda t, c: c.pop("quantization_config"), f"missing tensors: {PACKED[1]}, {PACKED[0]}"),
])
def test_bad_checkpoints_are_refused_naming_the_tensor(tmp_path, checkpoint, change, message):
    assert message in _refused(tmp_path, checkpoint, change)


def test_mxfp4_is_refused_for_other_families():
    config = dict(model_type="llama", vocab_size=V, hidden_size=D, num_hidden_layers=1,
                  num_attention_heads=4, max_position_embeddings=64, intermediate_size=F,
                  quantization_config=QUANT)
    with pytest.raises(ValueError,
                       match="quant_method 'mxfp4'\\) are not supported; llama reads fp8$"):
        hf.config_from_hf(config)


def test_a_width_off_the_32_value_blocks_is_refused():
    with pytest.raises(ValueError, match="tensor w cannot be MXFP4: its input width 48"):
        mxfp4.packed_shapes("w", (4, 48, 64))


def test_export_writes_the_dequantised_experts_unquantised(checkpoint, loaded, ours, tmp_path):
    config, params = loaded
    hf.save(config, params, tmp_path)
    saved = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    assert "quantization_config" not in saved
    reread = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    t = checkpoint.tensors
    for name in PACKED:
        np.testing.assert_array_equal(reread.state_dict()[name].numpy(),
                                      dequantised(t[name + "_blocks"], t[name + "_scales"]))
    np.testing.assert_allclose(torch_logits(reread, *INPUTS), ours,
                               rtol=0, atol=1e-5)


def test_quantize_takes_the_nearest_value_of_the_ocp_scale():
    """Every value becomes the nearest of its block's grid (transformers' e2m1 values times the
    block's scale, whose largest magnitude there is in [4, 8)); a value MXFP4 holds comes back
    exactly."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((2, 64, 6)) * np.exp2(rng.integers(-30, 30, (2, 1, 6))))
    w = w.astype(np.float32)
    w[0, :32, 0] = 0.0  # a zero block
    blocks, scales = mxfp4.quantize(w)
    got = dequantised(blocks, scales)
    step = np.exp2(np.repeat(np.swapaxes(scales.astype(np.float64) - 127, -1, -2), 32, axis=1))
    grid = np.array(mxfp4_integration.FP4_VALUES)
    best = np.abs(w[..., None] - grid * step[..., None]).min(-1)
    np.testing.assert_array_equal(np.abs(w - got), best)
    amax = np.abs(np.swapaxes(w, -1, -2).reshape(2, 6, 2, 32)).max(-1)
    ratio = amax / np.exp2(scales.astype(np.float64) - 127)
    assert np.all((ratio >= 4) & (ratio < 8) | (amax == 0))
    np.testing.assert_array_equal(dequantised(*mxfp4.quantize(got)), got)


def test_mxfp4_export_round_trips(checkpoint, loaded, tmp_path):
    """``transformer-jax export --mxfp4`` of the MXFP4 checkpoint writes MXFP4 experts that
    hold the same values: ``hf.load`` reads back the same params, transformers the logits."""
    from transformer_jax.cli import export

    assert export.main(["--checkpoint", str(checkpoint.path), "--out", str(tmp_path),
                        "--no-tokenizer", "--mxfp4"]) == 0
    saved = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    assert saved["quantization_config"] == mxfp4.CONFIG
    names = safetensors_numpy.load_file(str(tmp_path / hf.SINGLE_FILE)).keys()
    assert {n + s for n in PACKED for s in ("_blocks", "_scales")} <= set(names)
    assert not set(PACKED) & set(names)
    config, params = hf.load(tmp_path)
    assert config == loaded[0]
    jax.tree.map(np.testing.assert_array_equal, params, loaded[1])
    theirs = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    np.testing.assert_array_equal(torch_logits(theirs, *INPUTS), checkpoint.logits)


def test_mxfp4_export_is_refused_for_other_families(tmp_path):
    config = hf.config_from_hf(dict(
        model_type="llama", vocab_size=V, hidden_size=D, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=64, intermediate_size=F))
    with pytest.raises(ValueError, match="HF llama checkpoints have no MXFP4 experts"):
        hf.save(config, {}, tmp_path, mxfp4_experts=True)


@pytest.mark.parametrize("preset, experts", [("gpt_oss_20b", 32), ("gpt_oss_120b", 128)])
def test_presets_expect_the_published_blocks_and_scales(preset, experts):
    """openai/gpt-oss-20b and -120b store gate_up_proj_blocks [E, 5760, 90, 16] (2F rows, D/32
    blocks of D = 2880) and down_proj_blocks [E, 2880, 90, 16], scales without the last axis."""
    from transformer_jax.model.config import ModelConfig

    config = ModelConfig.preset(preset).replace(n_layers=1)
    shapes = {s.hf_name: mxfp4.packed_shapes(s.hf_name, s.stored_shape)
              for s in hf._tensors(config, "gpt_oss") if mxfp4.packable(s.hf_name)}
    assert shapes == {
        "model.layers.0.mlp.experts.gate_up_proj": ((experts, 5760, 90, 16), (experts, 5760, 90)),
        "model.layers.0.mlp.experts.down_proj": ((experts, 2880, 90, 16), (experts, 2880, 90))}
