"""Reasoning in chat replies (``serve.reasoning``): the ``<think>`` block is cut from the
content by one rule, streamed or not, however the stream cuts the text."""

from __future__ import annotations

import random

import pytest

from transformer_jax.serve import reasoning
from transformer_jax.serve.reasoning import CONTENT, REASONING, ThinkSplitter, split

CASES = [  # (reply, the prompt opened <think>, reasoning, content)
    ("<think>plan a</think>\n\nanswer", False, "plan a", "answer"),
    ("  <think>\nx y\n</think>\nz</think>w", False, "\nx y\n", "z</think>w"),
    ("plan a</think>\n\nanswer", True, "plan a", "answer"),
    ("still thinking when cut", True, "still thinking when cut", ""),
    ("<think>cut mid-thought", False, "cut mid-thought", ""),
    ("no thinking at all", False, None, "no thinking at all"),
    ("a <think> later is content", False, None, "a <think> later is content"),
    ("", True, "", ""),
    ("", False, None, ""),
    ("<thi", False, None, "<thi"),
    ("</think>\n\n", True, "", ""),
    ("<think></think>answer <think>x</think>", False, "", "answer <think>x</think>"),
]


@pytest.mark.parametrize(("text", "opened", "thought", "content"), CASES)
def test_the_think_block_is_the_reasoning_and_the_rest_the_content(text, opened, thought,
                                                                     content):
    assert split(text, opened) == (thought, content)


def _streamed(text: str, opened: bool, cuts: list[int]) -> tuple[str, str]:
    splitter, pieces, at = ThinkSplitter(opened), [], 0
    for cut in [*cuts, len(text)]:
        pieces += splitter.feed(text[at:cut])
        at = cut
    pieces += splitter.finish()
    assert all(t for _, t in pieces)  # no empty piece goes out
    return ("".join(t for k, t in pieces if k == REASONING),
            "".join(t for k, t in pieces if k == CONTENT))


def test_streamed_pieces_join_to_the_whole_split_however_the_text_is_cut():
    rng = random.Random(0)
    for text, opened, _, _ in CASES:
        for _ in range(40):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(0, 6))))
            thought, content = split(text, opened)
            assert _streamed(text, opened, cuts) == (thought or "", content), (text, cuts)


def test_a_tag_cut_across_chunks_is_held_back_not_sent_as_text():
    splitter = ThinkSplitter(opened=True)
    assert splitter.feed("abc</th") == [(REASONING, "abc")]
    assert splitter.feed("ink>\n") == []
    assert splitter.feed("\nok") == [(CONTENT, "ok")]
    start = ThinkSplitter()
    assert start.feed(" <th") == [] and start.feed("ink>x") == [(REASONING, "x")]


def test_the_prompt_opens_thinking_when_it_ends_inside_a_think_block():
    assert reasoning.prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not reasoning.prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not reasoning.prompt_opens_thinking("<|im_start|>assistant\n")


def test_an_unknown_parser_is_refused_naming_the_choices():
    reasoning.check_parser("qwen3")
    with pytest.raises(ValueError, match=r"--reasoning-parser must be one of \['deepseek_r1', "
                                         r"'qwen3'\], got 'o1'"):
        reasoning.check_parser("o1")
