"""Fine-tuning end to end: ``train.init_from`` (HF and run checkpoints), instruction data
(``.jsonl``: loss masks, packing), LoRA in the run, export, and the errors of bad input.

Every checkpoint and tokenizer is made here: tiny Llama (GQA) and Qwen2 (biases, tied embeddings)
models randomly initialised by transformers and saved with ``save_pretrained``, and a word-level
``tokenizer.json`` with a ChatML template built with the ``tokenizers`` library. No network.

Needs the ``hf`` extra (torch, transformers, safetensors); skipped without it.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TRAIN_CLI_NO_PLOT, random_params, write_chatml_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from transformer_jax.checkpoint import loading  # noqa: E402
from transformer_jax.checkpoint.manager import CheckpointManager  # noqa: E402
from transformer_jax.cli import export as hf_export  # noqa: E402
from transformer_jax.data import instruct  # noqa: E402
from transformer_jax.model import lora  # noqa: E402
from transformer_jax.model.config import ModelConfig  # noqa: E402
from transformer_jax.model.transformer import Transformer, unstack_blocks  # noqa: E402
from transformer_jax.parallel import sharding as sharding_lib  # noqa: E402
from transformer_jax.train.config import ConfigError, TrainConfig, build_configs  # noqa: E402
from transformer_jax.train.optim import decay_mask  # noqa: E402
from transformer_jax.train.run import run  # noqa: E402
from transformer_jax.train.step import ParamsLayout, make_init_fn, make_loss_fn  # noqa: E402

# The runs of this module (run() called again, init_from) share compiled programs.
pytestmark = pytest.mark.usefixtures("shared_compilation_cache")

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-4
WORDS = ("the cat dog sat ran on a mat log red blue big small what is who where answer "
         "yes no one two three").split()
VOCAB = 48  # the tiny models' vocabulary (the tokenizer has fewer tokens)
# Short CI-sized fine-tuning overrides of the finetune preset.
SMALL = ["train.batch_size=4", "train.grad_accum=1", "train.seq_len=32", "train.lr=3e-3",
         "train.min_lr=3e-4", "train.warmup_steps=2", "train.log_every=1", "train.mesh=1,1,1"]
# The in-process runs hold out no validation split: no evaluation program to compile (the CLI
# run's val_loss is its test's).
NO_VAL = "data.val_fraction=0"


@pytest.fixture
def no_plots(monkeypatch):
    """In-process runs draw no loss plot (test_plot's subject; 0.3-1 s a run here)."""
    from transformer_jax.train import plot

    monkeypatch.setattr(plot, "plot_run", lambda run_dir: None)


def _tokenizer_dir(directory: Path, extra_words: int = 0) -> Path:
    """A word-level tokenizer.json (+ tokenizer_config.json with a ChatML template)."""
    words = ["system", "user", "assistant", *WORDS, *(f"w{i}" for i in range(extra_words))]
    return write_chatml_tokenizer(directory, words, add_eos_token=False)


def _hf_dir(directory: Path, kind: str) -> Path:
    """A tiny randomly initialised HF model saved with save_pretrained, plus the tokenizer."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-5, initializer_range=0.2)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**common, tie_word_embeddings=False))
    elif kind == "gemma3":  # local and global layers, QK-norm, (1 + w) norms, tied
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **common, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"]))
    elif kind == "olmo2":  # norms after the sublayers, QK-norm over whole projections
        model = transformers.Olmo2ForCausalLM(
            transformers.Olmo2Config(**common, tie_word_embeddings=False))
    elif kind == "phi3":  # the Llama block with fused q/k/v and gate/up tensors
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
            **common, pad_token_id=0, tie_word_embeddings=False))
    else:
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**common, tie_word_embeddings=True))
    with torch.no_grad():  # transformers starts biases at 0 and norm gains at 1: a loader
        for name, p in model.named_parameters():  # that dropped or swapped them would pass
            if "bias" in name or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    _tokenizer_dir(directory)
    return directory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return _hf_dir(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return _hf_dir(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> Path:
    return _hf_dir(tmp_path_factory.mktemp("gemma3"), "gemma3")


@pytest.fixture(scope="module")
def olmo2_dir(tmp_path_factory) -> Path:
    return _hf_dir(tmp_path_factory.mktemp("olmo2"), "olmo2")


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    """Prompt/completion and chat records with a learnable rule (answer = the colour word)."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(48):
        animal, colour = rng.choice(["cat", "dog"]), rng.choice(["red", "blue"])
        if i % 2:
            lines.append({"prompt": f"what is the {animal} on the {colour} mat",
                          "completion": f" answer {colour} {colour}"})
        else:
            lines.append({"messages": [
                {"role": "user", "content": f"who sat on the {colour} log"},
                {"role": "assistant", "content": f"the {animal} {colour} {colour}"}]})
    path = tmp_path_factory.mktemp("sft") / "data.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def _tokens(n: int = 12) -> np.ndarray:
    return np.random.default_rng(1).integers(0, VOCAB, (2, n)).astype(np.int32)


def _hf_logits(directory: Path) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                              torch_dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(_tokens(), dtype=torch.long)).logits.numpy()


