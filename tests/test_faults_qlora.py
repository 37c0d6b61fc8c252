"""Issue 34, item 3 and the quantisation part of item 14: a QLoRA run on disk is used like any
LoRA run, and every quantisation spec is read by one strict parser.

A QLoRA run (``train.lora_base_quant=int8`` / ``nf4``, fine-tuned from a tiny HF Llama for two
steps, in process) is read back from its checkpoint on disk: ``load_for_decode`` (the loader of
``generate`` and ``serve``; ``evaluate`` opens checkpoints through the same ``loading.load``)
gives float weights equal to its quantised base dequantised plus the adapters' update, computed
here independently (NF4's table, the nibble order and the scales' tiling written out in numpy);
``generate`` decodes from it; ``export`` writes a HF directory whose logits in transformers
equal ours. Today's main fails each of them with ``'dict' object has no attribute 'shape'``.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, TINY, random_hf_model, write_chatml_tokenizer

from transformer_jax.checkpoint import loading
from transformer_jax.checkpoint.manager import CheckpointManager
from transformer_jax.decode import generation
from transformer_jax.model import lora
from transformer_jax.model import quant as quantization
from transformer_jax.model.ops.quantized import is_quantized
from transformer_jax.model.quant import dequantize_params, for_model, parse_quant, quantize_params
from transformer_jax.model.transformer import Transformer, abstract_params, stack_blocks
from transformer_jax.parallel import sharding as sharding_lib
from transformer_jax.train.config import TrainConfig

pytestmark = pytest.mark.usefixtures("shared_compilation_cache", "fast_generate_compiles")

WORDS = "the cat dog sat ran on a mat log red blue what is who answer yes no".split()
VOCAB = 40
# QLoRA's NormalFloat levels (Dettmers et al. 2023, appendix E), a level index 0..15 each.
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0])
# The axis a 4-bit weight (stored inputs first, as training holds the base) packs two values
# a byte along: its last input axis.
PACKED_AXIS = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate": 0, "up": 0,
               "down": 0, "lm_head": 0, "embedding": 1}
TOKENS = np.random.default_rng(1).integers(0, VOCAB, (2, 10)).astype(np.int32)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("llama")
    model = random_hf_model("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=64, tie_word_embeddings=False)
    model.save_pretrained(directory, safe_serialization=True)
    write_chatml_tokenizer(directory, ["system", "user", "assistant", *WORDS],
                           add_eos_token=False)
    return directory


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    lines = [{"prompt": f"what is the {rng.choice(['cat', 'dog'])} on the mat",
              "completion": f" answer {rng.choice(['red', 'blue'])}"} for _ in range(16)]
    path = tmp_path_factory.mktemp("sft") / "sft.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module", params=["int8", "nf4"])
def qlora_run(request, hf_dir, sft, tmp_path_factory) -> Path:
    """``train.py --config finetune train.init_from=HF data.path=sft.jsonl train.lora_rank=4
    train.lora_base_quant=Q``, two steps, in process."""
    from transformer_jax.train import run as training
    from transformer_jax.train.config import build_configs

    run_dir = tmp_path_factory.mktemp(f"qlora_{request.param}")
    model, train, data = build_configs("finetune", [
        f"train.init_from={hf_dir}", f"data.path={sft}", f"train.run_dir={run_dir}",
        "train.lora_rank=4", f"train.lora_base_quant={request.param}", "train.steps=2",
        "train.ckpt_every=2", "train.batch_size=2", "train.grad_accum=1", "train.seq_len=32",
        "train.lr=2e-2", "train.warmup_steps=1", "train.log_every=1", "train.mesh=1,1,1",
        "train.eval_every=0", "data.val_fraction=0", "train.peak_flops=1e9"])
    with pytest.MonkeyPatch.context() as patch:  # no loss plot (matplotlib): not tested here
        patch.setattr(training, "_plot", lambda *args: None)
        assert training.run(model, train, data, progress=False,
                            memory_check=False).final_step == 2
    return run_dir


def _dequantised(path: tuple[str, ...], saved) -> np.ndarray:
    """A saved weight's float values, from its arrays alone."""
    if not isinstance(saved, dict):
        return np.asarray(saved, np.float64)
    scale = np.asarray(saved["scale"], np.float64)
    if "qvalue" in saved:  # int8: value x scale
        values = np.asarray(saved["qvalue"]).astype(np.float64)
    else:  # nf4: value 2i in the low nibble, 2i+1 in the high one; a level index each
        packed = np.asarray(saved["packed"])
        axis = PACKED_AXIS[path[-1]] + (path[0] == "blocks")
        pairs = np.stack([packed & 0xF, packed >> 4], axis=axis + 1)
        shape = list(packed.shape)
        shape[axis] *= 2
        values = NF4[pairs.reshape(shape)]
    for axis, (n, s) in enumerate(zip(values.shape, scale.shape, strict=True)):
        scale = np.repeat(scale, n // s, axis=axis)  # each scale covers a contiguous block
    return values * scale


def _expected(run_dir: Path) -> tuple[dict, float]:
    with CheckpointManager(run_dir / "checkpoints", read_only=True) as reader:
        saved, meta = reader.restore_params(None)
    flat = jax.tree_util.tree_flatten_with_path(
        saved[lora.BASE], is_leaf=lambda x: isinstance(x, dict) and ("qvalue" in x
                                                                     or "packed" in x))[0]
    params: dict = {}
    for keys, leaf in flat:
        path = tuple(str(k.key) for k in keys)
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _dequantised(path, leaf)
    scale = meta["lora"]["alpha"] / meta["lora"]["rank"]
    largest = 0.0
    for block, modules in saved[lora.ADAPTERS].items():
        for module, names in modules.items():
            for name, ab in names.items():
                a, b = np.asarray(ab["a"], np.float64), np.asarray(ab["b"], np.float64)
                stacked = block == "blocks"
                a2 = a.reshape(*a.shape[:int(stacked)], -1, a.shape[-1])
                b2 = b.reshape(*b.shape[:int(stacked) + 1], -1)
                update = (scale * a2 @ b2).reshape(params[block][module][name].shape)
                params[block][module][name] = params[block][module][name] + update
                largest = max(largest, float(np.abs(update).max()))
    return params, largest


@pytest.fixture(scope="module")
def expected(qlora_run) -> tuple[dict, float]:
    """``_expected`` of the run, computed once for its three tests (a restore each otherwise).
    """
    return _expected(qlora_run)


def _assert_close(got, want, atol=1e-5) -> None:
    assert jax.tree.structure(jax.tree.map(np.asarray, got)) == jax.tree.structure(want)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), w, atol=atol, rtol=0),
                 got, want)


