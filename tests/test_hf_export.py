"""``python -m transformer_jax.hf export``: a training run's checkpoint (LoRA adapters merged) as a
complete HF directory that transformers, ``hf.load`` and the generate CLI read; and the
``finetune`` preset.

The run directories are made here with ``CheckpointManager`` in the layout training saves
(``{"params": ..., "step": ...}`` with ``meta["model"]`` and ``meta["tokenizer"]``).

Needs the ``hf`` extra (torch, transformers, safetensors); skipped without it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformer_jax import hf  # noqa: E402
from transformer_jax.checkpoint.manager import CheckpointManager  # noqa: E402
from transformer_jax.cli import export as hf_export  # noqa: E402
from transformer_jax.model import lora  # noqa: E402
from transformer_jax.model.config import ModelConfig, load_toml  # noqa: E402
from transformer_jax.model.transformer import Transformer  # noqa: E402
from transformer_jax.tokenizer import Tokenizer  # noqa: E402
from transformer_jax.train.config import build_configs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-4
TEXT = "the quick brown fox jumps over the lazy dog"


def _corpus() -> list[str]:
    rng = np.random.default_rng(0)
    words = TEXT.split() + ["hello", "world", "jax", "model", "tokens", "export"]
    return [" ".join(rng.choice(words, size=int(rng.integers(3, 12)))) for _ in range(300)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "bpe.model"
    return Tokenizer.train(_corpus(), path, 300, "bpe")


def _config(tokenizer: Tokenizer, **changes) -> ModelConfig:
    return ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=4,
                       n_kv_heads=2, head_dim=8, d_ff=48, max_seq_len=64, init_std=0.3,
                       **changes)


def _params(config: ModelConfig, seed: int):
    """Random parameters at the config's init_std, drawn with numpy (helpers.random_params):
    an op-by-op ``init_params`` compiles a program per op and shape."""
    return jax.device_put(random_params(config, seed, std=config.init_std))


def _run_dir(path: Path, config: ModelConfig, params, tokenizer: Tokenizer, step: int = 2,
             lora_config: lora.LoraConfig | None = None) -> Path:
    """A run directory as training leaves it: checkpoints/<step> with params and meta."""
    meta = {"model": dataclasses.asdict(config), "tokenizer": str(tokenizer.path), "step": step}
    if lora_config is not None:
        meta["lora"] = lora_config.to_dict()
    manager = CheckpointManager(path / "checkpoints", async_save=False)
    manager.save(step, {"params": params, "step": jnp.asarray(step, jnp.int32)}, meta=meta)
    manager.close()
    return path


def _tokens(config: ModelConfig) -> np.ndarray:
    return np.random.default_rng(1).integers(0, config.vocab_size, (2, 10)).astype(np.int32)


@functools.partial(jax.jit, static_argnums=0)
def _forward(config: ModelConfig, params, tokens):
    return Transformer(config).apply({"params": params}, tokens).logits


def _ours(config: ModelConfig, params) -> np.ndarray:
    """One compiled forward (op by op, each op of each new model compiles apart)."""
    return np.asarray(_forward(config, params, jnp.asarray(_tokens(config))))


def _theirs(out: Path, config: ModelConfig) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(_tokens(config), dtype=torch.long)).logits.numpy()


def _assert_identical(a, b) -> None:
    fa = jax.tree_util.tree_flatten_with_path(a)[0]
    fb = dict(jax.tree_util.tree_flatten_with_path(b)[0])
    assert [p for p, _ in fa] == list(fb)
    for p, x in fa:
        assert np.asarray(x).dtype == np.asarray(fb[p]).dtype, p
        np.testing.assert_array_equal(np.asarray(x), np.asarray(fb[p]), err_msg=str(p))


def test_export_of_a_run_loads_in_transformers_and_back(tmp_path, tokenizer):
    config = _config(tokenizer)
    params = _params(config, 0)
    run = _run_dir(tmp_path / "run", config, params, tokenizer)
    out = tmp_path / "hf"
    assert hf_export.main(["--checkpoint", str(run), "--out", str(out)]) == 0

    assert float(np.max(np.abs(_theirs(out, config) - _ours(config, params)))) < TOL
    loaded_config, loaded = hf.load(out)
    assert loaded_config == config.replace(init_std=loaded_config.init_std)
    _assert_identical(loaded, params)

    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto(TEXT, add_special_tokens=False)["input_ids"] == tokenizer.encode(TEXT)
    generation = json.loads((out / hf.GENERATION_CONFIG_FILE).read_text())
    assert generation["bos_token_id"] == tokenizer.bos_id
    assert generation["eos_token_id"] == tokenizer.eos_id
    saved = json.loads((out / hf.CONFIG_FILE).read_text())
    assert saved["eos_token_id"] == tokenizer.eos_id

    # The generate CLI finds the tokenizer in the export and runs.
    from transformer_jax.cli import generate
    assert generate.main(["--checkpoint", str(out), "--prompt", "the quick",
                          "--max-new-tokens", "3", "--json"]) == 0


def test_lora_run_is_merged_on_export(tmp_path, tokenizer):
    config = _config(tokenizer, scan_layers=True, qkv_bias=True, tie_embeddings=True)
    base = _params(config, 0)  # the scanned layout
    cfg = lora.LoraConfig(rank=2, alpha=4.0, targets=("q", "v", "o", "down"))
    # Adapters as if trained (B != 0): init_adapters' layout, drawn with numpy.
    shapes = jax.eval_shape(lambda p: lora.init_adapters(config, cfg, p, jax.random.key(1)), base)
    rng = np.random.default_rng(1)
    adapters = jax.device_put(jax.tree.map(
        lambda x: (0.05 + 0.1 * rng.standard_normal(x.shape)).astype(x.dtype), shapes))
    tree = {lora.BASE: lora.freeze_base(base, jnp.bfloat16), lora.ADAPTERS: adapters}
    run = _run_dir(tmp_path / "run", config, tree, tokenizer, lora_config=cfg)
    out = tmp_path / "hf"
    assert hf_export.main(["--checkpoint", str(run / "checkpoints" / "2"),
                           "--out", str(out)]) == 0

    merged = jax.tree.map(lambda x: x.astype(jnp.float32),
                          lora.merge(tree[lora.BASE], adapters, cfg, dtype=jnp.float32))
    _, loaded = hf.load(out, scan_layers=True)
    _assert_identical(loaded, merged)
    applied = lora.apply_adapters(tree[lora.BASE], adapters, cfg)
    assert float(np.max(np.abs(_theirs(out, config) - _ours(config, applied)))) < TOL


def test_reexport_of_a_hf_dir_through_the_module_cli(tmp_path, tokenizer):
    config = _config(tokenizer)
    params = _params(config, 2)
    first = tmp_path / "first"
    hf.save(config, params, first, tokenizer=tokenizer)
    second = tmp_path / "second"
    proc = subprocess.run(
        [sys.executable, "-m", "transformer_jax.hf", "export", "--checkpoint", str(first),
         "--out", str(second), "--dtype", "bfloat16"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded_config, loaded = hf.load(second)
    assert loaded_config.param_dtype == "bfloat16"
    _assert_identical(loaded, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
    assert (second / "tokenizer.model").read_bytes() == (first / "tokenizer.model").read_bytes()


def test_export_errors_are_named(tmp_path, tokenizer, capsys):
    assert hf_export.main(["--checkpoint", str(tmp_path / "nope"),
                           "--out", str(tmp_path / "o")]) == 1
    assert "does not exist" in capsys.readouterr().err
    config = _config(tokenizer)
    params = _params(config, 0)
    run = tmp_path / "run"
    manager = CheckpointManager(run / "checkpoints", async_save=False)
    manager.save(1, {"params": {lora.BASE: params, lora.ADAPTERS: {}}},
                 meta={"model": dataclasses.asdict(config)})
    assert hf_export.main(["--checkpoint", str(run), "--out",
                           str(tmp_path / "o")]) == 1
    assert "no meta['lora']" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_finetune_preset_loads_with_an_empty_model_section():
    assert load_toml("finetune").get("model", {}) == {}
    model, train, data = build_configs("finetune")
    assert model == ModelConfig()
    assert train.lr == 2e-5 and train.weight_decay == 0.0 and train.grad_clip == 1.0
    assert train.min_lr == pytest.approx(0.1 * train.lr)
    assert train.seq_len == 1024 and train.batch_size == 8 and train.grad_accum > 1
    assert train.eval_every == train.ckpt_every == 200 and train.sample_tokens == 0
    assert train.warmup_steps < 0.1 * train.steps
