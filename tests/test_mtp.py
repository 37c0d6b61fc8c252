"""Multi-token prediction (``mtp_depth``, ``model.mtp``): a tiny DeepseekV3 checkpoint (a dense
then a mixture-of-experts layer) written by ``save_pretrained``, to which the test adds a random
module as HF layer L (``model.layers.2.*``: the decoder layer's tensors, ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head``, ``embed_tokens``), loads with ``mtp_depth`` 1; the module's logits
equal the formula written here in torch over transformers' own decoder layer with those weights;
``mtp_depth=0`` drops it; export writes every tensor back equal; the training objective adds
``mtp_weight`` times the modules' cross-entropy computed from those reference logits."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, exit_and_line, fast_everywhere, spread_torch_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformer_jax import hf  # noqa: E402
from transformer_jax.checkpoint import loading  # noqa: E402
from transformer_jax.decode import speculative_loop, speculative_mtp  # noqa: E402
from transformer_jax.decode.generation import generate  # noqa: E402
from transformer_jax.decode.loop import prefill  # noqa: E402
from transformer_jax.decode.speculative import parse_spec  # noqa: E402
from transformer_jax.model.transformer import Transformer  # noqa: E402
from transformer_jax.train.checks import check_config  # noqa: E402
from transformer_jax.train.config import TrainConfig  # noqa: E402
from transformer_jax.train.init_from import init_model_config  # noqa: E402
from transformer_jax.train.step import make_loss_fn  # noqa: E402

B, T, V, D, L = 2, 9, 97, 32, 2
TOL = 1e-4


def _tiny_deepseek() -> "transformers.DeepseekV3ForCausalLM":
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=D, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True, max_position_embeddings=256,
        num_hidden_layers=L, first_k_dense_replace=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=16,
        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        num_nextn_predict_layers=1, attn_implementation="eager")
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    spread_torch_params(model)
    return model


def _mtp_tensors(state: dict[str, torch.Tensor], gen: torch.Generator
                 ) -> dict[str, torch.Tensor]:
    """A random module as HF layer L: layer L-1's tensor names and shapes in the saved file
    (a sparse layer), renamed, plus the module's own; ``embed_tokens`` a copy of the main
    table."""
    def rand(shape, vector=False):
        if vector:
            return 1.0 + 0.2 * torch.randn(shape, generator=gen)
        return torch.randn(shape, generator=gen) * shape[-1] ** -0.5

    last, new = f"model.layers.{L - 1}.", f"model.layers.{L}."
    out = {new + name[len(last):]: (0.3 * torch.randn(t.shape, generator=gen)
                                    if name.endswith("e_score_correction_bias")
                                    else rand(t.shape, t.ndim == 1))
           for name, t in state.items() if name.startswith(last)}
    out.update({new + "enorm.weight": rand((D,), True), new + "hnorm.weight": rand((D,), True),
                new + "eh_proj.weight": rand((D, 2 * D)),
                new + "shared_head.norm.weight": rand((D,), True),
                new + "shared_head.head.weight": rand((V, D)),
                new + "embed_tokens.weight": state["model.embed_tokens.weight"].clone()})
    return out


pytestmark = pytest.mark.usefixtures("fast_generate_compiles")


@pytest.fixture(scope="module", autouse=True)
def cheap_verification():
    """A verify round costs one plain round (not timed): rows with proposals verify them; the
    speculative program compiles with ``FAST_COMPILE``."""
    original = dict(speculative_loop.PROGRAMS)
    if not fast_everywhere():
        speculative_loop.PROGRAMS.update(
            speculative_loop.jit_programs(compiler_options=FAST_COMPILE))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(speculative_loop, "round_cost", lambda *a: 1.0)
        yield
    speculative_loop.PROGRAMS.update(original)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, its MTP layer's tensors, the directory)."""
    model = _tiny_deepseek()
    path = tmp_path_factory.mktemp("deepseek_mtp")
    model.save_pretrained(path)
    weights = safetensors_torch.load_file(path / "model.safetensors")
    extra = _mtp_tensors(weights, torch.Generator().manual_seed(1))
    safetensors_torch.save_file({**weights, **extra}, path / "model.safetensors",
                                metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return model, extra, path


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return hf.load(checkpoint[2])


def _tokens(seed=0):
    return np.random.default_rng(seed).integers(0, V, (B, T))


def reference_mtp_logits(model, extra, tokens) -> np.ndarray:
    """Module 1's logits [B, T, V], the formula in torch: h'_i = eh_proj([enorm(emb(t_{i+1}));
    hnorm(h_i)]) (h the main model's final-normed hidden states), transformers' decoder layer
    with the module's weights over h' (causal, positions 0..T-1), then shared_head's norm
    and head. Entry T-1 (no token i+1) embeds zeros."""
    cfg = model.config
    layer = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(
        cfg, L).eval()
    prefix = f"model.layers.{L}."
    state = {k[len(prefix):]: v for k, v in extra.items() if k.split(".")[3] in (
        "self_attn", "mlp", "input_layernorm", "post_attention_layernorm")}
    experts = range(cfg.n_routed_experts)  # the file's one tensor per expert, stacked

    def pop(j, name):
        return state.pop(f"mlp.experts.{j}.{name}.weight")

    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([pop(j, "gate_proj"), pop(j, "up_proj")]) for j in experts])
    state["mlp.experts.down_proj"] = torch.stack([pop(j, "down_proj") for j in experts])
    layer.load_state_dict(state)

    def rms(x, w):
        x = x.float()
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    with torch.no_grad():
        ids = torch.tensor(tokens, dtype=torch.long)
        h = model.model(ids).last_hidden_state  # final-normed
        emb = torch.nn.functional.pad(model.model.embed_tokens(ids)[:, 1:], (0, 0, 0, 1))
        x = torch.cat([rms(emb, extra[prefix + "enorm.weight"]),
                       rms(h, extra[prefix + "hnorm.weight"])], -1)
        x = x @ extra[prefix + "eh_proj.weight"].T
        positions = torch.arange(T)[None].expand(B, T)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)
        x = layer(x, attention_mask=mask, position_ids=positions,
                  position_embeddings=model.model.rotary_emb(x, positions))
        x = x[0] if isinstance(x, tuple) else x
        y = rms(x, extra[prefix + "shared_head.norm.weight"])
        return (y @ extra[prefix + "shared_head.head.weight"].T).numpy()


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def _mtp_forward(config, params, tokens):
    """One program for every call of a config (a jit per call traces it again)."""
    out = Transformer(config).apply({"params": params}, tokens, mtp=True)
    return out.logits, out.mtp