def _initial_state(directory: Path, overrides: list[str]):
    model, train, _ = build_configs("finetune", [f"train.init_from={directory}", *overrides])
    mesh = sharding_lib.make_mesh(sharding_lib.MeshConfig.parse("1,1,1"))
    params = _init_params(train.init_from, model, mesh)
    state = jax.jit(make_init_fn(model, train))(jax.random.key(0), params)
    return model, train, state


def _init_params(path, model: ModelConfig, mesh):
    """The params ``train.init_from=PATH`` starts a run of ``model`` from."""
    return loading.load(path, mesh, scan_layers=model.scan_layers, dtype=model.param_dtype,
                        with_tokenizer=False).params


@functools.partial(jax.jit, static_argnums=0)
def _forward(model: ModelConfig, params, tokens):
    return Transformer(model).apply({"params": params}, tokens).logits


def _logits(model: ModelConfig, params) -> np.ndarray:
    """One compiled forward (op by op, each op of each new model compiles apart)."""
    return np.asarray(_forward(model, params, jnp.asarray(_tokens())))


@pytest.mark.parametrize("kind,overrides", [
    ("llama", []), ("qwen2", []), ("llama", ["train.lora_rank=4", "model.scan_layers=true"]),
    ("olmo2", [])])
def test_init_from_hf_gives_its_logits(request, kind, overrides):
    directory = request.getfixturevalue(f"{kind}_dir")
    model, train, state = _initial_state(directory, overrides)
    assert model.vocab_size == VOCAB and model.qkv_bias == (kind == "qwen2")
    params = ParamsLayout.of(train).model_params(state.params)
    np.testing.assert_allclose(_logits(model, params), _hf_logits(directory), atol=TOL, rtol=0)


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "loss" in m]


def _unrolled(params):
    return unstack_blocks(params)  # scanned groups split; unrolled params as they are


def _export_and_compare(run_dir: Path, out: Path) -> None:
    """Export, transformers' logits = ours, and init_from of the export = its weights exactly."""
    # The checkpoints/ directory: hf_export takes a run directory's config.json for a HF one.
    checkpoints = run_dir / "checkpoints"
    assert hf_export.main(["--checkpoint", str(checkpoints), "--out", str(out)]) == 0
    loaded = loading.load(checkpoints, with_tokenizer=False)
    config, merged = loaded.config, loaded.params
    np.testing.assert_allclose(_hf_logits(out), _logits(config, merged), atol=TOL, rtol=0)
    merged = _unrolled(merged)  # a scanned run's compared in the unrolled layout
    model, _, _ = build_configs("finetune", [f"train.init_from={out}"])
    mesh = sharding_lib.make_mesh(sharding_lib.MeshConfig.parse("1,1,1"))
    again = _unrolled(_init_params(out, model, mesh))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 again, merged)
    # init_from the run itself (orbax; LoRA adapters merged) gives the same weights.
    model, _, _ = build_configs("finetune", [f"train.init_from={run_dir}"])
    again = _unrolled(_init_params(run_dir, model, mesh))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 again, merged)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory) -> Path:
    return _hf_dir(tmp_path_factory.mktemp("phi3"), "phi3")


