"""Import paths of modules that moved into packages, kept working for code written before.

``import transformer_jax.train_config`` still works: the finder below answers an old name with
the module at its new path (the same module object) and warns once with a
``DeprecationWarning`` that names the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from typing import Any

PACKAGE = "transformer_jax"

# old name (under transformer_jax.) -> new name; a package's submodules follow it.
MOVED = {
    **{name: f"{package}.{name}" for package, names in {
        "storage": ("files",),
        "model": ("config", "layers", "kv_cache", "ops", "quant", "lora"),
        "data": ("corpus", "instruct", "instruct_records", "eval_sets"),
        "parallel": ("mesh", "sharding", "distributed"),
        "checkpoint": ("loading",),
        "train": ("config_docs", "optim", "loss", "resume", "init_from", "perf"),
        "decode": ("sampling", "streaming", "prompts", "generation", "export"),
    }.items() for name in names},
    # renamed as they moved
    "hf_convert": "hf.convert", "hf_export": "cli.export", "decode_weights": "decode.weights",
    "checkpoint_read": "checkpoint.read", "checkpoint_files": "checkpoint.files",
    "checkpoint_quiet": "checkpoint.quiet",
    "training": "train.run", "train_step": "train.step", "train_config": "train.config",
    "quant_train": "train.quant", "run_data": "train.data", "run_eval": "train.validation",
    "run_log": "train.log", "run_memory": "train.memory", "run_setup": "train.checks",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return importlib.import_module(self.target)

    def exec_module(self, module: Any) -> None:
        pass  # the module at the new path is already executed


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of moved modules (first on ``sys.meta_path``)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        head, _, rest = fullname.partition(".")  # transformer_jax.OLD[.sub]
        old, _, sub = rest.partition(".")
        if head != PACKAGE or old not in MOVED:
            return None
        new = f"{PACKAGE}.{MOVED[old]}" + (f".{sub}" if sub else "")
        warnings.warn(f"{fullname} moved to {new}; the old path will go in a later release",
                      DeprecationWarning, stacklevel=2)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
