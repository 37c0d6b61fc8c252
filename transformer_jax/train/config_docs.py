"""``--help`` text generated from the config dataclasses: each key's type, default and the
description its class's docstring gives it (``Attributes:``)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap

from transformer_jax.model import config as model_config
from transformer_jax.model.config import CONFIGS_DIR, preset_names
from transformer_jax.train import objective

#: Keys whose value is one of a tuple that their validation checks: ``--help`` lists the tuple
#: after the key's meaning, so the two cannot drift apart.
CHOICES: dict[str, tuple[str, ...]] = {
    **{f"model.{name}": getattr(model_config, const) for name, const in (
        ("norm", "NORMS"), ("norm_position", "NORM_POSITIONS"), ("qk_norm", "QK_NORMS"),
        ("ffn", "FFNS"), ("position", "POSITIONS"), ("rope_pairing", "ROPE_PAIRINGS"),
        ("remat", "REMATS"), ("attention_impl", "ATTENTION_IMPLS"), ("moe_impl", "MOE_IMPLS"),
        ("param_dtype", "DTYPES"), ("dtype", "DTYPES"))},
    "train.objective": objective.OBJECTIVES, "train.dpo_loss": objective.DPO_LOSSES,
    "train.grpo_loss": objective.GRPO_LOSSES,
}


def help_text(sections: dict[str, type], width: int = 100) -> str:
    """Every ``SECTION.KEY`` of the dataclasses in ``sections`` with its type, default and
    meaning, from their fields and docstrings (``train.py --help``)."""
    lines = [f"presets (--config NAME; TOML files in {CONFIGS_DIR}): {', '.join(preset_names())}"]
    for section, cls in sections.items():
        # The ``Attributes:`` of ``cls`` and its bases (a subclass's entry wins).
        meanings = {k: v for klass in reversed(cls.__mro__)
                    for k, v in _own_attribute_docs(klass).items()}
        lines += ["", f"{section}.KEY=VALUE ({cls.__name__}):"]
        for field in dataclasses.fields(cls):
            kind = field.type if isinstance(field.type, str) else getattr(
                field.type, "__name__", str(field.type))
            if field.default is not dataclasses.MISSING:
                default = field.default
            elif field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            else:
                default = "required"
            meaning = meanings.get(field.name, "").replace("``", "")
            if choices := CHOICES.get(f"{section}.{field.name}"):
                meaning += f" One of: {', '.join(choices)}."
            lines.append(f"  {section}.{field.name}: {kind} = {default!r}")
            if meaning:
                lines.extend(textwrap.wrap(meaning, width, initial_indent=" " * 6,
                                           subsequent_indent=" " * 6))
    return "\n".join(lines)


def _own_attribute_docs(cls: type) -> dict[str, str]:
    doc = cls.__doc__ and inspect.cleandoc(cls.__doc__) or ""
    found: dict[str, str] = {}
    inside, name = False, None
    for line in doc.splitlines():
        if not inside:
            inside = line.strip() == "Attributes:"
            continue
        if line and not line.startswith(" "):
            break  # the next section
        if match := re.match(r"^ {2}(\w+): ?(.*)$", line):
            name = match.group(1)
            found[name] = match.group(2).strip()
        elif name and line.strip():
            found[name] += " " + line.strip()
    return found
