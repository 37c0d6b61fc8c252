"""Argument types for the benchmarks' (and ``evaluate``'s) command lines: each ``type=``
function checks its value when the arguments are parsed, before any model is built, and returns
it or raises ``argparse.ArgumentTypeError`` with one line saying which values it accepts; and
what the benchmarks share besides (``parser``, ``check_runs``, ``timed``, ``write_json``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

#: Seconds ``server_url`` waits for a connection.
CONNECT_TIMEOUT_S = 3.0


_fail = argparse.ArgumentTypeError


def int_at_least(minimum: int) -> Callable[[str], int]:
    """A type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise _fail(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise _fail(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


#: Integers >= 1 and >= 0.
positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def int_list(minimum: int) -> Callable[[str], list[int]]:
    """A type: comma-separated integers, each >= ``minimum`` (at least one)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(p) for p in text.split(",") if p.strip()]
        except ValueError:
            values = []
        if not values or min(values) < minimum:
            raise _fail(f"must be comma-separated integers >= {minimum}, got {text!r}")
        return values

    return parse


def int_range(text: str) -> tuple[int, int]:
    """A type: ``MIN,MAX`` with 1 <= MIN <= MAX."""
    parts = text.split(",")
    try:
        lo, hi = (int(p) for p in parts)
    except ValueError:
        raise _fail(f"must be MIN,MAX (integers, 1 <= MIN <= MAX), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise _fail(f"must be MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def positive_float(*, allow_inf: bool = False) -> Callable[[str], float]:
    """A type: a number > 0, finite unless ``allow_inf`` (then ``inf`` is accepted too)."""
    what = "a number > 0 (or inf)" if allow_inf else "a finite number > 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise _fail(f"must be {what}, got {text!r}") from None
        if not value > 0 or (math.isinf(value) and not allow_inf):
            raise _fail(f"must be {what}, got {text!r}")
        return value

    return parse


def megabytes(text: str) -> float:
    """A type: a finite number of MB > 0 whose bytes are finite too."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value * 2**20)):
        raise _fail(f"must be a finite number of MB > 0, got {text!r}")
    return value


def model_config(text: str) -> str:
    """A type: a preset name or TOML path whose ``[model]`` table is a valid ``ModelConfig``."""
    from transformer_jax.model.config import ModelConfig, load_toml

    try:
        table = load_toml(text).get("model")
        if not table:
            raise ValueError(f"{text!r} has no [model] table (a fine-tuning preset takes its "
                             "model from a checkpoint); give a preset such as decode_25m or a "
                             "TOML file with one")
        ModelConfig.from_dict(table)
    except (OSError, ValueError, TypeError) as e:  # tomllib.TOMLDecodeError is a ValueError
        raise _fail(" ".join(str(e).split())) from None
    return text


def quant_scheme(text: str) -> str:
    """A type: a weight quantisation scheme ``decode.prepare`` takes (``int8``, ``int4:G``, ...)."""
    from transformer_jax.model import quant

    try:
        quant.parse_quant(text)
    except (ValueError, TypeError) as e:
        raise _fail(" ".join(str(e).split())) from None
    return text


def quant_schemes(text: str) -> list[str]:
    """A type: comma-separated ``quant_scheme``s (at least one)."""
    schemes = [s.strip() for s in text.split(",") if s.strip()]
    if not schemes:
        raise _fail(f"must name at least one scheme such as int8,int4, got {text!r}")
    return [quant_scheme(s) for s in schemes]


def _existing(directory: bool) -> Callable[[str], str]:
    """A type: an existing directory (``directory``) or file."""
    kind, other = ("directory", "file") if directory else ("file", "directory")

    def parse(text: str) -> str:
        path = Path(text).expanduser()
        if not path.exists():
            raise _fail(f"{text}: no such {kind}")
        if path.is_dir() != directory:
            raise _fail(f"{text} is a {other}, not a {kind}")
        return text

    return parse


#: Types: an existing directory, an existing file.
existing_dir, existing_file = _existing(True), _existing(False)


def existing_path(text: str) -> str:
    """A type: a file or directory that exists."""
    if not Path(text).expanduser().exists():
        raise _fail(f"{text}: no such file or directory")
    return text


def checkpoint(text: str) -> str:
    """A type: a checkpoint ``loading.locate`` recognises (its files are read, no weights)."""
    from transformer_jax.checkpoint import loading

    try:
        loading.locate(text)
    except (OSError, ValueError) as e:  # FileNotFoundError, CheckpointError, a bad config
        raise _fail(" ".join(str(e).split())) from None
    return text


def check_output_file(path: str | Path) -> None:
    """Raises ValueError unless ``path`` can be written as a file: not a directory, under a
    directory (or one that can be made) this process may write to, and if it exists, writable.
    Writes nothing there (a probe file in the nearest existing directory is removed at once)."""
    target = Path(path).expanduser().absolute()
    if target.is_dir():
        raise ValueError(f"{path} is a directory; give a file name")
    if target.exists():
        try:
            with open(target, "ab"):  # opened for appending, nothing written: unchanged
                pass
        except OSError as e:
            raise ValueError(f"{path} cannot be written: {e.strerror}") from None
        return
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{path}: {ancestor} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=ancestor, prefix=".write-check-")
    except OSError as e:
        raise ValueError(f"{path} cannot be written: {ancestor}: {e.strerror}") from None
    os.close(fd)
    os.unlink(probe)


def output_file(text: str) -> str:
    """A type: a file ``check_output_file`` accepts."""
    try:
        check_output_file(text)
    except ValueError as e:
        raise _fail(str(e)) from None
    return text


def server_url(text: str) -> str:
    """A type: an ``http(s)://HOST[:PORT]`` URL where something accepts TCP connections."""
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise _fail(f"must be a URL such as http://127.0.0.1:8000, got {text!r}")
    port = port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        reason = e.strerror or str(e) or type(e).__name__
        raise _fail(f"{text}: no server accepts connections at {parts.hostname}:{port} "
                    f"({reason}); start one with `transformer-jax serve`") from None
    return text


def check_runs(*runs: tuple[str, list[str]]) -> None:
    """``build_configs`` of each ``(preset, overrides)`` run the benchmark will start, without
    ``train.init_from`` (written later), so that a setting they refuse is one error before any work.

    Raises:
      ConfigError: naming the setting.
    """
    from transformer_jax.train.config import build_configs

    for preset, overrides in runs:
        build_configs(preset, [o for o in overrides if not o.startswith("train.init_from=")])


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``fn()``'s wall-clock seconds and its result."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def parser(kind: str, doc: str, **kwargs: Any) -> argparse.ArgumentParser:
    """The parser of ``transformer-jax bench KIND``, described by ``doc``'s first paragraph."""
    return argparse.ArgumentParser(prog=f"transformer-jax bench {kind}",
                                   description=doc.split("\n\n")[0], **kwargs)


def default_output(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str) -> None:
    """Fills in ``args.out`` with ``name`` when not given, or exits if it cannot be written."""
    if args.out is None:
        args.out = name
        try:
            check_output_file(name)
        except ValueError as e:
            parser.error(f"--out: {e}")


def write_json(path: str | None, result: Any, indent: int = 1) -> None:
    """Writes ``result`` as JSON to the file ``path``; nothing when ``path`` is None."""
    if path:
        Path(path).write_text(json.dumps(result, indent=indent))
