"""Object storage's copies, on fsspec's in-memory filesystem: a file rewritten with other
bytes of the same length (a retrained weight file) is fetched and pushed again, whatever its
size and modification time say; a cache keyed by the object's version keeps what did not
change and never marks a file fresh that a killed copy left behind.

``memory://`` lists no version or hash, as a few stores do not; the filesystem ``versioned``
gives also lists a GCS-like ``generation`` (new on every write) and ``md5Hash``, as gcsfs does
(``tests/test_object_storage.py`` runs the same against a GCS emulator).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import os

import fsspec
import pytest

from transformer_jax import storage


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRANSFORMER_JAX_CACHE", str(tmp_path / "cache"))
    fs = fsspec.filesystem("memory")
    yield fs
    for name in list(fs.store):
        if name.startswith("/t/"):
            del fs.store[name]


_GENERATIONS = itertools.count(1)


def _with_versions(fs, entry: dict) -> dict:
    """``entry`` as gcsfs would list it: a generation per written object and its MD5."""
    if entry.get("type") != "file":
        return entry
    obj = fs.store[fs._strip_protocol(entry["name"])]
    if not hasattr(obj, "test_generation"):  # a rewrite stores a new object
        obj.test_generation = str(next(_GENERATIONS))
    md5 = base64.b64encode(hashlib.md5(obj.getvalue()).digest()).decode()
    return {**entry, "generation": obj.test_generation, "md5Hash": md5}


@pytest.fixture
def versioned(cache, monkeypatch):
    """The memory filesystem, its listings carrying a generation and an MD5 (as GCS's)."""
    fs = cache
    ls, info, find = fs.ls, fs.info, fs.find
    monkeypatch.setattr(fs, "ls", lambda path, detail=True, **kw: (
        [_with_versions(fs, e) for e in ls(path, detail=True, **kw)] if detail
        else ls(path, detail=False, **kw)))
    monkeypatch.setattr(fs, "info", lambda path, **kw: _with_versions(fs, info(path, **kw)))

    def find_with_versions(path, *args, detail=False, **kw):
        found = find(path, *args, detail=detail, **kw)
        return {k: _with_versions(fs, v) for k, v in found.items()} if detail else found

    monkeypatch.setattr(fs, "find", find_with_versions)
    return fs


def _count_fetches(fs, monkeypatch) -> list[str]:
    fetched: list[str] = []
    get_file = fs.get_file

    def counting(remote, local, *args, **kw):
        fetched.append(remote.rsplit("/", 1)[-1])
        return get_file(remote, local, *args, **kw)

    monkeypatch.setattr(fs, "get_file", counting)
    return fetched


def test_local_copy_fetches_a_file_rewritten_with_other_bytes_of_the_same_length(cache):
    fs = cache
    fs.pipe({"/t/hf/model.safetensors": b"run A weights", "/t/hf/sub/tok.json": b"{1}"})
    copy = storage.local_copy("memory://t/hf")
    assert (copy / "model.safetensors").read_bytes() == b"run A weights"
    fs.pipe({"/t/hf/model.safetensors": b"run B weights", "/t/hf/sub/tok.json": b"{2}"})
    assert storage.local_copy("memory://t/hf") == copy
    assert (copy / "model.safetensors").read_bytes() == b"run B weights"
    assert (copy / "sub" / "tok.json").read_bytes() == b"{2}"
    # One file (a tokenizer.json given as a URL) as well.
    assert storage.local_copy("memory://t/hf/sub/tok.json").read_bytes() == b"{2}"
    fs.pipe("/t/hf/sub/tok.json", b"{3}")
    assert storage.local_copy("memory://t/hf/sub/tok.json").read_bytes() == b"{3}"


def test_push_sends_a_file_rewritten_with_other_bytes_of_the_same_length(cache, tmp_path):
    fs = cache
    local = tmp_path / "export"
    (local / "sub").mkdir(parents=True)
    weights = local / "model.safetensors"
    weights.write_bytes(b"run A weights")
    (local / "sub" / "tok.json").write_bytes(b"{1}")
    assert storage.push(local, "memory://t/out") == 2
    assert fs.cat("/t/out/model.safetensors") == b"run A weights"
    # Rewritten in the same clock tick (or by a copy that keeps times): same size and mtime.
    before = weights.stat()
    weights.write_bytes(b"run B weights")
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    storage.push(local, "memory://t/out")
    assert fs.cat("/t/out/model.safetensors") == b"run B weights"
    # Another writer replaced the object with bytes of the same length: pushed again.
    fs.pipe("/t/out/sub/tok.json", b"{9}")
    storage.push(local, "memory://t/out")
    assert fs.cat("/t/out/sub/tok.json") == b"{1}"


def test_a_versioned_cache_keeps_unchanged_files_and_fetches_rewritten_ones(versioned,
                                                                           monkeypatch):
    from transformer_jax.storage import versions

    fs = versioned
    fs.pipe({"/t/d/a.bin": b"aaaa", "/t/d/b.bin": b"bbbb"})
    fetched = _count_fetches(fs, monkeypatch)
    copy = storage.local_copy("memory://t/d")
    assert sorted(fetched) == ["a.bin", "b.bin"]
    fetched.clear()
    storage.local_copy("memory://t/d")
    assert fetched == []  # the same generations: nothing fetched again
    fs.pipe("/t/d/b.bin", b"BBBB")
    storage.local_copy("memory://t/d")
    assert fetched == ["b.bin"] and (copy / "b.bin").read_bytes() == b"BBBB"
    # A cached file changed locally is not the one fetched: fetched again.
    fetched.clear()
    (copy / "a.bin").write_bytes(b"xxxx")
    storage.local_copy("memory://t/d")
    assert fetched == ["a.bin"] and (copy / "a.bin").read_bytes() == b"aaaa"
    # A removed object leaves the copy, and its record.
    fs.rm("/t/d/a.bin")
    storage.local_copy("memory://t/d")
    assert not (copy / "a.bin").exists()
    assert set(versions.read_records(copy)) == {"b.bin"}
    # The record lives beside the copy, never in it (the copy is uploaded as the directory).
    assert versions.records_file(copy).parent == copy.parent


@pytest.mark.parametrize("killed", ["during the download", "before the record is written"])
def test_a_killed_copy_never_leaves_a_file_marked_fresh(versioned, monkeypatch, killed):
    from transformer_jax.storage import versions

    fs = versioned
    fs.pipe("/t/k/w.bin", b"old!")
    copy = storage.local_copy("memory://t/k")
    fs.pipe("/t/k/w.bin", b"new!")

    def kill(*args, **kwargs):
        raise KeyboardInterrupt  # what a kill leaves: the step after this never runs

    with monkeypatch.context() as m:
        if killed == "during the download":
            m.setattr(fs, "get_file", kill)
        else:
            m.setattr(versions, "write_records", kill)
        with pytest.raises(KeyboardInterrupt):
            storage.local_copy("memory://t/k")
    assert not [p for p in copy.iterdir() if p.name.endswith(".part")]
    fetched = _count_fetches(fs, monkeypatch)
    assert (storage.local_copy("memory://t/k") / "w.bin").read_bytes() == b"new!"
    assert fetched == ["w.bin"]


def test_a_damaged_record_fetches_everything_again(versioned, monkeypatch):
    from transformer_jax.storage import versions

    fs = versioned
    fs.pipe("/t/r/w.bin", b"data")
    copy = storage.local_copy("memory://t/r")
    versions.records_file(copy).write_text("{not json")
    fetched = _count_fetches(fs, monkeypatch)
    storage.local_copy("memory://t/r")
    assert fetched == ["w.bin"]


def test_push_skips_only_files_whose_bytes_the_remote_hash_proves_equal(versioned, tmp_path):
    fs = versioned
    local = tmp_path / "build"
    local.mkdir()
    (local / "a.bin").write_bytes(b"aaaa")
    (local / "b.bin").write_bytes(b"bbbb")
    (local / "empty").write_bytes(b"")
    assert storage.push(local, "memory://t/p") == 3
    assert storage.push(local, "memory://t/p") == 0  # the remote MD5s are the files'
    before = (local / "b.bin").stat()
    (local / "b.bin").write_bytes(b"BBBB")
    os.utime(local / "b.bin", ns=(before.st_atime_ns, before.st_mtime_ns))
    assert storage.push(local, "memory://t/p") == 1
    assert fs.cat("/t/p/b.bin") == b"BBBB"


def test_local_content_hashes_are_the_ones_gcs_records(tmp_path):
    pytest.importorskip("google_crc32c")  # installed with gcsfs
    from transformer_jax.storage import versions

    file = tmp_path / "f"
    file.write_bytes(b"hello world")
    # GCS's documented values for "hello world" (base64 of the big-endian CRC32C, of the MD5).
    assert versions.crc32c(file) == "yZRlqg=="
    assert versions.md5(file) == "XrY7u+Ae7tCTyyK7j1rNww=="
    info = {"size": 11, "crc32c": "yZRlqg==", "md5Hash": "XrY7u+Ae7tCTyyK7j1rNww=="}
    assert versions.same_content(file, info)
    assert not versions.same_content(file, {**info, "crc32c": "AAAAAA==", "md5Hash": None})
    assert not versions.same_content(file, {"size": 11})  # nothing proves it equal
    assert versions.object_version({"size": 11, "created": 1.0}) is None
