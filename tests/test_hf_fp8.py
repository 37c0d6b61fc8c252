"""Block-scaled FP8 checkpoints (``hf.fp8``: DeepSeek-V3's, Kimi K2's, Qwen3-*-FP8's format)
against transformers: tiny random ``Qwen3ForCausalLM`` and ``DeepseekV3ForCausalLM`` (a dense
then a mixture-of-experts layer) written by ``save_pretrained``, their Linear weights quantised
here with torch to float8 e4m3fn and a float32 ``weight_scale_inv`` per 32 x 24 block (not
square, so rows and columns cannot be swapped unseen; partial blocks on every width), load as
the same checkpoint dequantised by torch; transformers' model on that dequantised checkpoint is
the reference for the logits. Export (``save(fp8_block=...)``, ``export --fp8``) writes the
same format: within e4m3's rounding of the weights, transformers loads it, and it reads back
bit for bit. Each damaged checkpoint or setting is refused in one line before any weight is
read."""

import json
import math

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import jit_logits, ragged_inputs, spread_torch_params, torch_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformer_jax import hf  # noqa: E402
from transformer_jax.cli import export as export_cli  # noqa: E402
from transformer_jax.hf import fp8  # noqa: E402

B, T, V, D = 2, 8, 96, 64
BLOCK = (32, 24)  # [rows (out), cols (in)]: 64 = 2 x 32 rows, 64 = 24 + 24 + 16 columns
TOL = 1e-4  # float32 logits of the same float32 weights in two frameworks (the parity bound)
INPUTS = ragged_inputs(B, T, V)
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": list(BLOCK)}


def random_model(kind):
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=D, num_attention_heads=4, num_hidden_layers=2,
                  max_position_embeddings=512, tie_word_embeddings=False,
                  attn_implementation="eager")
    if kind == "qwen3":
        config = transformers.Qwen3Config(intermediate_size=80, num_key_value_heads=2,
                                          head_dim=16, **common)
        model = transformers.Qwen3ForCausalLM(config)
    else:  # MLA with a query low rank; 1 dense then 1 sparse layer (grouped routing, shared)
        config = transformers.DeepseekV3Config(
            intermediate_size=80, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=40,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=1,
            n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            moe_intermediate_size=40, n_shared_experts=1, routed_scaling_factor=2.5, **common)
        model = transformers.DeepseekV3ForCausalLM(config)
    spread_torch_params(model)
    return model.eval()


def is_linear_weight(name, tensor):
    """The tensors transformers' FP8 quantizer stores quantised: its nn.Linear weights in the
    layers (the experts' one by one on disk), not the router (``mlp.gate``, not a Linear)."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and tensor.ndim == 2
            and not name.endswith("mlp.gate.weight"))


def torch_quantize(w, block):
    """e4m3fn values and float32 scale_inv [ceil(O/B0), ceil(I/B1)] of one block at a time, and
    their dequantised value (``q.float() * scale``): independent of ``fp8.quantize``."""
    rows, cols = w.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    q, scale = torch.empty(w.shape, dtype=torch.float8_e4m3fn), torch.empty(grid)
    value = torch.empty(w.shape)
    for i in range(grid[0]):
        for j in range(grid[1]):
            at = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scale[i, j] = w[at].abs().max() / 448.0
            q[at] = (w[at] / scale[i, j]).to(torch.float8_e4m3fn)
            value[at] = q[at].float() * scale[i, j]
    return q, scale, value


def assert_same(params, reference):
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params, reference)


def write(directory, tensors, config):
    directory.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file(tensors, str(directory / "model.safetensors"),
                                metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))


class Checkpoint:
    """A family's FP8 checkpoint (``path``: its tensors and config) and the same dequantised
    by torch (``reference``, with transformers' model of it)."""

    def __init__(self, kind, tmp):
        model = random_model(kind)
        model.save_pretrained(tmp / "original")
        config = json.loads((tmp / "original" / "config.json").read_text())
        stored = safetensors_torch.load_file(str(tmp / "original" / "model.safetensors"))
        self.tensors, dequantised = {}, {}
        for name, w in stored.items():
            if is_linear_weight(name, w):
                q, scale, dequantised[name] = torch_quantize(w.float(), BLOCK)
                self.tensors[name], self.tensors[name + "_scale_inv"] = q, scale
            else:
                self.tensors[name] = dequantised[name] = w
        self.quantised = sorted(n for n in stored if n + "_scale_inv" in self.tensors)
        self.config = {**config, "quantization_config": QUANT}
        self.path, self.reference = tmp / "fp8", tmp / "dequantised"
        write(self.path, self.tensors, self.config)
        write(self.reference, dequantised, config)
        self.torch = transformers.AutoModelForCausalLM.from_pretrained(
            self.reference, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=["qwen3", "deepseek_v3"])
def checkpoint(request, tmp_path_factory):
    return Checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return Checkpoint("qwen3", tmp_path_factory.mktemp("qwen3_refusals"))


def test_loads_as_the_dequantised_checkpoint_with_transformers_logits(checkpoint):
    """Every param equals the torch-dequantised checkpoint's bit for bit (the same float32
    product); the logits are transformers' on that checkpoint within TOL; the quantisation
    matters (it moves the logits by far more than TOL)."""
    assert checkpoint.quantised and all(t.dtype == torch.float8_e4m3fn for n, t in
                                        checkpoint.tensors.items() if n in checkpoint.quantised)
    config, params = hf.load(checkpoint.path, dtype="float32")
    _, reference = hf.load(checkpoint.reference)
    assert_same(params, reference)
    ours = jit_logits(config, params, *INPUTS)
    theirs = torch_logits(checkpoint.torch, *INPUTS)
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)
    original = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint.path.parent / "original", dtype=torch.float32).eval()
    assert np.abs(torch_logits(original, *INPUTS) - theirs).max() > 100 * TOL


