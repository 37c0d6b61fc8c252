"""lm-evaluation-harness on this library's models: ``JaxLM``, registered as ``transformer_jax``,
answers the harness's three request types as its ``hf`` backend does, truncation included
(docs/evaluation.md); ``loglikelihood`` packs requests several to a row.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tqdm import tqdm

from transformer_jax.checkpoint import loading
from transformer_jax.decode import generation
from transformer_jax.decode.loop import prepare
from transformer_jax.evaluate.scoring import Scorer, window
from transformer_jax.tokenizer import detokenize

logger = logging.getLogger(__name__)

#: Tokens a generation request may produce when its task does not say.
DEFAULT_MAX_GEN_TOKS = 256


@register_model("transformer_jax")
class JaxLM(TemplateLM):
    """An lm-eval ``LM`` over a ``transformer_jax`` model.

    Args:
      checkpoint: a path (or ``loading.Source``) ``loading.load`` opens; or pass ``loaded``.
      loaded: an already loaded checkpoint (``loading.Loaded``) instead of a path.
      mesh: optional device mesh to place the params on (``loading.load``'s).
      batch_size: packed rows per forward (loglikelihood) and prompts per generate call.
      max_length: the context window in tokens; default the model's ``max_seq_len``.
      max_gen_toks: generation length when a task gives none.
      tokenizer: a tokenizer file or directory instead of the checkpoint's.
      dtype: compute dtype (default the checkpoint's).
    """

    def __init__(self, checkpoint: str | loading.Source | None = None, *,
                 loaded: loading.Loaded | None = None, mesh: Any = None,
                 batch_size: int | str = 8, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, tokenizer: str | None = None,
                 dtype: str | None = None) -> None:
        super().__init__()
        if loaded is None:
            if checkpoint is None:
                raise ValueError("JaxLM needs checkpoint=PATH or loaded=")
            loaded = loading.load(checkpoint, mesh, tokenizer=tokenizer)
        if loaded.tokenizer is None:
            raise ValueError(f"{loaded.source.path}: no tokenizer found; pass tokenizer=PATH")
        config = loaded.config if dtype is None else loaded.config.replace(dtype=dtype)
        self.loaded, self.config, self.mesh, self.tok = loaded, config, mesh, loaded.tokenizer
        self.max_length = int(config.max_seq_len if max_length is None else max_length)
        if not 1 <= self.max_length <= config.max_seq_len:
            raise ValueError(f"max_length={self.max_length} must be in [1, max_seq_len="
                             f"{config.max_seq_len}]")
        self.max_gen_toks = int(max_gen_toks)
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 8
        self.scorer = Scorer(config, loaded.params, batch_size=self.batch_size, mesh=mesh)
        self._decode_weights = None

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window start from: bos, else eos."""
        return self.tok.bos_id if self.tok.bos_id >= 0 else self.tok.eos_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.loaded.tokenizer_path or "")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string`` as transformers' ``tokenizer.encode`` gives them (bos unless
        the string starts with it; no specials with ``add_special_tokens=False``)."""
        specials = add_special_tokens is not False
        bos = specials and self.tok.add_bos_token and self.tok.bos_id >= 0
        # The bos piece ("<s>"), not its decoding: SentencePiece decodes control tokens to "".
        if bos and add_special_tokens is None and string.startswith(
                self.tok.id_to_piece(self.tok.bos_id)):
            bos = False
        eos = specials and self.tok.add_eos_token and self.tok.eos_id >= 0
        ids = self.tok.encode(string, add_bos=bos, add_eos=eos)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: Sequence[int]) -> str:
        return detokenize(self.tok, list(ids))

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        """Scores ``(cache key, context ids, continuation ids)`` requests (packed rows)."""
        windows = []
        for _, context, continuation in requests:
            # A context of only spaces (moved to the continuation) encodes to nothing; it
            # starts from the prefix token, as an empty context does (the hf backend fails).
            context = context or [self.prefix_token_id]
            length = len(context) + len(continuation)
            if length > self.max_length + 1:
                logger.debug("a request of %d tokens loses its first %d (window %d)", length,
                             length - self.max_length - 1, self.max_length)
            windows.append(window(context, continuation, self.max_length))
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                   desc="Running loglikelihood requests")
        results = self.scorer.score(windows, pad_id=max(self.tok.pad_id, 0), progress=bar.update)
        bar.close()
        for (key, _, _), answer in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        """The log-likelihood of each whole text, over rolling windows (the harness's rules)."""
        pairs, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            windows = map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            for context, continuation in windows:
                pairs.append((None, context, continuation))
                owners.append(i)
        scores = self._loglikelihood_tokens(pairs, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, scores, strict=True):
            totals[i] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, as the task asks) continuations cut at the first stop string."""
        if self._decode_weights is None:  # the decode layout, prepared once
            self._decode_weights = prepare(self.config, self.loaded.params, None)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                   desc="Running generate_until requests")
        order = Collator([req.args for req in requests],
                         sort_fn=lambda x: (-len(self.tok_encode(x[0])), x[0]),
                         group_by="gen_kwargs", group_fn=lambda x: x[1])
        eos = self.tok_decode([self.eot_token_id]) if self.eot_token_id >= 0 else None
        out = []
        for chunk in order.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk, strict=True)
            kwargs = normalize_gen_kwargs(dict(all_kwargs[0]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            texts = self._generate(list(contexts), kwargs, until)
            for context, text in zip(contexts, texts, strict=True):
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
                bar.update(1)
            out.extend(texts)
        bar.close()
        return order.get_original(out)

    def _generate(self, contexts: list[str], kwargs: dict[str, Any], until: list[str]
                  ) -> list[str]:
        max_new = int(kwargs.pop("max_gen_toks"))
        room = self.max_length - max_new
        if room < 1:
            raise ValueError(f"max_gen_toks={max_new} leaves no room for a context in the "
                             f"window of {self.max_length} tokens")
        prompts = [self.tok_encode(c, left_truncate_len=room) or [self.prefix_token_id]
                   for c in contexts]
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
        result = generation.generate(
            self.config, self._decode_weights, prompts, max_new_tokens=max_new,
            temperature=temperature, top_k=kwargs.get("top_k"), top_p=kwargs.get("top_p"),
            seed=int(kwargs.get("seed", 0) or 0),
            stop_tokens=[self.eot_token_id] if self.eot_token_id >= 0 else [])
        return [postprocess_generated_text(self.tok_decode(ids), until, None)
                for ids in result.tokens]


__all__ = ["DEFAULT_MAX_GEN_TOKS", "JaxLM"]
