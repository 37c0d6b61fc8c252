"""File and I/O faults around generation and export, each reproduced here:

* ``hf export --out`` never writes over a training run's files, and replaces a directory that
  is not an earlier export only with ``--overwrite``;
* generation prompts as fine-tuning trained (bos as the tokenizer says; ``--chat``);
* ``generate --tensor 2`` / ``--tensor 0`` on a training run's checkpoint;
* generate, ``init_from``, export and plot on a read-only run (``tests/read_only.py`` says how);
* written files get the umask's mode, not ``tempfile``'s owner-only one;
* ``generate --seed`` out of range is one line;
* a fine-tuning preset's seq_len gives way to a checkpoint with a shorter context.

Every checkpoint, tokenizer and corpus is made here.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import read_only
from helpers import CHATML, FAST_COMPILE, FAST_XLA_FLAGS, write_chatml_tokenizer

from transformer_jax.checkpoint.manager import CHECKSUMS_FILE, CheckpointManager
from transformer_jax.cli import export as hf_export
from transformer_jax.data import instruct
from transformer_jax.decode import generation
from transformer_jax.model import lora
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import init_params
from transformer_jax.storage import files
from transformer_jax.tokenizer import ChatTemplate, Tokenizer, load_tokenizer
from transformer_jax.train import plot as plot_lib
from transformer_jax.train.config import ConfigError, build_configs

pytest.importorskip("safetensors")
tokenizers = pytest.importorskip("tokenizers")
from transformer_jax import hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_generate_compiles")
cli = importlib.import_module("transformer_jax.cli.generate")  # the package's name is the function

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                     d_ff=48, max_seq_len=64, init_std=0.2)
LORA = lora.LoraConfig(rank=2, alpha=4.0, targets=("q", "v", "down"))
ENV = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
           XLA_FLAGS=FAST_XLA_FLAGS)
TEXT = "the quick brown fox jumps over the lazy dog"
WORDS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "the", "cat",
         "sat", "on", "a", "mat", "what", "is", "jax"]


@pytest.fixture(scope="module")
def params():
    return jax.jit(init_params, static_argnums=0, compiler_options=FAST_COMPILE)(
        CONFIG, jax.random.key(0))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    return Tokenizer.train([f"{TEXT}. " * 20], path, vocab_size=40, model_type="char")


def save_run(run_dir: Path, params, tokenizer: Tokenizer, step: int = 2,
             lora_config: lora.LoraConfig | None = None, config: ModelConfig = CONFIG) -> Path:
    """A run directory as training leaves it: checkpoints, tokenizer copy, config.json and
    metrics.jsonl."""
    meta = {"model": dataclasses.asdict(config), "tokenizer_dir": "tokenizer", "step": step}
    if lora_config is not None:
        meta["lora"] = lora_config.to_dict()
    with CheckpointManager(run_dir / "checkpoints", async_save=False) as manager:
        manager.save(step, {"params": params, "step": jnp.int32(step)}, meta=meta)
    tokenizer.save(run_dir / "tokenizer")
    (run_dir / "config.json").write_text(json.dumps({"model": meta["model"], "train": {},
                                                     "data": {}}))
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "split": "train", "loss": 4.0 / s, "lr": 1e-3}) + "\n"
        for s in range(1, 6)))
    return run_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory, params, tokenizer) -> Path:
    return save_run(tmp_path_factory.mktemp("runs") / "run", params, tokenizer)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, params, tokenizer):
    adapters = jax.tree.map(lambda x: x + 0.05,
                            lora.init_adapters(CONFIG, LORA, params, jax.random.key(1)))
    tree = {lora.BASE: params, lora.ADAPTERS: adapters}
    path = save_run(tmp_path_factory.mktemp("runs") / "lora", tree, tokenizer,
                    lora_config=LORA)
    return path, lora.merge(params, adapters, LORA, dtype=jnp.float32)


def _hf_tokenizer(directory: Path, add_bos: bool, template: str | None = CHATML) -> Path:
    """A word-level tokenizer.json whose tokenizer_config.json says whether to add bos."""
    return write_chatml_tokenizer(directory, WORDS[5:], add_bos_token=add_bos,
                                  add_eos_token=False, chat_template=template, pad_token=None)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, params) -> Path:
    path = tmp_path_factory.mktemp("hf") / "model"
    hf.save(CONFIG, params, path)
    return path


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _tree_state(directory: Path) -> dict[str, tuple[int, int, int]]:
    return {str(p): (p.stat().st_mode, p.stat().st_size, p.stat().st_mtime_ns)
            for p in [directory, *sorted(directory.rglob("*"))]}


# a. export --out ---------------------------------------------------------------------------------

def test_export_never_writes_over_a_run_and_asks_before_replacing_other_files(
        tmp_path, params, tokenizer, capsys):
    run = save_run(tmp_path / "run", params, tokenizer)
    before = _tree_state(run)
    for out in (run, run / "checkpoints", run / "checkpoints" / "2", run / "tokenizer",
                run / "tb"):
        for extra in ([], ["--overwrite"]):
            assert hf_export.main(["--checkpoint", str(run), "--out", str(out),
                                   *extra]) == 1, out
            assert "training run" in _one_line_error(capsys.readouterr().err)
    assert _tree_state(run) == before  # the run's config.json and every other file untouched

    other = tmp_path / "notes"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert hf_export.main(["--checkpoint", str(run), "--out", str(other)]) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert "notes.txt" in line and "not an earlier export" in line and "--overwrite" in line
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    assert hf_export.main(["--checkpoint", str(run), "--out", str(other),
                           "--overwrite"]) == 0
    assert hf.load(other)[0].n_layers == CONFIG.n_layers

    inside = run / "hf"  # beside the run's files, not over them
    for _ in range(2):  # the second time over an earlier export: no --overwrite needed
        assert hf_export.main(["--checkpoint", str(run), "--out", str(inside)]) == 0
    assert sorted(p.name for p in run.iterdir()) == sorted(
        [Path(k).name for k in before if Path(k).parent == run] + ["hf"])


# b. the prompt format of fine-tuning -------------------------------------------------------------

@pytest.mark.parametrize("add_bos", [False, True])
def test_generate_prompts_with_bos_as_the_tokenizer_and_fine_tuning_say(
        tmp_path, hf_dir, add_bos, capsys):
    tok_dir = _hf_tokenizer(tmp_path / "tok", add_bos)
    tok = load_tokenizer(tok_dir)
    argv = ["--checkpoint", str(hf_dir), "--tokenizer", str(tok_dir), "--max-new-tokens", "2",
            "--json"]
    assert cli.main([*argv, "--prompt", "what is the cat"]) == 0
    ids = json.loads(capsys.readouterr().out)["prompt_ids"][0]
    head = tok.encode("what is the cat")
    assert ids == ([tok.bos_id] if add_bos else []) + head
    trained, _ = instruct.encode_prompt_completion("what is the cat", " a mat", tok)
    assert ids == list(trained[:len(ids)])  # what fine-tuning put before the completion

    assert cli.main([*argv, "--chat", "--prompt", "what is jax"]) == 0
    ids = json.loads(capsys.readouterr().out)["prompt_ids"][0]
    messages = [{"role": "user", "content": "what is jax"},
                {"role": "assistant", "content": "a cat"}]
    (prompt_piece, is_reply), _ = instruct.chat_pieces(ChatTemplate.of(tok), messages)[:2]
    assert not is_reply and ids == tok.encode(prompt_piece)
    assert ids[0] == tok.token_to_id("<|im_start|>") and tok.bos_id not in ids


def test_chat_stops_at_the_end_of_the_turn_and_needs_a_template(tmp_path, hf_dir, capsys):
    from transformer_jax.tokenizer.prompt import chat_turn_end_id

    tok = load_tokenizer(_hf_tokenizer(tmp_path / "chat", add_bos=True))
    assert chat_turn_end_id(tok) == tok.token_to_id("<|im_end|>") != tok.eos_id
    plain = _hf_tokenizer(tmp_path / "plain", add_bos=True, template=None)
    assert cli.main(["--checkpoint", str(hf_dir), "--tokenizer", str(plain), "--chat",
                     "--prompt", "hi"]) == 1
    assert "chat template" in _one_line_error(capsys.readouterr().err)


def test_the_docs_generate_from_a_fine_tuned_model_with_chat():
    fine_tuning = (ROOT / "docs" / "fine-tuning.md").read_text()
    (line,) = [ln for ln in fine_tuning.splitlines() if ln.startswith("transformer-jax generate")]
    assert "--chat" in line.split()


# c. tensor-parallel generation from a run's checkpoint, d. read-only runs -----------------------
# One process for both (a process start is some 3 s of CPU), with 2 CPU devices: first the
# tensor-parallel generation, then, where a directory can be made read-only, the commands that
# read a run on a read-only mount.

FRESH_SCRIPT = """
import contextlib, importlib, io, json, sys, traceback
RUN, LORA_RUN, READ_ONLY, RO_RUN, OUT, RO_OUT = json.loads(sys.argv[1])
cli = importlib.import_module("transformer_jax.cli.generate")
common = ["--prompt-ids", "3,1,4", "--prompt-ids", "1,5", "--max-new-tokens", "4",
          "--no-stop", "--json"]
