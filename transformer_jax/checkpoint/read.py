"""Reading one checkpoint step directory into arrays, its saved tree checked first.

``read_state`` and ``read_params`` compare the saved shapes (``saved_tree``) with the tree asked
for, naming what differs (``CheckpointMismatchError``) before orbax reads anything, then read
the state or only its params. Which step to read is ``CheckpointManager``'s business.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from transformer_jax.checkpoint.files import (
    META_ITEM,
    STATE_ITEM,
    CheckpointError,
    DamagedCheckpointError,
    check_step_files,
    read_meta_file,
)


class CheckpointMismatchError(CheckpointError, ValueError):
    """The saved state has another structure or other shapes than the one asked for.

    Attributes:
      path: the step directory.
      differences: one line per differing entry (path: saved vs requested).
    """

    def __init__(self, path: Path, differences: list[str]) -> None:
        shown = "; ".join(differences[:8])
        more = f"; and {len(differences) - 8} more" if len(differences) > 8 else ""
        super().__init__(f"checkpoint {path} holds another state than requested: {shown}{more}")
        self.path, self.differences = path, differences


class StepVanished(Exception):
    """The step directory disappeared while it was being read (a live run rotated it away)."""


def read_state(path: Path, abstract_state: Any | None) -> tuple[Any, dict[str, Any]]:
    """The train state and meta of the step directory ``path``, shaped, typed and placed like
    ``abstract_state`` (None: the saved tree as it is, on the first device).

    Raises:
      StepVanished: the directory is gone (a live run rotated it away).
      DamagedCheckpointError: a file is missing, unreadable or differs from its checksum.
      CheckpointMismatchError: the saved tree differs from ``abstract_state``.
    """
    saved = saved_tree(path)
    if abstract_state is None:
        abstract_state = abstract_from_metadata(saved)
    else:
        check_same_tree(path, saved, abstract_state)
    abstract_state = jax.tree.map(as_abstract, abstract_state)
    args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract_state),
                                 META_ITEM: ocp.args.JsonRestore()})
    try:
        # Its own checkpointer: the manager re-lists every step (and fails if one vanishes).
        handler = ocp.CompositeCheckpointHandler(**{
            STATE_ITEM: ocp.StandardCheckpointHandler(),
            META_ITEM: ocp.JsonCheckpointHandler()})
        with ocp.Checkpointer(handler) as reader:
            restored = reader.restore(path, args=args)
    except Exception as e:
        if not path.is_dir():
            raise StepVanished(path) from e
        raise DamagedCheckpointError(path, reason(e)) from None
    return restored[STATE_ITEM], dict(restored[META_ITEM] or {})


def read_params(path: Path, abstract_params: Any | None) -> tuple[Any, dict[str, Any]]:
    """Only the ``params`` of the state saved in ``path`` (a partial restore), and the meta;
    raises as ``read_state``."""
    saved = saved_tree(path)
    if not isinstance(saved, dict) or "params" not in saved:
        raise CheckpointMismatchError(path, ["the saved state has no 'params' entry"])
    if abstract_params is None:
        abstract_params = abstract_from_metadata(saved["params"])
    else:
        check_same_tree(path, saved["params"], abstract_params, prefix=("params",))
    item = {"params": jax.tree.map(as_abstract, abstract_params)}
    args = ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True)
    try:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
            restored = reader.restore(path / STATE_ITEM, args=args)
        meta = read_meta_file(path)
    except DamagedCheckpointError:
        raise
    except Exception as e:
        if not path.is_dir():
            raise StepVanished(path) from e
        raise DamagedCheckpointError(path, reason(e)) from None
    return restored["params"], meta


def saved_tree(path: Path) -> Any:
    """Checks the files of the step directory ``path`` and returns the saved state's metadata
    tree (shapes and dtypes, no array read); raises as ``read_state``."""
    try:
        check_step_files(path)
        try:
            saved = ocp.StandardCheckpointHandler().metadata(path / STATE_ITEM)
            return getattr(saved, "tree", saved)  # orbax wraps the tree in TreeMetadata
        except Exception as e:
            raise DamagedCheckpointError(path, f"unreadable metadata: {reason(e)}") from None
    except (DamagedCheckpointError, FileNotFoundError) as e:
        if not path.is_dir():
            raise StepVanished(path) from e
        if isinstance(e, FileNotFoundError):
            raise DamagedCheckpointError(path, reason(e)) from None
        raise


def error_chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def reason(error: BaseException, limit: int = 200) -> str:
    """One line about an error: its innermost cause's first line, shortened."""
    lines = [line for e in error_chain(error) for line in str(e).splitlines()[:1] if line.strip()]
    # Orbax wraps TensorStore errors in a dump of the whole spec: the innermost cause says more.
    text = lines[-1] if lines else type(error).__name__
    if "TensorStore" in text and len(lines) > 1:
        text = lines[0]
    text = text.split(" See full TensorStore details")[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def leaf_paths(tree: Any, is_leaf: Any = None) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{path as strings: shape} of a tree's array leaves (dataclass fields, dict keys and
    sequence indices all become strings, so a saved dict matches the live dataclass)."""
    return {tuple(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path):
            tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
            if hasattr(leaf, "shape")}


def is_array_metadata(m: Any) -> bool:
    return hasattr(m, "shape") and hasattr(m, "dtype")


def check_same_tree(path: Path, saved: Any, abstract: Any, prefix: tuple[str, ...] = ()
                     ) -> None:
    """Raises CheckpointMismatchError naming the entries that differ in presence or shape."""
    have = leaf_paths(saved, is_leaf=is_array_metadata)
    want = leaf_paths(abstract)
    diffs = []
    # The params first: they name a model change most directly.
    for key in sorted(set(have) | set(want), key=lambda k: (k[:1] != ("params",), k)):
        name = "/".join(prefix + key)
        if key not in have:
            diffs.append(f"{name} is not in the checkpoint")
        elif key not in want:
            diffs.append(f"{name} {list(have[key])} is saved but not requested")
        elif have[key] != want[key]:
            diffs.append(f"{name} is {list(have[key])} in the checkpoint, {list(want[key])} "
                         "requested")
    if diffs:
        raise CheckpointMismatchError(path, diffs)


def abstract_from_metadata(metadata: Any) -> Any:
    # Whatever devices it was saved from, read it onto this process's first device.
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), metadata,
                        is_leaf=is_array_metadata)


def as_abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
        # Orbax needs a sharding: this process's first device (not jax.devices()[0]).
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(
            jax.local_devices()[0]))
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
    """[L] bool: whether each leaf is finite, in one program (leaf by leaf, a mesh's
    collectives could fill XLA:CPU's queue of programs in flight: a deadlock)."""
    return jnp.stack([jnp.isfinite(x).all() for x in leaves])


def check_finite(params: Any, where: Any, limit: int = 3) -> None:
    """Raises ValueError naming the floating-point params that hold NaN or inf (a corrupt file
    or a diverged run); integer leaves (packed quantised weights) are not checked."""
    leaves = [(path, x) for path, x in jax.tree_util.tree_leaves_with_path(params)
              if jnp.issubdtype(getattr(x, "dtype", np.int8), jnp.floating)]
    flags = jax.device_get(_all_finite([x for _, x in leaves])) if leaves else []
    bad = [jax.tree_util.keystr(path, simple=True, separator="/")
           for (path, _), ok in zip(leaves, flags, strict=True) if not ok]
    if bad:
        more = f" and {len(bad) - limit} more" if len(bad) > limit else ""
        raise ValueError(f"{where}: the weights hold NaN or inf ({', '.join(bad[:limit])}{more}):"
                         " the checkpoint is corrupt or its training diverged; refusing to "
                         "load it")
