"""lm-evaluation-harness through ``transformer_jax.evaluate``: a tiny multiple-choice task and a
rolling-perplexity task defined here (YAML + local JSONL) give the log-likelihoods of the model's
own forward and of the harness's ``hf`` backend on the same checkpoint; packing, truncation and
stop strings.

The checkpoint is a tiny random Llama (GQA) saved with ``save_pretrained`` and a word-level
``tokenizer.json`` (bos added), both made here; no network.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import CHATML_SPECIALS, random_hf_model, write_chatml_tokenizer
from lm_eval.api.instance import Instance

from transformer_jax.cli.evaluate import main as evaluate_main
from transformer_jax.evaluate import scoring
from transformer_jax.evaluate.harness import JaxLM
from transformer_jax.evaluate.local_tasks import write_multiple_choice_task, write_rolling_task
from transformer_jax.model.transformer import Transformer

WORDS = "the cat dog sat ran on a mat log red blue big small is yes no one two three".split()
MAX_LEN = 32  # the model's window, so that the rolling task needs several windows
TOL = 1e-4


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("llama")
    model = random_hf_model("llama", seed=0, vocab_size=len(CHATML_SPECIALS) + len(WORDS),
                            hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=MAX_LEN,
                            tie_word_embeddings=False)
    model.save_pretrained(directory, safe_serialization=True)
    # No bos added: transformers 5 ignores add_bos_token=True of a tokenizer_config without a
    # tokenizer_class, while HFTokenizer honours it; both agree on False.
    write_chatml_tokenizer(directory, WORDS, add_bos_token=False, add_eos_token=False)
    return directory


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    """``tiny_mc`` (multiple choice, 8 questions of 3 choices) and ``tiny_ppl`` (rolling
    log-likelihood of 4 documents, two longer than the window)."""
    directory = tmp_path_factory.mktemp("tasks")
    rng = random.Random(0)
    write_multiple_choice_task(directory, "tiny_mc", (
        {"question": _sentence(rng, rng.randint(2, 12)) + " is",
         "choices": [_sentence(rng, rng.randint(1, 3)) for _ in range(3)],
         "answer": rng.randrange(3)} for _ in range(8)))
    write_rolling_task(directory, "tiny_ppl", [_sentence(rng, n) for n in (5, 20, 45, 70)])
    return directory


@pytest.fixture(scope="module")
def lm(checkpoint) -> JaxLM:
    return JaxLM(str(checkpoint), batch_size=2)


@pytest.fixture(scope="module")
def hf_lm(checkpoint):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(checkpoint), device="cpu", batch_size=4, dtype="float32")


@pytest.fixture(scope="module")
def instances(tasks_dir) -> dict[str, list[Instance]]:
    """The requests the harness builds for each task."""
    # Imported here, not with the module: lm_eval.tasks (datasets, pandas) costs every
    # pytest-xdist worker about 2 s of CPU at collection, also the one that does not run this.
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(tasks_dir), include_defaults=False).load(
        ["tiny_mc", "tiny_ppl"])["tasks"]
    out = {}
    for name, task in tasks.items():
        task.build_all_requests(rank=0, world_size=1)
        out[name] = task.instances
    return out


@functools.cache
def _forward(config):
    return jax.jit(lambda params, ids: Transformer(config).apply({"params": params}, ids).logits)


def _forward_logprobs(lm: JaxLM, ids: list[int]) -> np.ndarray:
    """log p(ids[i + 1] | ids[:i + 1]) from one unpacked forward, in float64 on the host (the
    row right-padded to the window: causal attention keeps the padding out of the rest)."""
    row = np.zeros((1, MAX_LEN), np.int32)
    row[0, :len(ids) - 1] = ids[:-1]
    logits = np.asarray(_forward(lm.config)(lm.loaded.params, row)[0, :len(ids) - 1],
                        np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return logp[np.arange(len(ids) - 1), ids[1:]]


def test_multiple_choice_matches_forward_and_hf_backend(lm, hf_lm, instances, tasks_dir,
                                                        tmp_path, monkeypatch):
    requests = instances["tiny_mc"]
    ours = lm.loglikelihood(requests, disable_tqdm=True)
    theirs = hf_lm.loglikelihood(requests, disable_tqdm=True)
    for req, (lp, greedy), (hf_lp, hf_greedy) in zip(requests, ours, theirs, strict=True):
        context, continuation = req.args
        ctx = lm.tok_encode(context)
        whole = lm.tok_encode(context + continuation)
        direct = _forward_logprobs(lm, whole)[len(ctx) - 1:].sum()
        assert lp == pytest.approx(direct, abs=TOL)
        assert lp == pytest.approx(hf_lp, abs=TOL)
        assert greedy == hf_greedy
    # The harness's accuracy over our scores == the one of the hf backend's scores.
    out = tmp_path / "results.json"
    # The harness's environment report runs torch's collect_env in subprocesses (seconds).
    import lm_eval.evaluator

    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
    assert evaluate_main(["--checkpoint", str(lm.loaded.source.path), "--tasks", "tiny_mc",
                          "--include-path", str(tasks_dir), "--output", str(out),
                          "--bootstrap-iters", "0"]) == 0
    acc = json.loads(out.read_text())["results"]["tiny_mc"]["acc,none"]
    docs = {}
    for req, (hf_lp, _) in zip(requests, theirs, strict=True):
        docs.setdefault(req.doc_id, (req.doc["answer"], []))[1].append(hf_lp)
    hf_acc = np.mean([int(np.argmax(lps)) == answer for answer, lps in docs.values()])
    assert acc == pytest.approx(hf_acc)


def test_rolling_loglikelihood_matches_forward_and_hf_backend(lm, hf_lm, instances):
    requests = instances["tiny_ppl"]
    ours = lm.loglikelihood_rolling(requests, disable_tqdm=True)
    theirs = hf_lm.loglikelihood_rolling(requests, disable_tqdm=True)
    for req, total, hf_total in zip(requests, ours, theirs, strict=True):
        assert total == pytest.approx(hf_total, rel=TOL)
        ids = [lm.prefix_token_id, *lm.tok_encode(req.args[0])]
        if len(ids) <= MAX_LEN + 1:  # one window: the whole text in one forward
            assert total == pytest.approx(_forward_logprobs(lm, ids).sum(), abs=TOL)
    assert max(len(lm.tok_encode(r.args[0])) for r in requests) > 2 * MAX_LEN


def test_packed_rows_equal_one_request_per_row(lm):
    rng = np.random.default_rng(0)
    requests = [scoring.window(rng.integers(0, 24, n).tolist(), rng.integers(0, 24, c).tolist(),
                               MAX_LEN) for n, c in ((3, 2), (10, 1), (1, 5), (20, 4), (7, 7))]
    packed = scoring.pack_requests(requests, MAX_LEN)
    assert packed.inputs.shape[0] < len(requests)  # several requests share a row
    together = lm.scorer.score(requests)
    for request, (lp, greedy) in zip(requests, together, strict=True):
        alone_lp, alone_greedy = lm.scorer.score([request])[0]
        assert lp == pytest.approx(alone_lp, abs=1e-5) and greedy == alone_greedy


def test_long_contexts_are_truncated_from_the_left(lm, hf_lm):
    """A context past the window loses its start: the last MAX_LEN + 1 tokens are scored,
    as the hf backend does."""
    rng = random.Random(1)
    context, continuation = _sentence(rng, 50), " " + _sentence(rng, 3)
    req = Instance("loglikelihood", {}, (context, continuation), 0)
    (lp, _), = lm.loglikelihood([req], disable_tqdm=True)
    (hf_lp, _), = hf_lm.loglikelihood([req], disable_tqdm=True)
    whole = lm.tok_encode(context + continuation)
    n = len(lm.tok_encode(continuation, add_special_tokens=False))
    assert len(whole) > MAX_LEN + 1
    kept = whole[-(MAX_LEN + 1):]
    assert lp == pytest.approx(_forward_logprobs(lm, kept)[-n:].sum(), abs=TOL)
    assert lp == pytest.approx(hf_lp, abs=TOL)


@pytest.mark.usefixtures("fast_generate_compiles")
def test_generate_until_stops_at_stop_strings_exactly(lm):
    """The answer is the greedy text cut right before the first stop string, and at most
    max_gen_toks tokens (one word each for this tokenizer)."""
    context = "the cat sat on"
    free, = lm.generate_until([Instance("generate_until", {}, (context, {
        "until": [], "max_gen_toks": 12, "do_sample": False}), 0)], disable_tqdm=True)
    words = free.split()
    assert 6 <= len(words) <= 12, free
    stop = " ".join(words[3:5])
    cut, = lm.generate_until([Instance("generate_until", {}, (context, {
        "until": [stop], "max_gen_toks": 12}), 0)], disable_tqdm=True)
    assert cut == free[:free.index(stop)] and stop not in cut


def test_text_starts_with_bos_as_transformers_encodes_it(tmp_path):
    """A SentencePiece tokenizer adds bos (LlamaTokenizer's default) unless the text already
    starts with the bos piece; its bos decodes to "", which must not count as a prefix."""
    from types import SimpleNamespace

    from transformer_jax.tokenizer import Tokenizer

    tok = Tokenizer.train(["the quick brown fox <s> jumps. " * 20], tmp_path / "t.model",
                          vocab_size=40, model_type="char")
    assert tok.add_bos_token and tok.decode([tok.bos_id]) == ""
    lm = SimpleNamespace(tok=tok)
    assert JaxLM.tok_encode(lm, "the fox") == [tok.bos_id, *tok.encode("the fox")]
    assert JaxLM.tok_encode(lm, "<s>the fox") == tok.encode("<s>the fox")
    assert JaxLM.tok_encode(lm, "the fox", add_special_tokens=False) == tok.encode("the fox")
    assert JaxLM.tok_encode(lm, "the fox", left_truncate_len=3) == tok.encode("the fox")[-3:]


def test_cli_errors_are_one_line(tasks_dir, tmp_path, capsys):
    out = str(tmp_path / "r.json")
    with pytest.raises(SystemExit) as info:  # an argument error: argparse's, exit status 2
        evaluate_main(["--checkpoint", str(tmp_path), "--tasks", "tiny_mc",
                       "--include-path", str(tmp_path / "none"), "--output", out])
    assert info.value.code == 2
    assert "argument --include-path" in capsys.readouterr().err
    assert evaluate_main(["--checkpoint", str(tmp_path / "gone"), "--tasks", "tiny_mc",
                          "--include-path", str(tasks_dir), "--output", out]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path / 'gone'}: {tmp_path / 'gone'} does not exist"]
    with pytest.raises(SystemExit) as info:
        evaluate_main(["--checkpoint", str(tmp_path), "--tasks", " , ", "--output", out])
    assert info.value.code == 2