assert cli.main(["--checkpoint", RUN, "--tensor", "2", *common]) == 0
assert cli.main(["--checkpoint", LORA_RUN, "--tensor", "0", *common]) == 0
print("---")  # then the read-only calls' results (one line)
if not READ_ONLY:
    sys.exit(0)
from transformer_jax.cli import export as hf_export
from transformer_jax.cli import plot as plot_cli
from transformer_jax.train import run as training
from transformer_jax.train.config import build_configs

def init_from():
    model, train, data = build_configs("tiny", [
        f"train.init_from={RO_RUN}", f"data.path={OUT}/corpus.txt",
        f"data.cache_dir={OUT}/cache", f"train.run_dir={OUT}/ft", "train.steps=1",
        "train.batch_size=2", "train.seq_len=16", "train.warmup_steps=0",
        "train.eval_batches=1", "train.sample_tokens=0", "train.mesh=-1,1,1",  # 2 devices
        "train.peak_flops=1e9"])  # MFU's peak given: no matmul measured
    return training.run(model, train, data, progress=False).final_step

calls = {
    # (the tensor-parallel calls' program: compiled above)
    "generate": lambda: cli.main(["--checkpoint", RO_RUN, "--tensor", "2", *common]),
    "export": lambda: hf_export.main(["--checkpoint", RO_RUN, "--out", OUT + "/hf"]),
    "export_to_read_only": lambda: hf_export.main(["--checkpoint", RO_RUN,
                                                   "--out", RO_OUT + "/hf"]),
    "plot": lambda: plot_cli.main([RO_RUN]),
    "plot_out": lambda: plot_cli.main([RO_RUN, "--out", OUT + "/loss.png"]),
    "init_from": init_from,
}
results = {}
for name, call in calls.items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            value = call()
        except BaseException:
            value = "raised " + traceback.format_exc().strip().splitlines()[-1]
    results[name] = [value, err.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory, run, lora_run, params, tokenizer):
    """The process's result; and the read-only run, its state before, the output directory,
    whether it ran on a read-only mount."""
    root = tmp_path_factory.mktemp("fresh")
    ro_run = save_run(root / "run", params, tokenizer)
    (root / "ro_out").mkdir()
    out = root / "out"
    out.mkdir()
    (out / "corpus.txt").write_text(f"{TEXT}.\n" * 200)
    before = _tree_state(ro_run)
    read_only_mount = read_only.mode() is not None
    argv = [sys.executable, "-c", FRESH_SCRIPT, json.dumps(
        [str(run), str(lora_run[0]), read_only_mount, str(ro_run), str(out),
         str(root / "ro_out")])]
    env = dict(ENV, JAX_NUM_CPU_DEVICES="2")  # --tensor 0 takes them all
    if read_only_mount:
        done = read_only.run([ro_run, root / "ro_out"], argv, env=env, cwd=ROOT, timeout=480)
    else:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300,
                              cwd=ROOT)
    return done, (ro_run, before, out, read_only_mount)