def test_finetune_cli_full_of_a_phi3_exports_as_phi3(phi3_dir, jsonl, tmp_path):
    """``python train.py --config finetune train.init_from=DIR data.path=FILE.jsonl`` (the
    CLI's main in a fresh process, no loss plot), full fine-tuning from a Phi-3 checkpoint.
    Its config is the plain Llama block, which export would write as ``llama``: the run records
    its family, and export writes ``phi3`` (fused tensors) by default, with transformers'
    logits equal to ours."""
    run_dir = tmp_path / "full"
    cmd = [*TRAIN_CLI_NO_PLOT, "--config", "finetune", "--no-progress", "--no-memory-check",
           "--cpu-devices", "1", f"train.init_from={phi3_dir}", f"data.path={jsonl}",
           f"train.run_dir={run_dir}", "train.steps=30", "data.val_fraction=0.1", *SMALL]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [m["loss"] for m in _metrics(run_dir)]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:3])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["val_loss"] is not None and summary["final_step"] == 30
    _export_and_compare(run_dir, tmp_path / "export")  # export of checkpoints/, by default:
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (exported["model_type"], exported["architectures"]) == ("phi3", ["Phi3ForCausalLM"])
    assert loading.locate(run_dir).hf_model_type == "phi3"  # from the checkpoints' meta
    # Of the run directory, with --model-type naming another family.
    assert hf_export.main(["--checkpoint", str(run_dir), "--out", str(tmp_path / "llama"),
                           "--model-type", "llama"]) == 0
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["model_type"] == "llama"


def test_lora_finetune_of_layers_that_differ_resumes_exactly_and_exports_to_its_family(
        gemma3_dir, jsonl, tmp_path, no_plots):
    """A scanned LoRA run from a checkpoint whose layers differ (local and global, QK-norm,
    (1 + w) norms), killed before its last checkpoint and resumed, is exactly the
    uninterrupted run; it trains its adapters only, and exports to its own HF class."""
    run_dir = tmp_path / "lora"
    base = [f"train.init_from={gemma3_dir}", f"data.path={jsonl}", f"train.run_dir={run_dir}",
            "train.decay_steps=30", "train.ckpt_every=10", "train.keep_ckpts=5",
            "train.lora_rank=4", "train.lora_targets=q,v,down", "model.scan_layers=true",
            *SMALL, "train.lr=1e-2", NO_VAL]
    model, train, data = build_configs("finetune", [*base, "train.steps=30"])
    assert model.layer_kinds() == ("local", "global") and model.qk_norm == "head"
    straight_run = run(model, train, data, progress=False, memory_check=False)
    assert straight_run.final_step == 30
    with CheckpointManager(run_dir / "checkpoints", async_save=False) as manager:
        straight, _ = manager.restore_params(None, 30)
    shutil.rmtree(run_dir / "checkpoints" / "30")  # killed before step 30's checkpoint
    # The second call resumes the run's own checkpoint (step 20), not init_from.
    summary = run(model, train, data, progress=False, memory_check=False)
    assert (summary.start_step, summary.final_step) == (20, 30)
    losses = [m["loss"] for m in _metrics(run_dir)]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:3])

    manager = CheckpointManager(run_dir / "checkpoints", async_save=False)
    first, meta = manager.restore_params(None, 10)
    last, _ = manager.restore_params(None, 30)
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "down"]}
    # The base is the checkpoint's weights (scanned) still; every A and B moved.
    mesh = sharding_lib.make_mesh(sharding_lib.MeshConfig.parse("1,1,1"))
    jax.tree.map(np.testing.assert_array_equal, last[lora.BASE],
                 jax.device_get(_init_params(gemma3_dir, model, mesh)))
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), first[lora.ADAPTERS],
                           last[lora.ADAPTERS])
    assert all(jax.tree.leaves(changed))
    manager.close()
    # The resumed run is exactly the uninterrupted one (its step 30, taken before the kill).
    jax.tree.map(np.testing.assert_array_equal, straight, last)
    _export_and_compare(run_dir, tmp_path / "export")
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["architectures"] == ["Gemma3ForCausalLM"]


