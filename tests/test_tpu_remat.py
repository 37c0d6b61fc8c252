"""The remat policies compiled by the TPU compiler for a v5p topology, on this CPU host
(``transformer-jax compile``, ``model.remat``): what each keeps for the backward pass, in the
chip's memory or the host's; and the CLI's ``--json`` report on v5p (its "full" compile).

Needs libtpu (the ``tpu`` extra), as ``test_tpu_compile``. One scanned 2-layer toy, fsdp=4.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
from unittest import mock

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from transformer_jax.cli import compile as compile_cli  # noqa: E402

_COMPILE_REPORT = compile_cli.compile_report  # (a test below stands in for it)

# 32 positions: the TPU compiler's time grows with the shapes, and each policy's saved
# activations still tell it apart.
SEQ = 32
TOY = ["model.vocab_size=128", "model.d_model=128", "model.d_ff=256", "model.n_layers=2",
       "model.n_heads=2", "model.n_kv_heads=2", "model.head_dim=128", "model.scan_layers=true",
       "model.attention_impl=xla", "train.batch_size=8", f"train.seq_len={SEQ}"]


@functools.cache
def _cli(*argv: str) -> tuple[int, dict]:
    """``compile_cli.main`` with ``--json``: its exit status and printed report, whose
    ``compile_report`` also kept the compiled program's text (``hlo``) for the tests here."""
    out = io.StringIO()
    report = functools.partial(_COMPILE_REPORT, hlo=True)
    with mock.patch.object(compile_cli, "compile_report", report), \
            contextlib.redirect_stdout(out):
        code = compile_cli.main([*argv, "--json"])
    return code, json.loads(out.getvalue())


@functools.cache
def _report(remat: str) -> dict:
    if remat == "full":  # the CLI's compile (test_cli_json_on_v5p)
        return _cli("--topology", "v5p:2x2x1", *TOY, "model.remat=full")[1]
    return _COMPILE_REPORT("tiny", [*TOY, f"model.remat={remat}"], "v5p:2x2x1", hlo=True)


def test_cli_json_on_v5p():
    code, r = _cli("--topology", "v5p:2x2x1", *TOY, "model.remat=full")
    assert code == 0 and r["device_kind"] == "TPU v5" and r["hbm_bytes"] == 95 * 2**30
    assert r["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1} and r["fits"]
    assert r["memory"]["peak"] <= r["hbm_bytes"] and r["compile_s"] > 0
    assert r["remat"] == "full" and r["overrides"][-1] == "model.remat=full"
    assert {key.split(" over ")[1] for key in r["collectives"]["by_axis"]} == {"fsdp"}


def test_a_named_policy_keeps_more_than_full_and_less_than_save_dots():
    temp = {r: _report(r)["memory"]["temp"] for r in ("full", "save_qkv_proj", "save_dots")}
    assert temp["full"] < temp["save_qkv_proj"] < temp["save_dots"], temp
    assert _report("save_qkv_proj")["memory"]["host_temp"] == 0


def test_an_offloading_policy_moves_its_activations_to_the_host():
    """The saved q, k, v go to host memory (the HLO's memory space S(5)); at least one
    layer's worth of them, [B/4, T, N H] each a chip, in bfloat16 or float32."""
    r = _report("offload_qkv_proj")
    assert r["fits"] and "S(5)" in r["hlo"]
    b, t, width = 8 // 4, SEQ, 2 * 128
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