def _mtp_logits(config, params, tokens):
    logits, mtp = _mtp_forward(config, params, jnp.asarray(tokens))
    return np.asarray(logits), np.asarray(mtp)


def test_module_logits_equal_the_formula_over_transformers_layer(checkpoint, loaded):
    model, extra, _ = checkpoint
    config, params = loaded
    assert config.mtp_depth == 1 and "mtp_0" in params
    tokens = _tokens()
    logits, mtp = _mtp_logits(config, params, tokens)
    with torch.no_grad():
        want_main = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(logits, want_main, atol=TOL, rtol=0)  # the main model unchanged
    want = reference_mtp_logits(model, extra, tokens)
    assert mtp.shape == (1, B, T, V)
    np.testing.assert_allclose(mtp[0], want, atol=TOL, rtol=0)
    # The concatenation's order matters: swapping the halves of eh_proj moves the logits.
    swapped = jax.tree.map(lambda x: x, params)
    w = params["mtp_0"]["eh_proj"]
    swapped["mtp_0"] = {**params["mtp_0"], "eh_proj": jnp.concatenate([w[D:], w[:D]])}
    assert np.abs(_mtp_logits(config, swapped, tokens)[1][0] - want).max() > 1e-2


def test_mtp_depth_zero_drops_the_module_in_one_log_line(checkpoint, loaded, caplog):
    with caplog.at_level("INFO", logger="transformer_jax.hf"):
        config, params = hf.load(checkpoint[2], mtp_depth=0)
    assert config.mtp_depth == 0 and not any(k.startswith("mtp_") for k in params)
    assert sum("multi-token prediction" in r.message for r in caplog.records) == 1
    np.testing.assert_array_equal(params["lm_head"], loaded[1]["lm_head"])
    with pytest.raises(ValueError, match=r"^mtp_depth=2: the checkpoint .* has 1 multi-token"):
        hf.load(checkpoint[2], mtp_depth=2)


def test_a_module_table_unlike_the_main_one_is_refused_in_one_line(checkpoint, tmp_path):
    _, _, path = checkpoint
    weights = safetensors_torch.load_file(path / "model.safetensors")
    weights[f"model.layers.{L}.embed_tokens.weight"] = weights[
        f"model.layers.{L}.embed_tokens.weight"] + 1.0
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    safetensors_torch.save_file(weights, tmp_path / "model.safetensors",
                                metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"^model\.layers\.2\.embed_tokens\.weight differs"):
        hf.load(tmp_path)


