"""The remat policies compiled by the TPU compiler for a v5p topology, on this CPU host
(``transformer-jax compile``, ``model.remat``): what each keeps for the backward pass, in the
chip's memory or the host's.

Needs libtpu (the ``tpu`` extra), as ``test_tpu_compile``. One scanned 2-layer toy, fsdp=4.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from transformer_jax.cli import compile as compile_cli  # noqa: E402

TOY = ["model.vocab_size=128", "model.d_model=128", "model.d_ff=256", "model.n_layers=2",
       "model.n_heads=2", "model.n_kv_heads=2", "model.head_dim=128", "model.scan_layers=true",
       "model.attention_impl=xla", "train.batch_size=8", "train.seq_len=128"]


@functools.cache
def _report(remat: str) -> dict:
    return compile_cli.compile_report("tiny", [*TOY, f"model.remat={remat}"], "v5p:2x2x1",
                                      hlo=True)


def test_a_named_policy_keeps_more_than_full_and_less_than_save_dots():
    temp = {r: _report(r)["memory"]["temp"] for r in ("full", "save_qkv_proj", "save_dots")}
    assert temp["full"] < temp["save_qkv_proj"] < temp["save_dots"], temp
    assert _report("save_qkv_proj")["memory"]["host_temp"] == 0


def test_an_offloading_policy_moves_its_activations_to_the_host():
    """The saved q, k, v go to host memory (the HLO's memory space S(5)); at least one
    layer's worth of them, [B/4, T, N H] each a chip, in bfloat16 or float32."""
    r = _report("offload_qkv_proj")
    assert r["fits"] and "S(5)" in r["hlo"]
    b, t, width = 8 // 4, 128, 2 * 128
    assert r["memory"]["host_temp"] >= 3 * b * t * width * 4
    assert "S(5)" not in _report("full")["hlo"]


def test_find_batch_searches_every_policy_and_reports_host_memory(monkeypatch, capsys):
    # compile_report stands in for the compiler (the compiles are tested above): a policy
    # fits twice as many sequences a chip as the one before it in REMATS, and the offloading
    # ones put 1 KiB a sequence on the host.
    from transformer_jax.model.config import REMATS

    def report(config, overrides, topology, slices):
        o = dict(x.split("=", 1) for x in overrides)
        batch, remat = int(o["train.batch_size"]), o["model.remat"]
        host = 1024 * batch if remat.startswith("offload") else 0
        return {"fits": batch <= 4 * 2 ** REMATS.index(remat), "hbm_bytes": 2**30,
                "memory": {"peak": batch, "host_temp": host}}

    monkeypatch.setattr(compile_cli, "compile_report", report)
    assert compile_cli.main(["--topology", "v5e:2x2", "--find-batch", *TOY]) == 0
    out = capsys.readouterr().out
    for i, remat in enumerate(REMATS):  # fsdp=4: 2 ** i sequences a chip
        line = next(x for x in out.splitlines() if f"remat={remat} " in x)
        assert f" {2 ** i} (train.batch_size={4 * 2 ** i}" in line
        assert ("on the host" in line) == remat.startswith("offload")