def test_generate_tensor_parallel_from_training_run_checkpoints(fresh_process, lora_run, params):
    """--tensor 2 on a run and --tensor 0 (every device: 2 here) on a LoRA run, one process."""
    done, _ = fresh_process
    assert "---" in done.stdout.splitlines(), done.stderr[-3000:]
    tensor_part = done.stdout.split("---")[0]
    outs = [json.loads(line) for line in tensor_part.splitlines() if line.startswith("{")]
    assert [o["tensor"] for o in outs] == [2, 2]
    for out, weights in zip(outs, (params, lora_run[1]), strict=True):
        want = generation.generate(CONFIG, weights, [[3, 1, 4], [1, 5]], max_new_tokens=4)
        assert out["tokens"] == want.tokens


def test_generate_export_init_from_and_plot_read_a_read_only_run(fresh_process):
    done, (run, before, out, read_only_mount) = fresh_process
    if not read_only_mount:
        pytest.skip("no way to make a directory read-only for root here (no namespaces)")
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {k: v for k, v in results.items()
              if v[0] != {"export_to_read_only": 1, "plot": 2, "init_from": 1}.get(k, 0)}
    assert not failed, failed
    assert "could not write the export" in _one_line_error(results["export_to_read_only"][1])
    assert "--out" in _one_line_error(results["plot"][1])
    assert hf.load(out / "hf")[0].d_model == CONFIG.d_model
    assert (out / "loss.png").stat().st_size > 0 and (out / "ft" / "checkpoints").is_dir()
    assert _tree_state(run) == before