def test_export_quantises_what_the_checkpoint_had(checkpoint, tmp_path):
    """``save(fp8_block=BLOCK)`` of the loaded params quantises the same tensors (projections,
    experts one by one, shared experts; not the router) and reads back bit for bit."""
    config, params = hf.load(checkpoint.path, dtype="float32")
    hf.save(config, params, tmp_path, fp8_block=BLOCK)
    stored = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    assert sorted(n for n in stored if n + "_scale_inv" in stored) == checkpoint.quantised
    assert_same(hf.load(tmp_path, dtype="float32")[1], params)


def test_default_dtype_is_the_unquantised_tensors(qwen3, tmp_path):
    """Without ``dtype`` the params take the unquantised tensors' dtype (bfloat16 here, as
    the published checkpoints): the float32 products rounded once more."""
    tensors = {n: t if n.endswith("_scale_inv") or t.dtype == torch.float8_e4m3fn
               else t.to(torch.bfloat16) for n, t in qwen3.tensors.items()}
    write(tmp_path, tensors, qwen3.config)
    config, params = hf.load(tmp_path)
    _, reference = hf.load(qwen3.reference)
    assert config.param_dtype == "bfloat16"
    q = params["blocks_0"]["attn"]["q_proj"]
    np.testing.assert_array_equal(
        np.asarray(q), np.asarray(reference["blocks_0"]["attn"]["q_proj"]).astype(q.dtype))


def test_blocks_read_as_the_whole_tensor():
    """A block of the value (a device's shard, steps on either axis, a 3-D experts' stack)
    reads only the scales it touches and equals the whole tensor's block, which equals a
    loop over the blocks."""
    rng = np.random.default_rng(0)
    weight = rng.normal(0, 50, (3, 70, 50)).astype(ml_dtypes.float8_e4m3fn)
    scales = rng.uniform(0.5, 2.0, (3, 3, 3)).astype(np.float32)  # blocks 32 x 20
    block = (32, 20)
    whole = fp8.dequantize(weight, scales, block)
    loop = weight.astype(np.float32)
    for i in range(3):
        for j in range(3):
            loop[:, i * 32:(i + 1) * 32, j * 20:(j + 1) * 20] *= scales[:, i, j, None, None]
    np.testing.assert_array_equal(whole, loop)
    reads = []
    scaled = fp8.Scaled("w", weight.shape, block, lambda i: weight[i],
                        lambda i: reads.append(i) or scales[i])
    s = slice
    for index, grid in [((s(None),) * 3, (s(0, 3), s(0, 3))),
                        ((s(1, 2), s(33, 64), s(5, 39)), (s(1, 2), s(0, 2))),
                        ((s(0, 3), s(1, 70, 3), s(45, 50)), (s(0, 3), s(2, 3))),
                        ((s(2, 3), s(64, 70), s(0, 50, 7)), (s(2, 3), s(0, 3)))]:
        np.testing.assert_array_equal(scaled[index], whole[index])
        assert reads[-1][-2:] == grid