def test_lora_state_moments_are_adapter_sized():
    model = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=64, max_seq_len=32)
    train = TrainConfig(steps=10, lora_rank=2, lora_base_dtype="bfloat16", weight_decay=0.1)
    state = jax.eval_shape(make_init_fn(model, train), jax.random.key(0))
    adapter_shapes = {x.shape for x in jax.tree.leaves(state.params[lora.ADAPTERS])}
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert moments and all(x.shape in adapter_shapes for x in moments)
    assert sum(x.size for x in moments) == 2 * lora.adapter_count(state.params[lora.ADAPTERS])
    assert {x.dtype for x in jax.tree.leaves(state.params[lora.BASE])} == {
        jnp.dtype(jnp.bfloat16)}
    assert all(jax.tree.leaves(decay_mask(state.params[lora.ADAPTERS])))  # A, B are matrices


def _tiny_model() -> tuple[ModelConfig, dict]:
    model = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=64, max_seq_len=32, init_std=0.2)
    # Drawn with numpy: init_params op by op compiles each of its ops apart.
    return model, jax.device_put(random_params(model))


def test_prompt_tokens_get_zero_gradient():
    model, params = _tiny_model()
    loss = make_loss_fn(model, TrainConfig())
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, VOCAB, (2, 16)).astype(np.int32)
    targets = rng.integers(0, VOCAB, (2, 16)).astype(np.int32)
    mask = (np.arange(16) >= 9)[None].repeat(2, 0).astype(np.float32)  # prompt: targets 0-8
    other = np.where(mask > 0, targets, (targets + 7) % VOCAB)

    grad = jax.jit(jax.grad(lambda p, batch: loss(p, batch)[0]))  # one program for both

    def grads(t):
        batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(t),
                 "mask": jnp.asarray(mask)}
        return grad(params, batch)

    jax.tree.map(np.testing.assert_array_equal, grads(targets), grads(other))


