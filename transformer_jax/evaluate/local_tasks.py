"""lm-eval tasks over local JSONL files (offline): the YAML the harness reads with
``--include-path DIR``. ``dataset_path: json`` makes the harness load the data with the
``datasets`` library's JSON builder, which needs no network.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

_DATA = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
"""


def write_jsonl(path: Path, records: Iterable[Mapping[str, Any]]) -> Path:
    """One JSON object per line."""
    path.write_text("".join(json.dumps(dict(r)) + "\n" for r in records))
    return path


def _write_task(directory: Path, name: str, records: Iterable[Mapping[str, Any]],
                body: str) -> Path:
    """``name.yaml`` over ``name.jsonl`` (the records) in ``directory``, then ``body``."""
    data = write_jsonl(directory / f"{name}.jsonl", records)
    yaml = directory / f"{name}.yaml"
    yaml.write_text(f"task: {name}\n" + _DATA.format(path=data.resolve()) + body)
    return yaml


def write_multiple_choice_task(directory: Path, name: str,
                               records: Iterable[Mapping[str, Any]]) -> Path:
    """Task ``name`` (records ``{"question", "choices": [...], "answer": index}``; each choice
    scored after ``"{question} "``; metric ``acc``): returns its YAML (data in ``name.jsonl``)."""
    return _write_task(directory, name, records,
                       "output_type: multiple_choice\n"
                       "doc_to_text: \"{{question}}\"\n"
                       "doc_to_choice: \"{{choices}}\"\n"
                       "doc_to_target: \"{{answer}}\"\n"
                       "target_delimiter: \" \"\n"
                       "metric_list:\n"
                       "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")


def write_rolling_task(directory: Path, name: str, texts: Iterable[str]) -> Path:
    """Task ``name``: the rolling log-likelihood of each text (word and byte perplexity, bits per
    byte); returns its YAML (data in ``name.jsonl``)."""
    metrics = "".join(f"  - metric: {m}\n    aggregation: {a}\n    higher_is_better: false\n"
                      for m, a in (("word_perplexity", "weighted_perplexity"),
                                   ("byte_perplexity", "weighted_perplexity"),
                                   ("bits_per_byte", "bits_per_byte")))
    return _write_task(directory, name, ({"text": t} for t in texts),
                       "output_type: loglikelihood_rolling\n"
                       "doc_to_text: \"\"\n"
                       "doc_to_target: \"{{text}}\"\n"
                       "metric_list:\n" + metrics)


__all__ = ["write_jsonl", "write_multiple_choice_task", "write_rolling_task"]
