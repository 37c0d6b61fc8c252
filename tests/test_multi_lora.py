"""Many LoRA adapters served together over one base: each row of a batch adds its own adapter's
update (``model.multi_lora``), so a mixed batch gives every request what that adapter merged
alone gives (greedy tokens identical, float32 logits within 1e-4), compiles nothing new, never
shares prefix pages across adapters, and ``serve --lora NAME=RUN_DIR`` serves trained runs by
model name; adapters that do not fit the base are refused naming what differs."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from helpers import TINY, Served, random_params, run_until_idle, write_chatml_tokenizer

from transformer_jax import hf
from transformer_jax.checkpoint.adapters import load_adapter
from transformer_jax.checkpoint.loading import load
from transformer_jax.checkpoint.manager import CheckpointManager
from transformer_jax.decode import prepare
from transformer_jax.decode.loop import decode_model
from transformer_jax.model import lora, multi_lora
from transformer_jax.model.transformer import Transformer, stack_blocks
from transformer_jax.serving import Engine, SamplingParams
from transformer_jax.serving import step as step_lib
from transformer_jax.tokenizer.prompt import encode_text

pytestmark = pytest.mark.usefixtures("fast_engine_compiles", "shared_compilation_cache")

CONFIG = TINY.replace(max_seq_len=64)
WORDS = "the cat dog sat ran on a mat log red blue big small yes no one two three".split()
NAME = "tiny-base"
# name -> (rank, alpha, targets) of the adapters written beside the trained one.
WRITTEN = {"rank2": (2, 4.0, ("o", "gate", "up")), "rank8": (8, 32.0, lora.DEFAULT_TARGETS),
           "qk": (4, 8.0, ("q", "k"))}


def _base():
    """The base's params, drawn with numpy (``init_params`` op by op compiles each of its ops
    apart)."""
    return jax.device_put(random_params(CONFIG))


def _adapters(params, seed: int, rank: int, alpha: float, targets) -> tuple[dict, lora.LoraConfig]:
    """Adapters with B far from zero (an initialised adapter would change nothing): the layout
    ``init_adapters`` gives (its shapes, traced, not run), the factors drawn with numpy (A at
    std 0.25, about an initialised A's plus noise; B at 0.2); jax.random.normal op by op would
    compile a program per shape."""
    cfg = lora.LoraConfig(rank=rank, alpha=alpha, targets=targets)
    shapes = jax.eval_shape(lambda p: lora.init_adapters(CONFIG, cfg, p, jax.random.key(seed)),
                            params)
    rng = np.random.default_rng(seed + 100)
    return jax.tree_util.tree_map_with_path(lambda path, x: jnp.asarray(
        (0.25 if str(path[-1].key) == "a" else 0.2) * rng.standard_normal(x.shape, np.float32)),
        shapes), cfg


# The math: one forward, each row its own adapter -------------------------------------------------

@pytest.mark.parametrize("scanned,out_first", [(False, False), (True, True)])
def test_each_row_gets_its_adapters_merged_logits(scanned, out_first):
    base = _base()
    ads = [_adapters(base, i, *spec) for i, spec in enumerate(WRITTEN.values(), start=1)]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 10)), jnp.int32)
    ids = np.asarray([3, 0, 1, 2])
    forward = jax.jit(lambda p: Transformer(CONFIG).apply({"params": p}, tokens).logits)
    merge = jax.jit(lora.merge, static_argnums=2)
    want = [np.asarray(forward(base if i == 0 else merge(base, *ads[i - 1])))[r]
            for r, i in enumerate(ids)]
    config = CONFIG.replace(scan_layers=scanned)
    weights = prepare(config, stack_blocks(base, CONFIG) if scanned else base,
                      platform="cpu" if out_first else "gpu")  # matrices OutFirst for a CPU
    assert weights.out_first == out_first
    stack = multi_lora.stack_adapters(weights.params, ads)
    got = jax.jit(lambda p, s, i: decode_model(config).apply(  # one program
        {"params": multi_lora.with_row_adapters(p, s, i)}, tokens).logits)(
        weights.params, stack, jnp.asarray(ids))
    for r in range(len(ids)):
        np.testing.assert_allclose(got[r], want[r], atol=1e-4, rtol=0)
    # Each adapter changes its rows: the check above would catch a row given the base.
    assert all(np.abs(want[r] - want[1]).max() > 1e-2 for r in (0, 2, 3))


def test_adapters_that_cannot_be_batched_are_refused():
    base = _base()
    tree, cfg = _adapters(base, 1, 4, 8.0, ("q",))
    with pytest.raises(ValueError, match="'wide'.*q_proj has A"):
        multi_lora.stack_adapters(base, [(jax.tree.map(lambda x: jnp.concatenate([x, x], -1)
                                                       if x.shape[-1] == 4 else x, tree),
                                          lora.LoraConfig(rank=8, targets=("q",)))],
                                  names=["wide"])
    with pytest.raises(ValueError, match="'moe'.*dense matrices only"):
        multi_lora.stack_adapters(base, [(tree, lora.LoraConfig(targets=("experts.gate",)))],
                                  names=["moe"])
    engine = Engine(CONFIG, base, 2, 16, 8, 12, adapters={"a": (tree, cfg)})
    with pytest.raises(ValueError, match="adapter 'b' is not loaded; the engine has \\['a'\\]"):
        engine.add_request([1, 2], SamplingParams(adapter="b"))
    with pytest.raises(ValueError, match="adapter must be"):
        engine.add_request([1, 2], SamplingParams(adapter=""))
    assert engine.idle


# Runs on disk: one trained with the finetune preset, three written beside it --------------------

@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("base") / NAME
    hf.save(CONFIG, jax.tree.map(np.asarray, _base()), path)
    write_chatml_tokenizer(path, WORDS)
    return path


def _rewrite(run: Path, out: Path, fn) -> Path:
    """A copy of run ``run`` whose newest checkpoint's state and meta went through ``fn``."""
    shutil.copytree(run, out)
    shutil.rmtree(out / "checkpoints")
    with CheckpointManager(run / "checkpoints", async_save=False) as manager:
        step = manager.latest_step()
        state, meta = manager.restore(None, step)
    state, meta = fn(state, meta)
    with CheckpointManager(out / "checkpoints", async_save=False) as manager:
        manager.save(step, state, meta)
    return out


@pytest.fixture(scope="module")
def runs(base_dir, tmp_path_factory) -> dict[str, Path]:
    from transformer_jax.train import plot
    from transformer_jax.train.config import build_configs
    from transformer_jax.train.run import run

    root = tmp_path_factory.mktemp("runs")
    data = root / "data.jsonl"
    data.write_text("\n".join(json.dumps(
        {"prompt": f"the {a} sat on the {c} mat", "completion": f" {c} {c} yes"})
        for a in ("cat", "dog") for c in ("red", "blue", "big", "small")) + "\n")
    model, train, data_cfg = build_configs("finetune", [
        f"train.init_from={base_dir}", f"data.path={data}", f"train.run_dir={root / 'trained'}",
        "train.steps=3", "train.decay_steps=3", "train.warmup_steps=1", "train.lr=3e-2",
        "train.lora_rank=4", "train.lora_targets=q,v,down", "train.batch_size=2",
        "train.grad_accum=1", "train.seq_len=16", "train.mesh=1,1,1", "train.log_every=1",
        "train.ckpt_every=3"])
    with pytest.MonkeyPatch.context() as patch:  # no loss plot drawn (test_plot's subject)
        patch.setattr(plot, "plot_run", lambda run_dir: None)
        run(model, train, data_cfg, progress=False)
    out = {"trained": root / "trained"}
    for seed, (name, spec) in enumerate(WRITTEN.items(), start=1):
        def swap(state, meta, spec=spec, seed=seed):
            tree, cfg = _adapters(state["params"][lora.BASE], seed, *spec)
            state["params"][lora.ADAPTERS] = jax.tree.map(np.asarray, tree)
            return state, {**meta, "lora": cfg.to_dict()}

        out[name] = _rewrite(out["trained"], root / name, swap)
    return out


@pytest.fixture(scope="module")
def loaded(base_dir, runs):
    """The base as served, and each run's adapters read by ``load_adapter``."""
    base = load(base_dir)
    return base, {name: load_adapter(str(path), base.config, base.params, name=name)
                  for name, path in runs.items()}


PROMPTS = ["the cat sat on the red mat", "the dog ran", "one two three",
           "the big dog sat on the blue log", "yes no"]


def _merged_greedy(tokenizer, params, prompts, max_tokens=8):
    engine = Engine(CONFIG, params, 2, 24, 8, 20, tokenizer=tokenizer)
    ids = [engine.add_request(encode_text(tokenizer, p),  # as the server encodes a prompt
                              SamplingParams(max_tokens=max_tokens, logprobs=True,
                                             stop_token_ids=(tokenizer.eos_id,)))
           for p in prompts]
    done = run_until_idle(engine)
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def merged(runs, loaded):
    """Each adapter merged alone (``load`` of its run) and the base: greedy completions."""
    base = loaded[0]
    out = {None: _merged_greedy(base.tokenizer, base.params, PROMPTS)}
    for name, path in runs.items():
        out[name] = _merged_greedy(base.tokenizer, load(path).params, PROMPTS)
    return out


def test_trained_and_written_adapters_load_with_their_base(loaded):
    _, adapters = loaded
    assert {n: a.lora_config.rank for n, a in adapters.items()} == {
        "trained": 4, "rank2": 2, "rank8": 8, "qk": 4}
    assert adapters["trained"].lora_config.targets == ("q", "v", "down")
    assert all(a.base_difference < 1e-6 for a in adapters.values())


# The engines serving every adapter (and the server's) alike: the same compiled steps.
MULTI = dict(num_slots=4, num_pages=48, page_size=8, token_budget=20)


def test_one_engine_serves_every_adapter_as_each_merged_alone(loaded, merged):
    base, adapters = loaded
    engine = Engine(CONFIG, base.params, **MULTI,
                    adapters={n: (a.adapters, a.lora_config) for n, a in adapters.items()})
    engine.compile()
    compiled = step_lib.step_jit._cache_size()
    asks = [(name, i) for i in range(len(PROMPTS)) for name in (None, *adapters)]
    ids = [engine.add_request(encode_text(base.tokenizer, PROMPTS[i]),
                              SamplingParams(max_tokens=8, logprobs=True, adapter=name,
                                             stop_token_ids=(base.tokenizer.eos_id,)))
           for name, i in asks]
    done = run_until_idle(engine)
    engine.check_no_leaks()
    for (name, i), rid in zip(asks, ids, strict=True):
        want = merged[name][i]
        assert done[rid].tokens == want.tokens, (name, PROMPTS[i])
        np.testing.assert_allclose(done[rid].logprobs, want.logprobs, atol=1e-4, rtol=0)
    # Rows of five models shared steps, and no program was compiled for the mix.
    assert step_lib.step_jit._cache_size() == compiled
    assert len({tuple(merged[n][0].tokens) for n in merged}) > 1  # the adapters differ


def test_prefix_pages_are_shared_within_an_adapter_only(loaded):
    base, adapters = loaded
    engine = Engine(CONFIG, base.params, **MULTI,
                    adapters={n: (a.adapters, a.lora_config) for n, a in adapters.items()})
    prompt = list(range(4, 22))  # two full pages before the last token, one chunk
    hits = []
    for name in ("trained", "rank8", "trained", None, None):
        rid = engine.add_request(prompt, SamplingParams(max_tokens=2, adapter=name))
        hits.append(run_until_idle(engine)[rid].prefix_hit_tokens)
    assert hits == [0, 0, 16, 0, 16]


# Through the server ------------------------------------------------------------------------------

# serve's options giving its engine MULTI.
SERVE_FLAGS = {"num_slots": "--slots", "num_pages": "--pages", "page_size": "--page-size",
               "token_budget": "--token-budget"}


@pytest.fixture(scope="module")
def server(base_dir, runs):
    from transformer_jax.cli import serve as cli
    from transformer_jax.serve.app import create_app

    engine = [a for k, v in MULTI.items() for a in (SERVE_FLAGS[k], str(v))]
    args = cli.build_parser().parse_args([
        "--checkpoint", str(base_dir), *engine,
        *(a for n, p in runs.items() for a in ("--lora", f"{n}={p}"))])
    runner, model, _ = cli.build(args)
    runner.start()
    served = Served(create_app(runner, model))
    yield served
    served.close()
    runner.stop()


def test_server_lists_the_adapters_and_serves_each_by_name(server, merged):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    listed = {m.id: m.model_dump().get("parent") for m in client.models.list().data}
    assert listed == {NAME: None, "trained": NAME, "rank2": NAME, "rank8": NAME, "qk": NAME}
    asks = [(name, i) for name in merged for i in range(len(PROMPTS))]

    def ask(name_i):
        name, i = name_i
        return client.completions.create(model=name or NAME, prompt=PROMPTS[i], max_tokens=8,
                                         temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:  # one batch, all models
        texts = list(pool.map(ask, asks))
    for (name, i), text in zip(asks, texts, strict=True):
        assert text == merged[name][i].text, (name, PROMPTS[i])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="trained2", prompt="the", max_tokens=2)


# Bad adapters ------------------------------------------------------------------------------------

def test_adapters_of_another_base_or_no_adapters_are_refused(base_dir, runs, loaded,
                                                             tmp_path):
    from transformer_jax.cli import serve as cli

    base, _ = loaded

    def other_base(state, meta):
        state["params"][lora.BASE] = jax.tree.map(
            lambda x: np.asarray(x) * 1.5, state["params"][lora.BASE])
        return state, meta

    moved = _rewrite(runs["trained"], tmp_path / "moved", other_base)
    with pytest.raises(ValueError, match=r"--lora x=.*trained on another base: its .* differs"):
        load_adapter(str(moved), base.config, base.params, name="x")
    with pytest.raises(ValueError, match="a LoRA adapter is a training run"):
        load_adapter(str(base_dir), base.config, base.params, name="hf")
    wider = base.config.replace(d_ff=96)
    with pytest.raises(ValueError, match="another architecture: d_ff=48"):
        load_adapter(str(runs["trained"]), wider, base.params, name="w")
    for specs, message in ((["x"], "NAME=RUN_DIR"), (["a=1", "a=2"], "names 'a' twice"),
                           (["=dir"], "NAME=RUN_DIR")):
        with pytest.raises(ValueError, match=message):
            cli.parse_lora(specs)
    with pytest.raises(ValueError, match="base model's name"):
        cli.parse_lora([f"{NAME}=dir"], NAME)