def test_quantize_rounds_within_e4m3_and_is_stable():
    """``quantize``: each block's scale is its max |w| / 448 (1 for a zero block), each value
    within half an e4m3 step (2^-4 relative; 2^-10 of the scale below the normals), and the
    dequantised value quantises to the same bytes."""
    rng = np.random.default_rng(1)
    w = (rng.normal(0, 1, (2, 40, 30)) * rng.uniform(1e-3, 10, (2, 1, 30))).astype(np.float32)
    w[1, 32:, :] = 0  # a zero block
    q, scale = fp8.quantize(w, (32, 16))
    assert q.dtype == fp8.E4M3 and scale.shape == (2, 2, 2) and scale.dtype == np.float32
    for i in range(2):
        for j in range(2):
            amax = np.abs(w[:, i * 32:(i + 1) * 32, j * 16:(j + 1) * 16]).max((1, 2))
            np.testing.assert_array_equal(scale[:, i, j],
                                          np.where(amax > 0, amax / np.float32(448), 1))
    value = fp8.dequantize(q, scale, (32, 16))
    spread = np.repeat(np.repeat(scale, 32, 1), 16, 2)[:, :40, :30]
    assert np.all(np.abs(value - w) <= np.maximum(np.abs(w) * 2.0**-4, spread * 2.0**-10))
    q2, scale2 = fp8.quantize(value, (32, 16))
    np.testing.assert_array_equal(q2.view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(scale2, scale)


@pytest.fixture(scope="module")
def loaded(qwen3):
    return hf.load(qwen3.path, dtype="float32")


def test_export_writes_the_format_transformers_reads(qwen3, loaded, tmp_path):
    """``save(fp8_block=(16, 16))``: the projections as e4m3 with [O/16, I/16] float32 scales,
    the rest unquantised; each value within e4m3's rounding of the param; transformers loads
    it (dequantising on CPU) with our logits of it; exported again it is the same bytes."""
    config, params = loaded
    hf.save(config, params, tmp_path / "a", fp8_block=(16, 16))
    stored = safetensors_torch.load_file(str(tmp_path / "a" / "model.safetensors"))
    assert sorted(n for n in stored if n + "_scale_inv" in stored) == qwen3.quantised
    for name in qwen3.quantised:
        rows, cols = stored[name].shape
        assert stored[name].dtype == torch.float8_e4m3fn
        assert stored[name + "_scale_inv"].shape == (rows // 16, cols // 16)
    assert {t.dtype for n, t in stored.items() if n not in qwen3.quantised
            and not n.endswith("_scale_inv")} == {torch.float32}
    assert json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"] == {
        **QUANT, "weight_block_size": [16, 16]}

    _, back = hf.load(tmp_path / "a", dtype="float32")
    def close(new, old):  # half an e4m3 step; a block's scale is at most the tensor's max/448
        new, old = np.asarray(new), np.asarray(old)
        assert np.all(np.abs(new - old) <= np.abs(old) * 2.0**-4 + np.abs(old).max() * 2.0**-19)
    jax.tree.map(close, back, params)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "a", dtype=torch.float32, attn_implementation="eager").eval()
    np.testing.assert_allclose(jit_logits(config, back, *INPUTS),
                               torch_logits(theirs, *INPUTS), atol=TOL, rtol=0)
    hf.save(config, back, tmp_path / "b", fp8_block=(16, 16))
    again = safetensors_torch.load_file(str(tmp_path / "b" / "model.safetensors"))
    for name, t in stored.items():
        assert torch.equal(again[name].view(torch.uint8) if t.dtype == torch.float8_e4m3fn
                           else again[name], t.view(torch.uint8)
                           if t.dtype == torch.float8_e4m3fn else t), name


