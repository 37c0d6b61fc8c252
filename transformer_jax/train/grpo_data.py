"""GRPO's inputs: the prompts (a JSONL of chat ``messages`` or ``prompt`` records) and the
reward functions of ``train.reward``, with ``FILE:LINE`` errors."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax.data.instruct_records import InstructionDataError, _check_messages, read_jsonl
from transformer_jax.tokenizer.prompt import encode_chat_prompt, encode_text

RewardFn = Callable[[str, dict], float]

#: The largest reward magnitude: the rewards and advantages are float32 in the update.
MAX_REWARD = float(np.finfo(np.float32).max)

_SPEC = re.compile(r"^(?P<target>[^*]+?):(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
                   r"(?:\*(?P<weight>[-+0-9.eE]+))?$")


class RewardError(ValueError):
    """A reward function failed on a record or returned something that is not a number."""


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt: its token ids, its record (what the reward reads) and ``FILE:LINE``."""

    tokens: np.ndarray
    record: dict[str, Any]
    where: str


@dataclasses.dataclass(frozen=True)
class Reward:
    """One term of ``train.reward``: ``weight * fn(completion, record)``."""

    spec: str
    fn: RewardFn
    weight: float


def parse_reward_spec(spec: str) -> list[tuple[str, str, float]]:
    """``[(module or file, function, weight)]`` of ``train.reward`` (comma-separated
    ``TARGET:FUNCTION[*WEIGHT]``); ValueError names a bad term."""
    out = []
    for term in (t.strip() for t in spec.split(",")):
        m = _SPEC.match(term)
        weight = 1.0
        if m is not None and m["weight"] is not None:
            try:
                weight = float(m["weight"])
            except ValueError:
                m = None
        if m is None or not math.isfinite(weight):
            raise ValueError(f"train.reward: {term!r} is not MODULE:FUNCTION or "
                             "path/to/file.py:FUNCTION (optionally *WEIGHT)")
        out.append((m["target"], m["name"], weight))
    return out


def load_rewards(spec: str) -> list[Reward]:
    """Imports the reward functions of ``train.reward``; ValueError names a module or file
    that does not import, or a name that is not a callable in it."""
    rewards = []
    for target, name, weight in parse_reward_spec(spec):
        term = f"{target}:{name}"
        try:
            if target.endswith(".py"):
                path = Path(target).expanduser().resolve()
                if not path.is_file():
                    raise FileNotFoundError(f"no file {path}")
                module_name = f"_grpo_reward_{abs(hash(str(path)))}"
                module_spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(module_spec)
                sys.modules[module_name] = module
                module_spec.loader.exec_module(module)
            else:
                module = importlib.import_module(target)
        except Exception as e:  # noqa: BLE001 - any import failure is the user's reward's
            raise ValueError(f"train.reward: cannot import {target!r} ({term}): "
                             f"{type(e).__name__}: {e}") from e
        fn = getattr(module, name, None)
        if not callable(fn):
            raise ValueError(f"train.reward: {target!r} has no function {name!r} ({term})")
        rewards.append(Reward(term, fn, weight))
    return rewards


def score(rewards: Sequence[Reward], completion: str, prompt: PromptRecord) -> float:
    """The weighted sum of the rewards of one completion.

    Raises:
      RewardError: ``FILE:LINE: reward TERM ...`` when a function raises, returns anything
        but a finite real number (bools too), or beyond ``MAX_REWARD`` (weighted or summed).
    """
    tail = f"(completion {completion[:60]!r})"
    beyond = (f"beyond float32's range (|reward| <= {MAX_REWARD:.3g}: the update is float32) "
              f"{tail}")
    total = 0.0
    for reward in rewards:
        try:
            value = reward.fn(completion, prompt.record)
        except Exception as e:  # noqa: BLE001 - named with the record, then raised
            raise RewardError(f"{prompt.where}: reward {reward.spec} raised "
                              f"{type(e).__name__}: {e} {tail}") from e
        if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                or not math.isfinite(float(value))):
            raise RewardError(f"{prompt.where}: reward {reward.spec} returned {value!r} "
                              f"({type(value).__name__}), not a finite number {tail}")
        weighted = reward.weight * float(value)
        if not abs(weighted) <= MAX_REWARD:
            raise RewardError(f"{prompt.where}: reward {reward.spec} returned {value!r}"
                              f"{'' if reward.weight == 1 else f' (weighted {weighted:.3g})'}, "
                              f"{beyond}")
        total += weighted
    if not abs(total) <= MAX_REWARD:
        raise RewardError(f"{prompt.where}: the rewards {', '.join(r.spec for r in rewards)} "
                          f"sum to {total:.3g}, {beyond}")
    return total


def load_prompts(path: str | os.PathLike[str], tokenizer: Any, max_prompt_len: int
                 ) -> list[PromptRecord]:
    """The prompts of a JSONL file: ``messages`` (a chat, with the chat template's generation
    prompt) or ``prompt`` (text or chat messages); other fields stay in the record.

    Raises:
      InstructionDataError: ``FILE:LINE: ...`` for bad JSON, a record with neither field, or a
        prompt longer than ``max_prompt_len`` tokens; also for a file with no records.
    """
    prompts = []
    for line, record in read_jsonl(path):
        where = f"{path}:{line}"
        value = record.get("messages", record.get("prompt"))
        if value is None:
            raise InstructionDataError(f'{where}: a GRPO record needs "messages" (a chat) or '
                                       f'"prompt"; got keys {sorted(record)}')
        try:
            ids = (encode_text(tokenizer, value) if isinstance(value, str)
                   else encode_chat_prompt(tokenizer, _check_messages(value, where)))
        except InstructionDataError:
            raise
        except ValueError as e:
            raise InstructionDataError(f"{where}: {e}") from e
        if not ids:
            raise InstructionDataError(f"{where}: the prompt has no tokens")
        if len(ids) > max_prompt_len:
            raise InstructionDataError(
                f"{where}: the prompt has {len(ids)} tokens, more than the {max_prompt_len} "
                "that train.seq_len leaves beside train.grpo_max_tokens; raise train.seq_len")
        prompts.append(PromptRecord(np.asarray(ids, np.int32), record, where))
    if not prompts:
        raise InstructionDataError(f"{path}: no prompts")
    return prompts


def rollout_seeds(seed: int, step: int, rows: int) -> list[int]:
    """The engine seeds of the ``rows`` completions of ``step``, pure in (seed, step, row)."""
    return np.random.default_rng([seed, step, 0x6E90]).integers(0, 2**32, rows).tolist()


__all__ = ["MAX_REWARD", "PromptRecord", "Reward", "RewardError", "load_prompts", "load_rewards",
           "parse_reward_spec", "rollout_seeds", "score"]
