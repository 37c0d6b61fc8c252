"""What a run settles before it reads data or compiles anything: where its files go, the checks
of its configs, the shardings of its state, and whether it fits in memory."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax

from transformer_jax import storage
from transformer_jax.checkpoint.files import ensure_writable_dir
from transformer_jax.checkpoint.loading import CHECKPOINTS
from transformer_jax.model import lora
from transformer_jax.model.config import ModelConfig
from transformer_jax.parallel import sharding as sharding_lib
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.memory import check_fits
from transformer_jax.train.step import Params, ParamsLayout, make_init_fn

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunDirectory:
    """Where a run's files go.

    Attributes:
      name: ``train.run_dir`` as given (a local path or a ``gs://`` URL), for messages.
      local: where the run writes its small files: the run directory, or a remote one's mirror.
      checkpoints: the checkpoint directory, on the object store for a remote run.
      remote: whether ``name`` is on object storage.
    """

    name: str
    local: Path
    checkpoints: Any
    remote: bool

    def sync(self, failing: bool = False) -> None:
        """Uploads the mirror's changed files to a remote run directory (``failing``: a failed
        upload is only a warning)."""
        if not self.remote:
            return
        try:
            sent = storage.push(self.local, self.name, exclude=(CHECKPOINTS,))
        except Exception as e:
            if not failing:
                raise
            logger.warning("could not upload the run files to %s: %s", self.name, e)
            return
        logger.debug("uploaded %d run file%s to %s", sent, "" if sent == 1 else "s", self.name)


def run_directory(run_dir: str, process_index: int) -> RunDirectory:
    """Opens ``train.run_dir``: creates and probes a local one; for a remote one fetches its
    small files into a local mirror, one per process.

    Raises:
      PermissionError: a local directory that cannot be written.
      FileNotFoundError: a remote one in a bucket that does not exist.
    """
    if not storage.is_remote(run_dir):
        local = ensure_writable_dir(run_dir, "run directory")
        return RunDirectory(str(local), local, local / CHECKPOINTS, remote=False)
    name = run_dir.rstrip("/")
    storage.check_bucket(name, "train.run_dir")
    remote = storage.as_path(name)
    local = storage.staging_dir(name, f"run-{process_index}")
    if remote.exists():  # the mirror becomes the bucket's files (stale ones removed)
        storage.local_copy(name, exclude=(CHECKPOINTS,), purpose=f"run-{process_index}")
    else:  # a new run: nothing of an earlier one at this URL may be uploaded with it
        storage.rmtree(local)
    local.mkdir(parents=True, exist_ok=True)
    logger.info("run directory %s: checkpoints written in place, the other files through the "
                "local mirror %s", name, local)
    return RunDirectory(name, local, remote / CHECKPOINTS, remote=True)


def check_run(model_config: ModelConfig, train_config: TrainConfig, num_train_tokens: int,
              num_devices: int | None = None) -> None:
    """Raises a clear ValueError for a run that cannot work (``model_config`` with its final
    vocab size; ``num_devices``: those the batch is split over, default all)."""
    check_config(model_config, train_config, num_devices)
    tc = train_config
    if num_train_tokens <= tc.seq_len:
        raise ValueError(f"the train split has {num_train_tokens} tokens, not more than "
                         f"train.seq_len={tc.seq_len}; use more data or a shorter seq_len")
    check_dtype(model_config)


def check_dtype(model_config: ModelConfig) -> None:
    if model_config.param_dtype != "float32":
        logger.warning("param_dtype=%s: training keeps its master weights in this dtype",
                       model_config.param_dtype)


def check_config(model_config: ModelConfig, train_config: TrainConfig,
                 num_devices: int | None = None) -> None:
    """The checks of ``check_run`` that need no data (run before the corpus is tokenized)."""
    tc = train_config
    if tc.quant == "fp8" and jax.default_backend() == "cpu":
        raise ValueError("train.quant=fp8 needs a GPU or TPU (fp8 matmuls); this backend is "
                         "cpu: use train.quant=int8 (quant_train exports the fp8 step for cuda)")
    if tc.seq_len > model_config.max_seq_len:
        raise ValueError(f"train.seq_len={tc.seq_len} is above the model's max_seq_len="
                         f"{model_config.max_seq_len}")
    if tc.moe_bias_update_rate and not (model_config.moe and model_config.moe.correction_bias):
        raise ValueError(f"train.moe_bias_update_rate={tc.moe_bias_update_rate} updates a "
                         "router's correction bias, which this model lacks (model.moe."
                         "correction_bias=false); set it to 0")
    if tc.mtp_weight and not model_config.mtp_depth:
        raise ValueError(f"train.mtp_weight={tc.mtp_weight} trains multi-token prediction "
                         "modules, which this model lacks (model.mtp_depth=0); set it to 0")
    check_context(model_config, tc)
    num_devices = jax.device_count() if num_devices is None else num_devices
    # With train.pairs_per_step the batch's rows are derived from the data, a multiple of these.
    if tc.micro_batch_size % num_devices and not tc.pairs_per_step:
        raise ValueError(f"train.batch_size={tc.batch_size} (micro-batch "
                         f"{tc.micro_batch_size} with grad_accum={tc.grad_accum}) is not "
                         f"divisible by the number of devices ({num_devices})")


def check_context(model_config: ModelConfig, train_config: TrainConfig) -> None:
    """Raises ValueError, in one line, for what context parallelism (``train.mesh``'s
    ``context=C``) cannot train."""
    tc = train_config
    context = sharding_lib.MeshConfig.parse(tc.mesh).context
    if context == 1:
        return
    where = f"train.mesh={tc.mesh} (context parallelism)"
    if tc.seq_len % (2 * context):
        raise ValueError(f"{where} needs train.seq_len a multiple of 2 x context = "
                         f"{2 * context}, got {tc.seq_len}")
    if tc.objective != "sft":
        raise ValueError(f"{where} trains only train.objective=sft, got {tc.objective}")
    if tc.mtp_weight:
        raise ValueError(f"{where} cannot train train.mtp_weight (its targets are the tokens "
                         "k ahead in the unpermuted order); set it to 0")
    if model_config.attention_impl == "pallas":
        raise ValueError(f"{where} cannot use attention_impl='pallas' (causal by index on TPU); "
                         "use 'auto', 'mosaic', 'chunked' or 'xla'")


def params_shardings(model_config: ModelConfig, mesh: Any, abstract_params: Params,
                      layout: ParamsLayout) -> Any:
    """Shardings by parameter path for ``sharding.state_shardings`` (with LoRA, the base's and
    the adapters' too)."""
    model_shardings = sharding_lib.param_shardings(model_config, mesh)
    if layout.lora_config is None:
        return model_shardings
    adapters = lora.adapter_shardings(abstract_params[lora.ADAPTERS], model_shardings)
    return {**adapters, lora.BASE: model_shardings, lora.ADAPTERS: adapters}


def check_memory(model_config: ModelConfig, train_config: TrainConfig, mesh: Any) -> None:
    """Raises ValueError, in one line, for a run that will not fit (``memory.check_fits``)."""
    abstract = jax.eval_shape(make_init_fn(model_config, train_config),
                              jax.random.key(train_config.seed))
    shardings = sharding_lib.state_shardings(abstract, params_shardings(
        model_config, mesh, abstract.params, ParamsLayout.of(train_config)))
    check_fits(model_config, train_config, abstract, shardings, dict(mesh.shape))


def attention_used(model_config: ModelConfig, tc: TrainConfig) -> str:
    """What the train step's attention runs (what ``"auto"`` picks for its queries, here)."""
    impl = model_config.attention_impl
    if impl != "auto":
        return repr(impl)
    from transformer_jax.model.ops.attention import choose_impl

    c = model_config
    q = jax.ShapeDtypeStruct((tc.micro_batch_size, tc.seq_len, c.n_heads, c.head_dim),
                             c.jnp_dtype)
    k = jax.ShapeDtypeStruct((tc.micro_batch_size, c.n_kv_heads, tc.seq_len, c.head_dim),
                             c.jnp_dtype)
    return f"'auto' -> {choose_impl(q, k)!r}"
