"""The docs and ``--help`` texts against the command line's behaviour: docs/cli.md names every
option of each command and every bench kind, no page cites a bench kind that does not exist,
``train --help`` lists every value a choice key accepts, and ``train.grpo_temperature`` is
described as the code uses it."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from transformer_jax.bench.__main__ import KINDS
from transformer_jax.model import config as model_config
from transformer_jax.train import objective
from transformer_jax.train.config import QUANT_SCHEMES, config_help

ROOT = Path(__file__).resolve().parent.parent
CLI_MD = ROOT / "docs" / "cli.md"


def _sections(text: str) -> dict[str, str]:
    """``{heading: body}`` of the ``## `` sections of a Markdown page."""
    out, name = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            name = line[3:].strip()
            out[name] = ""
        elif name is not None:
            out[name] += line + "\n"
    return out


def _names(text: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


@pytest.mark.parametrize("command", ["generate", "serve", "evaluate", "export", "plot"])
def test_cli_md_names_every_option_of_each_command(command):
    section = _sections(CLI_MD.read_text())[command]
    parser = importlib.import_module(f"transformer_jax.cli.{command}").build_parser()
    missing = [action.option_strings for action in parser._actions
               if action.option_strings and "--help" not in action.option_strings
               and not any(_names(section, o) for o in action.option_strings)]
    assert not missing, f"docs/cli.md's {command} section lacks {missing}"


def test_cli_md_names_every_bench_kind():
    text = CLI_MD.read_text()
    section = _sections(text)["bench"]
    assert [k for k in KINDS if f"`{k}`" not in section] == []
    [row] = [line for line in text.splitlines() if line.startswith("| `bench KIND` |")]
    assert [k for k in KINDS if not re.search(rf"\b{k}\b", row)] == []


def test_the_docs_cite_only_bench_kinds_that_exist():
    cited = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for name in re.findall(r"(?:transformer-jax bench|-m transformer_jax\.bench) "
                               r"([a-z][\w-]*)", page.read_text()):
            if name not in (*KINDS, "KIND"):
                cited.setdefault(page.name, []).append(name)
    assert not cited


def _help_of(key: str) -> str:
    """The description ``train --help`` gives ``key`` (its indented lines, joined)."""
    lines = config_help(width=10_000).splitlines()
    start = lines.index(next(line for line in lines if line.startswith(f"  {key}: ")))
    body = []
    for line in lines[start + 1:]:
        if not line.startswith("      "):
            break
        body.append(line.strip())
    return " ".join(body)


# Each choice key and the values its validation accepts, from the constants it checks against.
CHOICE_KEYS = {
    "model.norm": model_config.NORMS, "model.norm_position": model_config.NORM_POSITIONS,
    "model.qk_norm": model_config.QK_NORMS, "model.ffn": model_config.FFNS,
    "model.position": model_config.POSITIONS, "model.rope_pairing": model_config.ROPE_PAIRINGS,
    "model.remat": model_config.REMATS, "model.attention_impl": model_config.ATTENTION_IMPLS,
    "model.moe_impl": model_config.MOE_IMPLS, "model.param_dtype": model_config.DTYPES,
    "model.dtype": model_config.DTYPES, "train.objective": objective.OBJECTIVES,
    "train.dpo_loss": objective.DPO_LOSSES, "train.grpo_loss": objective.GRPO_LOSSES,
    "train.quant": QUANT_SCHEMES[1:], "data.packing": ("auto", "pack", "concat"),
}


@pytest.mark.parametrize("key", list(CHOICE_KEYS))
def test_train_help_lists_every_value_of_a_choice_key(key):
    text = _help_of(key)
    missing = [v for v in CHOICE_KEYS[key] if not re.search(rf"(?<![\w-]){v}(?![\w-])", text)]
    assert not missing, f"train --help's {key} omits {missing}: {text!r}"


def test_grpo_temperature_is_described_as_the_code_uses_it():
    """The trainer's log-probs are the model's at temperature 1, as the engine reports them
    (``make_grpo_loss_fn``'s default, which ``GRPO.step_fn`` keeps): the help and
    docs/fine-tuning.md say so, and neither says the logits are divided by it."""
    text = _help_of("train.grpo_temperature")
    assert "temperature 1" in text and "divide the logits by it" not in text
    docs = " ".join((ROOT / "docs" / "fine-tuning.md").read_text().split())
    assert "The log-probs are the model's at temperature 1" in docs
    assert "divide the logits by `train.grpo_temperature`" not in docs