def test_export_writes_every_tensor_back_equal(checkpoint, loaded, tmp_path):
    config, params = loaded
    hf.save(config, params, tmp_path)
    before = safetensors_torch.load_file(checkpoint[2] / "model.safetensors")
    after = safetensors_torch.load_file(tmp_path / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    again, _ = hf.load(tmp_path)
    assert again == config


def _log_softmax_ce(logits: np.ndarray, targets: np.ndarray, weights: np.ndarray) -> float:
    logits = logits.astype(np.float64)
    z = logits.max(-1, keepdims=True)
    logp = logits - z - np.log(np.exp(logits - z).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return float((ce * weights).sum() / weights.sum())


def test_training_loss_adds_the_modules_weighted_cross_entropy(checkpoint, loaded):
    model, extra, _ = checkpoint
    config, params = loaded
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, V, (B, T + 1))
    mask = np.ones((B, T), np.float32)
    mask[0, :3] = 0  # a prompt: its targets carry no loss, the modules' shifted ones neither
    mask[1, -2:] = 0
    batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
             "mask": jnp.asarray(mask)}
    weight = 0.3
    with_mtp, without = (jax.jit(make_loss_fn(config, TrainConfig(mtp_weight=w)),
                                 compiler_options=FAST_COMPILE)(params, batch)
                         for w in (weight, 0.0))
    (objective, (ce, _, count, sums)), (plain, (ce0, _, count0, *_)) = with_mtp, without
    np.testing.assert_allclose(ce, ce0, rtol=1e-6)
    assert count == count0 == mask.sum()
    # Module 1 at position i predicts token i + 2 = targets[i + 1], weighted by mask[i + 1].
    ref = reference_mtp_logits(model, extra, tokens[:, :-1])
    want = _log_softmax_ce(ref[:, :-1], tokens[:, 2:], mask[:, 1:])
    np.testing.assert_allclose(float(sums["mtp"]) / float(count), want, rtol=1e-4)
    np.testing.assert_allclose(float(objective) - float(plain), weight * float(sums["mtp"]),
                               rtol=1e-4)


@pytest.mark.parametrize("k", [1, 2])
def test_module_targets_stay_within_a_row_and_its_packed_segment(k):
    from transformer_jax.model.mtp import mtp_targets  # noqa: PLC0415

    rng = np.random.default_rng(k)
    targets = rng.integers(1, V, (2, 9))
    mask = rng.random((2, 9)).astype(np.float32)
    segments = np.sort(rng.integers(0, 3, (2, 9)), -1)[:, ::-1].copy()  # packed, 0-padded
    got_t, got_w = mtp_targets(jnp.asarray(targets), jnp.asarray(mask), jnp.asarray(segments), k)
    want_t, want_w = np.zeros_like(targets), np.zeros_like(mask)
    for b in range(2):
        for i in range(9 - k):
            want_t[b, i] = targets[b, i + k]
            want_w[b, i] = mask[b, i + k] * (segments[b, i + k] == segments[b, i])
    np.testing.assert_array_equal(got_t, want_t)
    np.testing.assert_array_equal(got_w, want_w)


def test_mtp_weight_is_refused_where_it_cannot_apply_in_one_line(loaded):
    with pytest.raises(ValueError, match=r"^mtp_weight trains .* full sft training only"):
        TrainConfig(mtp_weight=0.1, lora_rank=4)
    with pytest.raises(ValueError, match=r"^mtp_weight must be a number >= 0"):
        TrainConfig(mtp_weight=-1.0)
    with pytest.raises(ValueError, match=r"model\.mtp_depth=0\); set it to 0$"):
        check_config(loaded[0].replace(mtp_depth=0), TrainConfig(mtp_weight=0.1, seq_len=8),
                     num_devices=1)


def test_the_draft_proposes_what_the_cacheless_module_predicts(loaded):
    """The draft's cached rounds (the prompt, a verification keeping its proposal, a plain
    step) propose the argmax of the module's whole-sequence logits at the row's last kept
    position: the hidden states, tokens, positions and cache line up."""
    config, params = loaded
    seq = jnp.asarray(_tokens(5))
    n, b = 5, seq.shape[0]

    def truth(start):  # a draw that gives the sequence's own next tokens
        return lambda logits: (seq[:, start + 1:start + 1 + logits.shape[1]],
                               jnp.zeros(logits.shape[:2]))

    def rounds(params, seq):
        full = Transformer(config).apply({"params": params}, seq, mtp=True).mtp[0]
        lengths = jnp.full((b,), n, jnp.int32)
        _, cache, hidden = prefill(config, params, seq[:, :n], lengths, T + 2, with_hidden=True)
        first, draft_cache = speculative_mtp.first_proposal(
            config, params, hidden, seq[:, :n], seq[:, n], lengths, T + 2, None)
        start = jnp.full((b,), n, jnp.int32)
        cache, draft_cache, kept, _, _, a = speculative_mtp.verify(
            config, params, cache, draft_cache, seq[:, n:n + 2], start,
            jnp.ones((b,), jnp.int32), truth(n))
        *_, plain, _, _, _ = speculative_mtp.verify(
            config, params, cache, draft_cache, seq[:, n + 2:n + 3], start + 2,
            jnp.zeros((b,), jnp.int32), truth(n + 2))
        return full.argmax(-1), first, kept, a, plain

    want, first, kept, a, plain = jax.jit(rounds, compiler_options=FAST_COMPILE)(params, seq)
    want = np.asarray(want)  # [B, T]: position j predicts token j + 2
    np.testing.assert_array_equal(first, want[:, n - 1])
    np.testing.assert_array_equal(a, 1)  # the proposal was the sequence's token: kept
    np.testing.assert_array_equal(kept, want[:, n + 1])
    np.testing.assert_array_equal(plain, want[:, n + 2])


