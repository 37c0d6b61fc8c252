"""The ``train.objective`` keys (SFT, DPO, ORPO, GRPO): ``TrainConfig``'s base."""

from __future__ import annotations

import dataclasses
import math

from transformer_jax.model.fields import check_nonnegative_int

#: ``train.objective`` values: next-token cross-entropy, or a preference objective.
OBJECTIVES = ("sft", "dpo", "orpo", "grpo")
#: The objectives that train on preference pairs.
PREFERENCE_OBJECTIVES = ("dpo", "orpo")
#: ``train.dpo_loss`` values.
DPO_LOSSES = ("sigmoid", "ipo")
#: ``train.grpo_loss`` values (how the per-token losses are averaged).
GRPO_LOSSES = ("token", "sequence", "dr_grpo")


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """What a run optimises (``TrainConfig``'s base; see ``transformer_jax.train.preference``).

    Attributes:
      objective: ``sft`` (next-token cross-entropy), ``dpo`` or ``orpo`` (on a .jsonl of
        ``{"prompt", "chosen", "rejected"}`` pairs), or ``grpo`` (RL on a .jsonl of prompts).
      dpo_beta: DPO's beta (IPO: its tau).
      dpo_loss: ``sigmoid`` (DPO) or ``ipo``.
      dpo_label_smoothing: conservative DPO's eps in [0, 0.5) (sigmoid only).
      orpo_lambda: weight of ORPO's odds-ratio term (TRL's ORPO beta).
      pairs_per_step: DPO/ORPO: N > 0 trains every step on exactly N pairs (TRL's batch;
        ``batch_size`` is then derived); 0: ``batch_size`` counts packed rows of pairs.
      reward: GRPO's reward functions ``fn(completion, record) -> float``, ``MODULE:FUNCTION``
        or ``path/file.py:FUNCTION``, comma-separated, summed, optionally weighted (``m:f*0.5``).
      grpo_group_size: G, completions per prompt (``batch_size`` counts completions).
      grpo_max_tokens: the most tokens of a completion (``seq_len`` holds the prompt and these).
      grpo_temperature: the rollouts' sampling temperature; the log-probs of the ratio and the
        KL are the model's at temperature 1, as the engine reports them (unlike TRL's).
      grpo_clip_eps: eps of the clipped ratio ``clip(ratio, 1 - eps, 1 + eps)``.
      grpo_kl_beta: weight of the k3 KL penalty to the reference (the initial weights, or the
        LoRA base with the adapters off); 0 skips the reference.
      grpo_loss: ``token`` (DAPO: mean over the completion tokens), ``sequence`` (GRPO: mean
        per completion) or ``dr_grpo`` (sum over ``batch_size * grpo_max_tokens``).
      grpo_scale_rewards: divide the group-centred rewards by the group's std (Dr. GRPO: false).
      mtp_weight: lambda of the multi-token prediction loss (``mtp_depth`` D > 0; full sft):
        ``lambda / D * sum_k CE_k`` added, logged as ``mtp_loss``; 0: not trained (nor run).
    """

    objective: str = "sft"
    dpo_beta: float = 0.1
    dpo_loss: str = "sigmoid"
    dpo_label_smoothing: float = 0.0
    orpo_lambda: float = 0.1
    pairs_per_step: int = 0
    reward: str = ""
    grpo_group_size: int = 8
    grpo_max_tokens: int = 64
    grpo_temperature: float = 1.0
    grpo_clip_eps: float = 0.2
    grpo_kl_beta: float = 0.04
    grpo_loss: str = "token"
    grpo_scale_rewards: bool = True
    mtp_weight: float = 0.0

    def check_objective(self) -> None:
        """Raises ValueError naming a bad objective key."""
        for name, choices in (("objective", OBJECTIVES), ("dpo_loss", DPO_LOSSES),
                              ("grpo_loss", GRPO_LOSSES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in ("dpo_beta", "orpo_lambda", "grpo_temperature", "grpo_clip_eps",
                     "grpo_kl_beta", "mtp_weight"):
            value, zero = getattr(self, name), name in ("grpo_kl_beta", "mtp_weight")
            if not (isinstance(value, int | float) and not isinstance(value, bool)
                    and math.isfinite(value) and (value > 0 or zero and value == 0)):
                raise ValueError(f"{name} must be a number {'>= 0' if zero else '> 0'}, got "
                                 f"{value!r}")
        eps = self.dpo_label_smoothing
        if not (isinstance(eps, int | float) and 0 <= eps < 0.5):
            raise ValueError(f"dpo_label_smoothing must be in [0, 0.5), got {eps!r}")
        pairs = self.pairs_per_step
        check_nonnegative_int("pairs_per_step", pairs)
        if pairs and self.objective not in PREFERENCE_OBJECTIVES:
            raise ValueError(f"pairs_per_step={pairs} applies to objective=dpo or orpo (it "
                             f"counts preference pairs), not objective={self.objective}")
        self._check_grpo()
        if self.objective != "sft" and getattr(self, "loss_chunk", 0):
            raise ValueError(f"loss_chunk applies to objective=sft only (objective="
                             f"{self.objective} reads the full logits); set loss_chunk=0")
        if getattr(self, "moe_bias_update_rate", 0) and (
                self.objective != "sft" or getattr(self, "lora_rank", 0)):
            raise ValueError("moe_bias_update_rate updates the model's correction biases in "
                             "full sft training only; set it to 0 with LoRA or another objective")
        if self.mtp_weight and (self.objective != "sft" or getattr(self, "lora_rank", 0)):
            raise ValueError("mtp_weight trains the multi-token prediction modules in full sft "
                             "training only; set it to 0 with LoRA or another objective")
        if eps and self.dpo_loss != "sigmoid":
            raise ValueError(f"dpo_label_smoothing={eps} applies to dpo_loss=sigmoid only")

    def _check_grpo(self) -> None:
        """Raises ValueError naming a bad ``grpo_*`` or ``reward`` key."""
        grpo = self.objective == "grpo"
        for name, least in (("grpo_group_size", 2 if grpo else 1), ("grpo_max_tokens", 1)):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
                why = "; advantages compare a prompt's completions" if least == 2 else ""
                raise ValueError(f"{name} must be >= {least} (an int{why}), got {value!r}")
        if not isinstance(self.grpo_scale_rewards, bool):
            raise ValueError(f"grpo_scale_rewards must be true or false, got "
                             f"{self.grpo_scale_rewards!r}")
        if not isinstance(self.reward, str):
            raise ValueError(f"reward must be a string, got {self.reward!r}")
        if self.reward:
            from transformer_jax.train.grpo_data import parse_reward_spec

            parse_reward_spec(self.reward)  # syntax only; imported when the run starts
        if self.objective != "grpo":
            return
        if not self.reward:
            raise ValueError("train.objective=grpo needs train.reward=MODULE:FUNCTION or "
                             "path/to/file.py:FUNCTION (fn(completion, record) -> float)")
        seq_len = getattr(self, "seq_len", None)
        if seq_len is not None and self.grpo_max_tokens >= seq_len:
            raise ValueError(f"grpo_max_tokens ({self.grpo_max_tokens}) must be below seq_len "
                             f"({seq_len}): a row holds the prompt and the completion, so "
                             "this leaves no room for a prompt; raise train.seq_len or lower "
                             "train.grpo_max_tokens")
        batch = getattr(self, "batch_size", self.grpo_group_size)
        if batch % self.grpo_group_size:
            raise ValueError(f"batch_size ({batch}) counts completions and must be a multiple "
                             f"of grpo_group_size ({self.grpo_group_size})")


__all__ = ["DPO_LOSSES", "GRPO_LOSSES", "OBJECTIVES", "PREFERENCE_OBJECTIVES", "ObjectiveConfig"]