def test_export_cli_fp8(qwen3, tmp_path, capsys):
    """``export --fp8`` writes 128 x 128 blocks (one partial block per tensor here), which
    load; with ``--mxfp4`` it is a usage error (exit 2)."""
    out = tmp_path / "out"
    assert export_cli.main(["--checkpoint", str(qwen3.path), "--out", str(out),
                            "--no-tokenizer", "--fp8"]) == 0
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["quantization_config"]["weight_block_size"] == [128, 128]
    stored = safetensors_torch.load_file(str(out / "model.safetensors"))
    assert stored["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 1)
    hf.load(out)
    with pytest.raises(SystemExit) as e:
        export_cli.main(["--checkpoint", str(qwen3.path), "--out", str(out), "--fp8", "--mxfp4"])
    assert e.value.code == 2


@pytest.mark.parametrize("model_type, mxfp4, message", [
    ("gpt_oss", False, "HF gpt_oss checkpoints are not block-scaled FP8: its experts are MXFP4"),
    ("llama4_text", False, "HF llama4_text checkpoints are not block-scaled FP8: its experts "
     "are 3-D"),
    ("qwen3", True, "an export is either MXFP4 or FP8, not both")])
def test_export_refusals(model_type, mxfp4, message):
    with pytest.raises(ValueError, match=message):
        hf._check_fp8_export({"model_type": model_type}, (128, 128), mxfp4)


Q = "model.layers.0.self_attn.q_proj.weight"


def _config(**quant):
    return lambda tensors, config: config["quantization_config"].update(quant)


def _tensor(name, value):
    return lambda tensors, config: tensors.update({name: value(tensors[name])})


@pytest.mark.parametrize("change, message", [
    (_config(fmt="e5m2"), "FP8 checkpoints with fmt 'e5m2' are not supported"),
    (_config(activation_scheme="static"), "activation_scheme 'static' are not supported: "
     "loading dequantises the weights and runs activations unquantised"),
    (_config(weight_block_size=None), "per-tensor or per-channel FP8 scales are not supported"),
    (_config(weight_block_size=[128]), "weight_block_size must be two positive ints"),
    (lambda tensors, config: tensors.pop(Q + "_scale_inv"),
     f"tensor {Q} is F8_E4M3 without block scales"),
    (_tensor(Q + "_scale_inv", lambda s: s.T.contiguous()),
     f"tensor {Q}_scale_inv has shape \\[3, 2\\], expected \\[2, 3\\]"),
    (_tensor(Q + "_scale_inv", lambda s: s[:, :2].contiguous()),
     f"tensor {Q}_scale_inv has shape \\[2, 2\\], expected \\[2, 3\\]"),
    (_tensor(Q + "_scale_inv", lambda s: s.half()),
     f"tensor {Q}_scale_inv has dtype F16, expected BF16 or F32 \\(fp8\\)"),
    (_tensor(Q, lambda q: q.float()), f"tensor {Q} has dtype F32, expected F8_E4M3 \\(fp8\\)"),
    (_tensor(Q + "_scale_inv", lambda s: s.index_fill(0, torch.tensor([1]), float("inf"))),
     f"tensor {Q} has FP8 values that are not finite"),
    (lambda tensors, config: tensors.update({"model.norm.weight_scale_inv": torch.ones(1)}),
     "tensor model.norm.weight cannot be block-scaled FP8: it has shape \\[64\\]"),
    (lambda tensors, config: tensors.update({"lm_head.bias_scale_inv": torch.ones(1)}),
     "unexpected tensors: lm_head.bias_scale_inv")])
def test_damaged_checkpoints_are_refused(qwen3, tmp_path, change, message):
    """Each in one line, naming the tensor or setting; all but the not-finite values before
    any weight is read."""
    tensors, config = dict(qwen3.tensors), json.loads(json.dumps(qwen3.config))
    change(tensors, config)
    write(tmp_path, tensors, config)
    with pytest.raises(ValueError, match=message) as e:
        hf.load(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("model_type", ["gpt_oss", "llama4_text"])
def test_families_with_3d_experts_refuse_fp8(model_type):
    with pytest.raises(ValueError, match="quant_method 'fp8'\\) are not supported"):
        hf.config_from_hf({"model_type": model_type, "quantization_config": QUANT})