# e. file modes -----------------------------------------------------------------------------------

@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_written_files_get_the_umask_mode(tmp_path, umask, params, tokenizer):
    file_mode, dir_mode = 0o666 & ~umask, 0o777 & ~umask

    def mode(path: Path) -> int:
        return path.stat().st_mode & 0o777

    with files.atomic_writer(tmp_path / "a.bin") as f:
        f.write(b"x")
    with files.replacing_directory(tmp_path / "d") as new:
        (new / "f").write_text("x")
    assert (mode(tmp_path / "a.bin"), mode(tmp_path / "d")) == (file_mode, dir_mode)

    hf.save(CONFIG, params, tmp_path / "export", tokenizer=tokenizer)
    hf.save(CONFIG, params, tmp_path / "sharded", max_shard_bytes=20_000)
    assert mode(tmp_path / "export") == mode(tmp_path / "sharded") == dir_mode
    written = [tmp_path / "export" / n for n in ("model.safetensors", "config.json",
                                                 "tokenizer.model", "generation_config.json")]
    written += list((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(written) > 5
    run = save_run(tmp_path / "run", params, tokenizer)
    written += [plot_lib.plot_run(run), run / "checkpoints" / "2" / CHECKSUMS_FILE]
    assert {str(p): mode(p) for p in written} == {str(p): file_mode for p in written}


# f. --seed ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", ["18446744073709551617", str(2**63), str(-(2**63) - 1)])
def test_generate_seed_out_of_range_is_one_line(hf_dir, seed, capsys):
    assert cli.main(["--checkpoint", str(hf_dir), "--prompt-ids", "1", "--temperature", "1",
                     "--seed", seed]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "--seed" in line and seed in line


# g. the fine-tuning preset's seq_len -------------------------------------------------------------

def test_finetune_preset_seq_len_gives_way_to_a_short_context(tmp_path, params, tokenizer,
                                                             caplog):
    short = save_run(tmp_path / "short", params, tokenizer, config=CONFIG.replace(max_seq_len=256))
    init = [f"train.init_from={short}", f"data.path={tmp_path / 'chat.jsonl'}"]
    with caplog.at_level(logging.INFO, logger="transformer_jax.train.config"):
        model, train, _ = build_configs("finetune", init)
    assert (model.max_seq_len, train.seq_len) == (256, 256)
    assert "seq_len=1024" in caplog.text and "max_seq_len=256" in caplog.text
    assert build_configs("finetune", [*init, "train.seq_len=128"])[1].seq_len == 128
    with pytest.raises(ConfigError, match="train.seq_len=1024 is above the model's "
                                          "max_seq_len=256"):
        build_configs("finetune", [*init, "train.seq_len=1024"])
    assert build_configs("finetune", [*init, "model.max_seq_len=64"])[1].seq_len == 64
