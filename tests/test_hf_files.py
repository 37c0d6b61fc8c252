"""HF export/import file handling: atomic replacement of an export, corrupt files named.

Builds tiny Llama tensors with numpy from ``hf``'s own name/shape table (no torch needed).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")

from transformer_jax import hf  # noqa: E402  (needs the optional extra checked above)
from transformer_jax.model.config import ModelConfig  # noqa: E402
from transformer_jax.storage.files import read_json, replacing_directory  # noqa: E402

CONFIG = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32,
                     max_seq_len=64, norm="rms", norm_position="pre", ffn="swiglu",
                     position="rope", rope_pairing="half")


def tiny_params(seed: int) -> dict:
    """Random params of CONFIG in our layout (unrolled blocks)."""
    rng = np.random.default_rng(seed)
    params: dict = {}
    for spec in hf._tensors(CONFIG):
        node = params
        for key in spec.path[:-1]:
            node = node.setdefault(key, {})
        node[spec.path[-1]] = rng.standard_normal(spec.shape).astype(np.float32)
    return params


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(f.relative_to(directory)): f.read_bytes()
            for f in sorted(directory.rglob("*")) if f.is_file()}


def leftovers(parent: Path, name: str) -> list[str]:
    """Temporary directories of a save of ``parent/name`` still lying around."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def test_save_over_an_existing_export_replaces_it_and_keeps_other_files(tmp_path):
    out = tmp_path / "export"
    hf.save(CONFIG, tiny_params(0), out)
    (out / "tokenizer.model").write_bytes(b"spm")
    hf.save(CONFIG, tiny_params(1), out, max_shard_bytes=4096)  # now sharded
    names = sorted(p.name for p in out.iterdir())
    assert hf.SINGLE_FILE not in names and hf.INDEX_FILE in names, names
    assert "tokenizer.model" in names and (out / "tokenizer.model").read_bytes() == b"spm"
    config, params = hf.load(out)
    np.testing.assert_array_equal(params["embed"]["embedding"],
                                  tiny_params(1)["embed"]["embedding"])
    assert config.d_model == CONFIG.d_model
    assert leftovers(tmp_path, "export") == []

    # A save with a tokenizer replaces the old tokenizer files as a set (the .model goes).
    class JsonTokenizer:
        bos_id, eos_id, pad_id = 1, 2, -1

        def save(self, path):
            (Path(path) / "tokenizer.json").write_text("{}")

    hf.save(CONFIG, tiny_params(1), out, tokenizer=JsonTokenizer())
    assert (out / "tokenizer.json").exists() and not (out / "tokenizer.model").exists()
    written = read_json(out / hf.CONFIG_FILE)  # its ids, but not the pad it lacks (-1)
    assert (written["eos_token_id"], written["pad_token_id"]) == (2, None)


def test_a_failed_save_leaves_the_previous_export_untouched(tmp_path):
    out = tmp_path / "export"
    hf.save(CONFIG, tiny_params(0), out, max_shard_bytes=4096)
    before = snapshot(out)
    real_save = safetensors_numpy.save_file
    calls = []

    def fail_on_second_shard(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            Path(filename).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        real_save(tensors, filename, metadata=metadata)

    with mock.patch.object(safetensors_numpy, "save_file", fail_on_second_shard), \
            pytest.raises(OSError, match="No space left"):
        hf.save(CONFIG, tiny_params(1), out, max_shard_bytes=4096)
    assert len(calls) == 2
    assert snapshot(out) == before
    assert leftovers(tmp_path, "export") == []
    _, params = hf.load(out)
    np.testing.assert_array_equal(params["embed"]["embedding"],
                                  tiny_params(0)["embed"]["embedding"])


def test_a_failed_first_save_leaves_nothing(tmp_path):
    with mock.patch.object(safetensors_numpy, "save_file", side_effect=OSError("disk gone")), \
            pytest.raises(OSError, match="disk gone"):
        hf.save(CONFIG, tiny_params(0), tmp_path / "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _cut(file: Path, keep: int) -> None:
    file.write_bytes(file.read_bytes()[:keep])


@pytest.mark.parametrize("damage", ["truncated", "truncated header", "garbage", "empty"])
def test_a_corrupt_safetensors_file_is_named(tmp_path, damage):
    hf.save(CONFIG, tiny_params(0), tmp_path)
    file = tmp_path / hf.SINGLE_FILE
    size = file.stat().st_size
    if damage == "truncated":
        _cut(file, size - 100)
    elif damage == "truncated header":
        _cut(file, 20)
    elif damage == "garbage":
        file.write_bytes(np.random.default_rng(0).bytes(size))
    else:
        file.write_bytes(b"")
    with pytest.raises(ValueError, match=f"{file}.* truncated or corrupt") as info:
        hf.load(tmp_path)
    assert "\n" not in str(info.value)


def test_one_corrupt_shard_of_many_is_named(tmp_path):
    hf.save(CONFIG, tiny_params(0), tmp_path, max_shard_bytes=4096)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    _cut(shards[1], shards[1].stat().st_size // 2)
    with pytest.raises(ValueError, match=f"{shards[1]}.* truncated or corrupt"):
        hf.load(tmp_path)


def test_a_config_or_index_that_is_not_json_is_named_with_the_line(tmp_path):
    hf.save(CONFIG, tiny_params(0), tmp_path, max_shard_bytes=4096)
    index = tmp_path / hf.INDEX_FILE
    index.write_text(index.read_text()[:-40])  # cut short
    with pytest.raises(ValueError, match=rf"{index} is not valid JSON: .* \(line \d+, column"):
        hf.load(tmp_path)
    config = tmp_path / hf.CONFIG_FILE
    config.write_text('{\n  "model_type": "llama",\n  "hidden_size": 16,,\n}\n')
    with pytest.raises(ValueError, match=rf"config {config} is not valid JSON: .*\(line 3, "):
        hf.load(tmp_path)
    config.write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ValueError, match=f"{config} is not valid JSON"):
        hf.load(tmp_path)
    config.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        hf.load(tmp_path)


def test_read_json_and_replacing_directory(tmp_path):
    (tmp_path / "a.json").write_text('{"x": 1}')
    assert read_json(tmp_path / "a.json") == {"x": 1}
    with pytest.raises(FileNotFoundError, match="settings .*b.json does not exist"):
        read_json(tmp_path / "b.json", "settings")
    target = tmp_path / "dir"
    with replacing_directory(target) as new:
        (new / "f").write_text("1")
    with pytest.raises(RuntimeError), replacing_directory(target) as new:
        (new / "f").write_text("2")
        raise RuntimeError("stop")
    assert (target / "f").read_text() == "1"
    (target / "sub").mkdir()
    (target / "sub" / "g").write_text("kept")
    with replacing_directory(target, carry_over=lambda name: name != "f") as new:
        (new / "h").write_text("3")
    assert sorted(p.name for p in target.iterdir()) == ["h", "sub"]
    assert (target / "sub" / "g").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "dir"]
    json.dumps(read_json(tmp_path / "a.json"))
