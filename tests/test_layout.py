"""The package layout: each package imports only the packages before it in the flow, no module
imports itself back through others, no module outgrows one sitting, and the import paths of
the modules that moved still give the same module objects."""

from __future__ import annotations

import ast
import functools
import importlib
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "transformer_jax"

# The flow, lowest first: a package may import only those before it (and itself).
LAYERS = ["storage", "model", "tokenizer", "data", "parallel", "decode", "hf", "checkpoint",
          "serving", "train", "serve", "evaluate", "bench", "cli"]
# Entry points above every package: ``python -m`` aliases and the package's own front door.
ENTRY_MODULES = {"transformer_jax", "transformer_jax.generate", "transformer_jax.plot",
                 "transformer_jax._moved"}
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The project's modules a file imports, anywhere in it (function bodies included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] != "transformer_jax":
                continue
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            out.add(name)
    return out


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


@functools.cache
def graph() -> dict[str, set[str]]:
    """Each module -> the project's modules it imports. Parsed on first use, not at import
    (every pytest-xdist worker imports every test module). A module importing its own
    package's ``__init__`` (``from transformer_jax.serving import x``) is no circle: the
    package is initialised before its modules."""
    return {name: {t for t in imported_modules(path, set(MODULES))
                   if not name.startswith(t + ".")} - {name}
            for name, path in MODULES.items()}


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_is_in_a_layer_or_an_entry_point():
    stray = sorted(m for m in MODULES if layer(m) is None and m not in ENTRY_MODULES)
    assert not stray, f"modules outside the layers {LAYERS}: {stray}"


def test_no_package_imports_one_after_it():
    wrong = []
    for module, targets in graph().items():
        own = layer(module)
        if own is None or module.endswith(".__main__"):  # aliases of the cli: entry points
            continue
        for target in targets:
            other = layer(target)
            if other is not None and LAYERS.index(other) > LAYERS.index(own):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the flow:\n" + "\n".join(sorted(wrong))


def test_no_import_circles():
    """Tarjan's strongly connected components of the module graph: all of size one."""
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph().get(v, ()):
            if w not in MODULES or w == "transformer_jax":
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_modules_are_short():
    long = {m: n for m, p in MODULES.items()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


# Old path -> where it moved, and a name it defines (stated here, not read from _moved.MOVED).
MOVED = [("loading", "checkpoint.loading", "locate"),
         ("train_config", "train.config", "TrainConfig"), ("training", "train.run", "run"),
         ("config", "model.config", "ModelConfig"),
         ("sharding", "parallel.sharding", "param_shardings"),
         ("ops.attention", "model.ops.attention", "attention"),
         ("checkpoint_files", "checkpoint.files", "CheckpointError"),
         ("run_log", "train.log", "RunLog"), ("hf_export", "cli.export", "export")]


@pytest.mark.parametrize(("old", "new", "name"), MOVED, ids=[m[0] for m in MOVED])
def test_moved_modules_keep_their_old_import_path(old, new, name):
    new = f"transformer_jax.{new}"
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(f"transformer_jax.{old}")
    assert module is importlib.import_module(new) and hasattr(module, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module(f"transformer_jax.{old}") is module  # cached, silent


def test_the_names_users_import_stay():
    import transformer_jax
    from transformer_jax import decode, serving
    from transformer_jax.model import Transformer

    assert transformer_jax.Transformer is Transformer
    assert callable(transformer_jax.generate) and callable(decode.prepare)
    assert serving.Engine.__module__ == "transformer_jax.serving.engine"
    assert transformer_jax.ModelConfig.__module__ == "transformer_jax.model.config"


# A CPU layout lives in the prepared weights (``ops.layouts.OutFirst``) and the cache
# (``SlotsLast``), chosen for the target platform by ``decode.prepare`` and the caches'
# constructors: no function or module of the model takes one as an argument or a field.
LAYOUT_NAME = re.compile(r"(out|in)_first|transposed|slots_last|head_layout|keys_layout")


def layout_parameters(root: Path) -> list[str]:
    """``file:line name`` of every function parameter and class field under ``root`` whose
    name says it is a layout."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs,
                                         *filter(None, (a.vararg, a.kwarg)))]
            elif isinstance(node, ast.ClassDef):  # dataclass and flax module fields
                names = [s.target.id for s in node.body
                         if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
            found += [f"{path.relative_to(root.parent)}:{node.lineno} {n}" for n in names
                      if LAYOUT_NAME.search(n)]
    return found


def test_no_model_function_or_module_takes_a_layout():
    assert layout_parameters(ROOT / "model") == []