def test_packed_loss_is_the_token_weighted_mean_of_the_examples():
    model, params = _tiny_model()
    loss = jax.jit(make_loss_fn(model, TrainConfig()))
    rng = np.random.default_rng(2)
    examples = [instruct.Example(rng.integers(0, VOCAB, n).astype(np.int32),
                                 np.arange(n) >= n // 2, i) for i, n in enumerate((9, 7, 5))]
    packed = instruct.pack(examples, seq_len=23)
    assert packed.num_rows == 1  # all three in one row
    batch = {k: jnp.asarray(v) for k, v in instruct.rows_to_batch(packed, np.array([0])).items()}
    batch["mask"] = batch.pop("loss_mask")
    _, (ce, _, count) = loss(params, batch)

    # Each example alone, unpacked: a row each, right-padded (masked) to the longest: one
    # program for the three (the sums add over the rows).
    width = max(len(ex.tokens) for ex in examples) - 1

    def rows(key, cut):
        return np.stack([np.pad(getattr(ex, key)[cut], (0, width - len(ex.tokens) + 1))
                         for ex in examples])

    alone = {"inputs": rows("tokens", slice(None, -1)), "targets": rows("tokens", slice(1, None)),
             "mask": rows("loss", slice(1, None)).astype(np.float32)}
    _, (ce_sum, _, tokens) = loss(params, alone)
    assert float(count) == float(tokens)
    np.testing.assert_allclose(float(ce) / float(count), float(ce_sum) / float(tokens),
                               rtol=1e-5)

    # No attention across segments: changing one example leaves the others' logits alone.
    @jax.jit
    def forward(inputs):
        return Transformer(model).apply({"params": params}, inputs, positions=batch["positions"],
                                        segment_ids=batch["segment_ids"]).logits

    def logits(inputs):
        return np.asarray(forward(inputs))

    segments = np.asarray(batch["segment_ids"][0])
    first = segments == segments[0]
    inputs = np.asarray(batch["inputs"])
    changed = np.where(first[None], (inputs + 1) % VOCAB, inputs)
    np.testing.assert_array_equal(logits(batch["inputs"])[0, ~first],
                                  logits(changed)[0, ~first])


def test_bad_input_is_a_clear_error_before_training(llama_dir, jsonl, tmp_path):
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no weights"):
        build_configs("finetune", [f"train.init_from={no_weights}"])
    with pytest.raises(FileNotFoundError, match="neither a HF checkpoint"):
        build_configs("finetune", [f"train.init_from={tmp_path}"])

    with pytest.raises(ConfigError, match=r"model\.n_layers=3"):
        build_configs("finetune", [f"train.init_from={llama_dir}", "model.n_layers=3"])
    with pytest.raises(ConfigError, match=r"model\.max_seq_len=128"):
        build_configs("finetune", [f"train.init_from={llama_dir}", "model.max_seq_len=128"])
    model, _, _ = build_configs("finetune", [f"train.init_from={llama_dir}",
                                             "model.dtype=bfloat16", "model.max_seq_len=32"])
    assert (model.dtype, model.max_seq_len, model.n_kv_heads) == ("bfloat16", 32, 2)
    # A preset written for another model (the default, tiny) gives way to the checkpoint; its
    # settings that change no weight are kept, a command-line change is still an error.
    source = loading.locate(llama_dir).model
    model, _, _ = build_configs("tiny", [f"train.init_from={llama_dir}"])
    assert model == source.replace(dtype=model.dtype, param_dtype=model.param_dtype)
    with pytest.raises(ConfigError, match=r"model\.d_model=128"):
        build_configs("tiny", [f"train.init_from={llama_dir}", "model.d_model=128"])

    unrepresentable = tmp_path / "gelu"
    unrepresentable.mkdir()
    config = json.loads((llama_dir / "config.json").read_text())
    (unrepresentable / "config.json").write_text(json.dumps({**config,
                                                             "hidden_act": "gelu_new"}))
    (unrepresentable / "model.safetensors").write_bytes(
        (llama_dir / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError, match="hidden_act"):
        build_configs("finetune", [f"train.init_from={unrepresentable}"])

    big = _tokenizer_dir(tmp_path / "big_tok", extra_words=VOCAB)
    run_dir = tmp_path / "run"
    model, train, data = build_configs("finetune", [
        f"train.init_from={llama_dir}", f"data.path={jsonl}", f"data.tokenizer={big}",
        f"train.run_dir={run_dir}", "train.steps=3", *SMALL])
    with pytest.raises(ValueError, match=r"more than the vocab_size=48"):
        run(model, train, data, progress=False)
    # A model that is not the checkpoint's, given to run() directly, is refused too.
    model, train, data = build_configs("finetune", [
        f"train.init_from={llama_dir}", f"data.path={jsonl}", f"train.run_dir={run_dir}",
        "train.steps=3", *SMALL])
    with pytest.raises(ValueError, match=r"model\.d_ff=96"):
        run(model.replace(d_ff=96), train, data, progress=False)
    assert not (run_dir / "checkpoints").exists()