def test_a_qlora_run_loads_for_decode_as_its_dequantised_base_plus_the_adapters(qlora_run,
                                                                               expected):
    want, largest = expected
    assert largest > 1e-4  # the adapters moved: the update is part of what is compared
    loaded, mesh = loading.load_for_decode(str(qlora_run), 1)
    assert mesh is None and loaded.tokenizer is not None
    assert {x.dtype for x in jax.tree.leaves(loaded.params)} == {jnp.dtype(jnp.float32)}
    _assert_close(loaded.params, want)
    # Placed on a mesh in the other layer layout (as train.init_from=RUN reads it).
    mesh = sharding_lib.make_mesh(sharding_lib.MeshConfig(1, 1, 1))
    placed = loading.load(qlora_run, mesh, scan_layers=True, with_tokenizer=False).params
    _assert_close(placed, jax.tree.map(np.asarray, stack_blocks(want, loaded.config)))
    # As saved, the base is the quantised weights training held (PackedInt4 / QArray).
    raw = loading.load(qlora_run, merge_lora=False, with_tokenizer=False).params
    assert is_quantized(raw[lora.BASE]["blocks_0"]["mlp"]["down"])
    assert is_quantized(raw[lora.BASE]["embed"]["embedding"])


def test_a_qlora_run_generates(qlora_run, expected, capsys):
    from transformer_jax.cli import generate as cli

    assert cli.main(["--checkpoint", str(qlora_run), "--prompt-ids", "5,9,2,7",
                     "--max-new-tokens", "4", "--no-stop", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["tokens"]
    config = loading.locate(qlora_run).model
    want, _ = expected
    assert got == generation.generate(config, jax.tree.map(jnp.float32, want), [[5, 9, 2, 7]],
                                      max_new_tokens=4).tokens


def test_a_qlora_run_exports_merged_weights_that_transformers_loads(qlora_run, expected,
                                                                   tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformer_jax.cli import export as hf_export

    out = tmp_path / "hf"
    assert hf_export.main(["--checkpoint", str(qlora_run), "--out", str(out)]) == 0
    model = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    with torch.no_grad():
        theirs = model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    config = loading.locate(qlora_run).model
    want, _ = expected
    apply = jax.jit(Transformer(config).apply, compiler_options=FAST_COMPILE)
    ours = apply({"params": jax.tree.map(jnp.float32, want)}, jnp.asarray(TOKENS)).logits
    np.testing.assert_allclose(theirs, np.asarray(ours), atol=1e-4, rtol=0)


# The saved form alone, every scheme and layout (no training) ------------------------------------

def _as_saved(tree):
    """What orbax restores without a target: every quantised weight a dict of its arrays."""
    def plain(x):
        if not is_quantized(x):
            return x
        fields = ("packed", "scale") if hasattr(x, "packed") else ("qvalue", "scale")
        return {f: np.asarray(getattr(x, f)) for f in fields}

    return jax.tree.map(plain, tree, is_leaf=is_quantized)


def _random_params(config) -> dict:
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype),
                        abstract_params(config))


@pytest.mark.parametrize("spec, scanned", [("int8", True), ("int4", False), ("nf4:8", True)])
def test_a_saved_quantised_base_is_rebuilt_as_quantize_params_made_it(spec, scanned):
    config = TINY.replace(scan_layers=scanned)
    quant = for_model(config, parse_quant(spec))
    made = jax.jit(lambda p: quantize_params(p, quant),
                   compiler_options=FAST_COMPILE)(_random_params(config))
    rebuilt = quantization.from_saved(_as_saved(made), spec)  # new: not on base
    assert jax.tree.structure(rebuilt) == jax.tree.structure(made)
    dequantise = jax.jit(dequantize_params, compiler_options=FAST_COMPILE)
    jax.tree.map(np.testing.assert_array_equal, dequantise(rebuilt), dequantise(made))


def test_a_saved_base_that_its_meta_does_not_describe_is_a_clear_error():
    int8 = {"qvalue": np.ones((32, 32), np.int8), "scale": np.ones((1, 32), np.float32)}
    saved = {lora.BASE: {"blocks_0": {"mlp": {"down": int8}}}, lora.ADAPTERS: {}}
    meta = {"lora": {"rank": 2, "alpha": 4.0, "targets": ["down"]}}
    with pytest.raises(ValueError, match=r"RUN: the quantised weight blocks_0/mlp/down is "
                                         "saved int8, not nf4"):
        lora.merge_checkpoint_params(saved, {**meta, "train": {"lora_base_quant": "nf4"}}, "RUN")
    with pytest.raises(ValueError, match="RUN holds a quantised LoRA base but its meta has no "
                                         "train.lora_base_quant"):
        lora.merge_checkpoint_params(saved, {**meta, "train": {}}, "RUN")


# Item 14: one strict parser of quantisation specs ------------------------------------------------

@pytest.mark.parametrize("spec", ["int4:²", "nf4:٨", "int4:0", "int4:-8", "int4:+8", "int4:",
                                  "nf4: 8", "int4:8 ", "int4:6.0", "int4:" + "8" * 5000])
def test_a_bad_group_size_is_one_line_naming_the_setting_and_what_it_accepts(spec):
    with pytest.raises(ValueError) as error:
        parse_quant(spec)
    message = str(error.value)
    assert message.startswith(f"quant {spec.partition(':')[0]}:G ") and (
        "even integer >= 2" in message)
    assert "\n" not in message and "invalid literal" not in message


@pytest.mark.parametrize("spec, want", [("int8", ("int8", None)), ("int4", ("int4", None)),
                                        ("nf4:8", ("nf4", 8)), ("int4:064", ("int4", 64))])
def test_good_specs_parse(spec, want):
    quant = parse_quant(spec)
    assert (quant.scheme, quant.group_size) == want


def test_generate_refuses_a_bad_quant_before_reading_the_checkpoint(capsys, tmp_path):
    from transformer_jax.cli import generate as cli

    assert cli.main(["--checkpoint", str(tmp_path / "missing"), "--prompt-ids", "1",
                     "--quant", "int4:²"]) == 1
    err = capsys.readouterr().err
    assert "--quant int4:G needs G" in err and "does not exist" not in err


def test_train_lora_base_quant_is_checked_by_the_same_parser():
    with pytest.raises(ValueError, match=r"train.lora_base_quant nf4:G needs G.*'nf4:²'"):
        TrainConfig(lora_rank=2, lora_base_quant="nf4:²")
    with pytest.raises(ValueError, match="train.lora_base_quant int8 takes no group size"):
        TrainConfig(lora_rank=2, lora_base_quant="int8:8")
    assert TrainConfig(lora_rank=2, lora_base_quant="nf4:8").lora_base_quant == "nf4:8"
