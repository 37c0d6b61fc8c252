"""The decode benchmark runs end to end on a tiny model (a smoke test: its figures are not
checked, only that every measurement is made and reported consistently)."""

from __future__ import annotations

import json
import math

import multihost_worker as worker

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_cache import cache_bytes

MODEL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
             d_ff=48, max_seq_len=64)
# ``python -m transformer_jax.bench ARGS`` (its dispatch and the decode bench's main), with the
# bandwidth sample's operand at 8 MiB instead of 256 MiB: under the tests' cheap XLA:CPU code
# generation, filling 256 MiB with random numbers took half of the run's CPU time, and no figure
# is checked.
BENCH = ("import sys; from transformer_jax.bench import __main__ as cli, decode; "
         "sample = decode.measure_bandwidth; "
         "decode.measure_bandwidth = lambda nbytes=8 << 20, **kw: sample(nbytes, **kw); "
         "sys.exit(cli.main(sys.argv[1:]))")


def test_decode_benchmark_reports_every_measurement_for_each_tensor_size(tmp_path):
    toml = tmp_path / "micro.toml"
    toml.write_text("[model]\n" + "".join(f"{k} = {v}\n" for k, v in MODEL.items()))
    out = tmp_path / "bench.json"
    printed = worker.run_python(
        ["-c", BENCH, "decode", "--config", str(toml), "--batch", "2",
         "--prompt-len", "5", "--new-tokens", "6", "--cache-size", "32", "--tensor", "1,0",
         "--repeats", "1", "--no-hf", "--peak-gb-s", "10", "--out", str(out)],
        n_devices=2, timeout=300)
    records = json.loads(out.read_text())["records"]
    assert [r["tensor"] for r in records] == [1, 2]
    config = ModelConfig(**MODEL)
    for r in records:
        ours = r["ours"]
        assert ours["cache_bytes"] == cache_bytes(config, 2, 32)
        # A step is (generate N - generate 1) / (N - 1): at this size and one repeat its sign
        # is noise, so only that it was computed is checked.
        assert math.isfinite(ours["step_ms"]) and ours["step_ms"] != 0
        assert ours["bound_step_ms"] > 0 and ours["prefill_s"] > 0
        assert len(ours["step_ms_series"]) == 6 - 1  # one interval per decode step
        assert ours["achieved_gb_s"] == ours["step_bytes"] / ours["step_ms"] / 1e6
        assert r["bandwidth_use_vs_peak"] == ours["achieved_gb_s"] / r["tensor"] / 10
        assert math.isfinite(r["speedup_vs_no_cache"]) and "step_ms" in r["weights_only"]
    assert printed.count("step / bound") == 2 and "10 GB/s (given)" in printed