def test_mtp_speculative_generate_equals_plain_greedy(loaded, caplog):
    config, params = loaded
    prompts = [[5, 17, 3, 60, 2], [9, 1]]
    plain = generate(config, params, prompts, max_new_tokens=12, temperature=0.0)
    with caplog.at_level("INFO", logger="transformer_jax.decode.generation"):
        spec = generate(config, params, prompts, max_new_tokens=12, temperature=0.0,
                        speculative="mtp")
    assert [list(t) for t in spec.tokens] == [list(t) for t in plain.tokens]
    assert sum(s.verifications for s in spec.speculative) > 0
    # Zero gains on the two final norms: both heads see zeros, so the target draws token 0
    # and the module proposes it: every proposal kept (two tokens a round), the same tokens.
    agree = {**params, "final_norm": {"scale": jnp.zeros(D)},
             "mtp_0": {**params["mtp_0"], "head_norm": {"scale": jnp.zeros(D)}}}
    kept = generate(config, agree, prompts, max_new_tokens=12, temperature=0.0,
                    speculative="mtp")
    assert [list(t) for t in kept.tokens] == [[0] * 12] * 2
    assert all(s.accepted >= 4 and s.accepted == s.proposed for s in kept.speculative)
    assert any("speculative generate (mtp:k=1)" in r.message and "acceptance" in r.message
               for r in caplog.records)


def test_mtp_speculation_is_refused_in_one_line_where_it_cannot_apply(loaded):
    config, params = loaded
    with pytest.raises(ValueError, match=r"^speculative mtp drafts with the model's multi-token"):
        generate(config.replace(mtp_depth=0), params, [[1, 2]], max_new_tokens=2,
                 speculative="mtp")
    with pytest.raises(ValueError, match=r"^speculative mtp proposes one token a round"):
        parse_spec("mtp:k=2")
    assert str(parse_spec("mtp")) == str(parse_spec("mtp:k=1")) == "mtp:k=1"


def test_serve_refuses_mtp_speculation_it_cannot_run_in_one_line(checkpoint, tmp_path, capsys):
    """``serve --speculative mtp`` (the engine's proposer: tests/test_mtp_engine.py) on a
    checkpoint without the module's tensors: exit 1 with one line, after the load and before
    any step compiles; a k other than 1 before the load."""
    from transformer_jax.cli import serve as cli

    weights = safetensors_torch.load_file(checkpoint[2] / "model.safetensors")
    safetensors_torch.save_file({k: v for k, v in weights.items()
                                 if not k.startswith(f"model.layers.{L}.")},
                                tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((checkpoint[2] / "config.json").read_text())
    for spec, message in (("mtp", "speculative mtp drafts with the model's multi-token"),
                          ("mtp:k=2", "speculative mtp proposes one token a round")):
        code, line = exit_and_line(capsys, cli.main, "--checkpoint", str(tmp_path),
                                   "--compilation-cache", "", "--speculative", spec,
                                   "--port", "0", "--slots", "2")
        assert code == 1 and message in line, line


def test_a_run_from_the_checkpoint_may_drop_the_modules(checkpoint, tmp_path):
    """``train.init_from``: the checkpoint's model has its module, ``model.mtp_depth=0`` drops
    it (the main model unchanged), another depth is refused; a checkpoint whose config says
    ``num_nextn_predict_layers`` 1 without the tensors (``save_pretrained``'s) has none."""
    source = loading.locate(checkpoint[2])
    assert source.model.mtp_depth == 1
    assert init_model_config(source, {"mtp_depth": 0}).mtp_depth == 0
    with pytest.raises(ValueError, match=r"model\.mtp_depth=2 \(the checkpoint has 1\)"):
        init_model_config(source, {"mtp_depth": 2})
    assert "mtp_0" not in loading.load(source, mtp_depth=0, with_tokenizer=False).params
    weights = safetensors_torch.load_file(checkpoint[2] / "model.safetensors")
    safetensors_torch.save_file({k: v for k, v in weights.items()
                                 if not k.startswith(f"model.layers.{L}.")},
                                tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((checkpoint[2] / "config.json").read_text())
    assert loading.locate(tmp_path).model.mtp_depth == hf.load(tmp_path)[0].mtp_depth == 0
