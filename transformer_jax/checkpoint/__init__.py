"""Checkpoints: orbax saves with exact resume (``manager``, ``read``, ``files``, ``quiet``), and
every way a model is read back from a run, a step or a HF directory (``loading``).
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
