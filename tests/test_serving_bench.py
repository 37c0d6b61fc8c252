"""bench serve: its latency figures on hand-made token times, its workloads, and one run of
every mode on a one-layer model."""

import json
import math

import jax
import pytest

from transformer_jax.bench import serve


def test_summary_figures_by_hand():
    # Request 0 arrives at 1 s, gets tokens at 2, 3, 5 s; request 1 arrives at 0, one token at 4.
    records = [{"arrival": 1.0, "times": [12.0, 13.0, 15.0]},
               {"arrival": 0.0, "times": [14.0]}]
    r = serve.summarize(records, start=10.0)
    assert r["ttft_s"]["mean"] == pytest.approx((1 + 4) / 2)
    assert r["tpot_s"]["median"] == pytest.approx(1.5)  # (15 - 12) / 2, request 0 only
    assert r["itl_s"]["mean"] == pytest.approx(1.5) and r["itl_s"]["p99"] == pytest.approx(2.0)
    assert r["e2e_s"]["p99"] == pytest.approx(4.0)
    assert r["duration_s"] == pytest.approx(5.0)
    assert r["output_token_throughput"] == pytest.approx(4 / 5)
    assert r["request_throughput"] == pytest.approx(2 / 5)


def test_workload_lengths_prefix_and_arrivals():
    w = serve.make_workload(200, (20, 40), (3, 9), 4, rate=10.0, burstiness=1.0, vocab=50,
                            seed=0, shared_prefix=16)
    assert all(20 <= len(p) <= 40 and p[:16] == w.prompts[0][:16] for p in w.prompts)
    assert set(w.max_tokens) <= {4, 8, 12}
    assert w.arrivals == sorted(w.arrivals)
    assert 200 / 10 * 0.7 < w.arrivals[-1] < 200 / 10 * 1.3  # mean gap 1 / rate
    at_once = serve.make_workload(3, (2, 4), (1, 2), 1, math.inf, 1.0, 50, 0)
    assert at_once.arrivals == [0.0, 0.0, 0.0]


def test_every_mode_serves_every_token(tmp_path):
    config = tmp_path / "one_layer.toml"
    config.write_text("[model]\nvocab_size = 64\nd_model = 32\nn_layers = 1\nn_heads = 2\n"
                      "d_ff = 32\nmax_seq_len = 32\n")
    out = tmp_path / "serve.json"
    modes = ("engine", "engine-noprefix", "one", "batch")
    assert serve.main(["--config", str(config), "--requests", "3", "--input-len", "3,10",
                       "--output-len", "2,4", "--output-multiple", "4", "--slots", "2",
                       "--page-size", "8", "--token-budget", "18", "--modes", ",".join(modes),
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for mode in modes:
        assert result["modes"][mode]["output_tokens"] == 3 * 4, mode
    assert result["modes"]["engine"]["peak_running"] == 2
    times = result["modes"]["engine"]["step_times"]  # every step timed, phase by phase
    assert times["steps"] == result["modes"]["engine"]["steps"]
    assert 0 < times["host_share"] < 1
    assert sum(p["mean"] for p in times["phases"].values()) == pytest.approx(
        times["host"]["mean"] + times["device"]["mean"])


def test_the_structured_modes_serve_every_token_and_write_their_results(tmp_path):
    config = tmp_path / "one_layer.toml"  # a vocabulary the byte-level tokenizer fits in
    config.write_text("[model]\nvocab_size = 260\nd_model = 16\nn_layers = 1\nn_heads = 2\n"
                      "d_ff = 16\nmax_seq_len = 16\n")
    out = tmp_path / "serve.json"
    assert serve.main(["--config", str(config), "--requests", "2", "--input-len", "3,6",
                       "--output-len", "4,4", "--output-multiple", "4", "--slots", "2",
                       "--page-size", "8", "--token-budget", "10",
                       "--modes", "engine,engine-json-mixed",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for mode in ("engine", "engine-json-mixed"):
        assert result["modes"][mode]["output_tokens"] == 2 * 4, mode
    assert result["modes"]["engine-json-mixed"]["unconstrained_tpot_median_s"] > 0


def test_choices_times_n_choices_with_and_without_forks(tmp_path):
    from transformer_jax.bench import choices

    config = tmp_path / "one_layer.toml"
    config.write_text("[model]\nvocab_size = 64\nd_model = 32\nn_layers = 1\nn_heads = 2\n"
                      "d_ff = 32\nmax_seq_len = 32\n")
    out = tmp_path / "choices.json"
    assert choices.main(["--config", str(config), "--prompt-lens", "12,20", "--n", "3",
                         "--rounds", "2", "--slots", "4", "--page-size", "8",
                         "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["forked"] == 2 * 3 * 2  # (n - 1) forks in each of the 3 runs with forks
    for length in ("12", "20"):
        r = result["lengths"][length]
        assert r["forks_ratio"] > 0 and r["no_forks_ratio"] > 0


def test_stall_scenario_measures_the_prefill_window(tmp_path):
    from transformer_jax.bench import serve_stall
    from transformer_jax.decode import loop as decode
    from transformer_jax.model.config import ModelConfig
    from transformer_jax.model.transformer import init_params

    path = tmp_path / "one_layer.toml"
    path.write_text("[model]\nvocab_size = 64\nd_model = 32\nn_layers = 1\nn_heads = 2\n"
                    "d_ff = 32\nmax_seq_len = 64\n")
    config = ModelConfig.preset(str(path))
    weights = decode.prepare(config, init_params(config, jax.random.key(0)))
    # 3 slots (2 decoding + the long prompt's), so 16 prompt tokens a step: 40 go in 3 steps.
    r = serve_stall.run_stall(config, weights, slots=2, token_budget=19, page_size=8,
                              long_prompt=40, prompt_len=8, warmup=4)
    assert r["prefill_steps"] == 3
    # (Timings only as orders: a decode-only step may take longer than a prefill window's gap
    # on a loaded machine.)
    assert r["median_step_s"] > 0 and 0 < r["itl_p99_s"] <= r["itl_max_s"]
    assert r["long_ttft_s"] >= r["itl_max_s"] * 0.5


def test_the_engine_mode_fails_on_an_engine_that_makes_no_progress():
    # A leaked page that never frees leaves requests waiting for ever: the benchmark's loop
    # raises instead of spinning.
    from transformer_jax.bench.serve_workload import Workload

    class Stuck:
        steps, idle, pages_in_use, adapter_names = 0, False, 0, ()

        class scheduler:
            idle, running, prefilling, preemptions = False, [], [], 0
            describe = staticmethod(lambda: "1 waiting, 0 free pages")

        def add_request(self, *args):
            return 0

        def step(self):
            return []

    work = Workload(prompts=[[1, 2]], max_tokens=[2], arrivals=[0.0])
    with pytest.raises(RuntimeError, match="cannot make progress: 1 waiting"):
        serve.run_engine(Stuck(), work)
