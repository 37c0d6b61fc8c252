"""The ``train.objective`` keys (SFT / DPO / ORPO) as a base of ``TrainConfig``, validated."""

from __future__ import annotations

import dataclasses
import math

from transformer_jax.train.preference import DPO_LOSSES

#: ``train.objective`` values: next-token cross-entropy, or a preference objective.
OBJECTIVES = ("sft", "dpo", "orpo")


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """What a run optimises (``TrainConfig``'s base; see ``transformer_jax.train.preference``).

    Attributes:
      objective: ``sft`` (next-token cross-entropy, the default), ``dpo`` or ``orpo`` (both on
        a .jsonl of ``{"prompt", "chosen", "rejected"}`` pairs). DPO's reference is the
        initial weights' log-probs, computed in a first pass and stored in the run directory
        (full fine-tuning), or the frozen base with the adapters off (LoRA).
      dpo_beta: DPO's beta (IPO: its tau).
      dpo_loss: ``sigmoid`` (DPO) or ``ipo``.
      dpo_label_smoothing: conservative DPO's eps in [0, 0.5) (sigmoid only).
      orpo_lambda: weight of ORPO's odds-ratio term (TRL's ORPO beta).
    """

    objective: str = "sft"
    dpo_beta: float = 0.1
    dpo_loss: str = "sigmoid"
    dpo_label_smoothing: float = 0.0
    orpo_lambda: float = 0.1

    def check_objective(self) -> None:
        """Raises ValueError naming a bad objective key."""
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.dpo_loss not in DPO_LOSSES:
            raise ValueError(f"dpo_loss must be one of {DPO_LOSSES}, got {self.dpo_loss!r}")
        for name in ("dpo_beta", "orpo_lambda"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        eps = self.dpo_label_smoothing
        if not (isinstance(eps, int | float) and 0 <= eps < 0.5):
            raise ValueError(f"dpo_label_smoothing must be in [0, 0.5), got {eps!r}")
        if self.is_preference and getattr(self, "loss_chunk", 0):
            raise ValueError(f"loss_chunk applies to objective=sft only (objective="
                             f"{self.objective} reads the full logits); set loss_chunk=0")
        if eps and self.dpo_loss != "sigmoid":
            raise ValueError(f"dpo_label_smoothing={eps} applies to dpo_loss=sigmoid only")

    @property
    def is_preference(self) -> bool:
        """Whether the objective trains on preference pairs (``dpo``, ``orpo``)."""
        return self.objective != "sft"


__all__ = ["OBJECTIVES", "ObjectiveConfig"]
