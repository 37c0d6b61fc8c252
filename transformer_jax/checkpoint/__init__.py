"""Checkpoints: orbax saves with exact resume, and every way a model is read back.

``manager`` (``CheckpointManager``: periodic and async saves, rotation, resume), ``read`` (one
step directory read into arrays, its saved tree checked first), ``files`` (a step directory on
disk: checksums, damage checks, setting aside), ``quiet`` (orbax's background echoes of a failed
save kept off stderr) and ``loading`` (a model from a run directory, a step or a HF directory:
``locate``, ``load``, ``open_tokenizer``).
"""

from transformer_jax.checkpoint.files import (
    CHECKSUMS_FILE,
    CheckpointError,
    DamagedCheckpointError,
    ensure_writable_dir,
    verify_checksums,
)
from transformer_jax.checkpoint.manager import CheckpointManager
from transformer_jax.checkpoint.read import CheckpointMismatchError

__all__ = ["CHECKSUMS_FILE", "CheckpointError", "CheckpointManager", "CheckpointMismatchError",
           "DamagedCheckpointError", "ensure_writable_dir", "verify_checksums"]
