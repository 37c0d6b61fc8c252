"""What the training loop (``run._train``) and the objectives share: ``RunContext`` and
``Objective`` (SFT, and the base of DPO, ORPO and GRPO)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from transformer_jax.model.config import ModelConfig
from transformer_jax.parallel import distributed
from transformer_jax.parallel import sharding as sharding_lib
from transformer_jax.tokenizer import TextTokenizer
from transformer_jax.train.checks import RunDirectory
from transformer_jax.train.config import DataConfig, TrainConfig
from transformer_jax.train.data import RunData, prepare_instruction_data
from transformer_jax.train.step import Batch, TrainState, make_train_step


@dataclasses.dataclass
class RunContext:
    """What the loop and the objective share of a run, once its data and state are ready."""

    model_config: ModelConfig  # with the tokenizer's vocab_size
    tc: TrainConfig
    data_config: DataConfig
    files: RunDirectory
    mesh: Any
    batch_sharding: Any
    state_shardings: Any
    tokenizer: TextTokenizer
    data: RunData  # an objective's start may replace it (DPO: with its reference)
    configs: dict[str, Any]  # what config.json and each checkpoint's meta record
    main_process: bool  # the process that writes the run directory
    initial_state: Callable[[], TrainState]  # step 0's state made again (GRPO's reference)


class Objective:
    """SFT (next-token cross-entropy), and the interface the loop drives every objective through:
    its data, own state (``start``), batches, step and updates; the loop does the rest alike."""

    #: The ``.jsonl`` records the objective trains on (``data.path``); empty: any data.
    records = ""
    #: Whether a step's batch is made from the state of the update before (GRPO's rollouts).
    on_policy = False
    #: Whether every batch has the same shapes (the step is compiled ahead, once); else jitted.
    fixed_shapes = True

    def __init__(self, train_config: TrainConfig) -> None:
        self.tc = train_config

    def check_data(self, data_config: DataConfig) -> None:
        """Raises ValueError (one line) for data the objective cannot train on."""
        if self.records and not data_config.is_instruct:
            raise ValueError(f"train.objective={self.tc.objective} needs data.path=FILE.jsonl "
                             f"of {self.records} records, got data.path={data_config.path!r}")

    def load_data(self, data_config: DataConfig, tokenizer: TextTokenizer) -> RunData:
        """The run's data from the ``.jsonl`` files of ``data.path`` (text, shards: alike)."""
        return prepare_instruction_data(data_config, tokenizer, self.tc.seq_len)

    def settle(self, data: RunData, num_batch_devices: int) -> tuple[RunData, TrainConfig]:
        """The data and train config once the data is read (DPO/ORPO: ``pairs_per_step``)."""
        return data, self.tc

    def start(self, run: RunContext, state: TrainState) -> None:
        """Sets up what the objective needs besides the train state, before the first batch."""
        self.run = run

    def step_fn(self, model_config: ModelConfig, data: RunData
                ) -> Callable[[TrainState, Batch], tuple[TrainState, Batch]]:
        """The pure ``train_step(state, batch) -> (state, metrics)`` with the objective's loss."""
        return make_train_step(model_config, self.tc)

    def compile(self, state: TrainState, batch: Batch) -> None:
        """Compiles the step (ahead of time with ``fixed_shapes``) or loads ``compiled_step``."""
        run = self.run
        if self.tc.compiled_step:
            from transformer_jax.train import executable

            self.train_step = executable.load(self.tc.compiled_step, run.model_config, self.tc,
                                              run.mesh, state, batch)
            return
        step = sharding_lib.jit_train_step(self.step_fn(run.model_config, run.data),
                                           run.state_shardings, run.batch_sharding)
        self.train_step = step.lower(state, batch).compile() if self.fixed_shapes else step

    def batch(self, step: int, state: TrainState) -> Batch:
        """The global batch of ``step``, pure in (seed, step) (a resumed run reads the same)."""
        part, parts = distributed.process_batch_shard(self.run.batch_sharding, self.tc.batch_size)
        rows = self.run.data.batch(self.tc, step, process_index=part, process_count=parts)
        return distributed.global_batch(rows, self.run.batch_sharding, self.tc.batch_size)

    def update(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        """One update: the new state and the step's metrics (device values, read later)."""
        return self.train_step(state, batch)

    def describe(self, metrics: dict[str, float]) -> str | None:
        """A step's log line after ``step N:``; None: the loss, speed, lr and grad norm."""
        return None

    def loss_unit(self, data_config: DataConfig) -> str:
        """``RunSummary.loss_unit``."""
        return "nats/char" if data_config.tokenizer == "char" else "nats/token"


__all__ = ["Batch", "Objective", "RunContext"]
