"""Multi-token prediction in the serving engine (``speculative="mtp"``): the target's own module
1 proposes the token after the next one, as in ``generate`` (``decode.speculative_mtp``).

The module keeps its block's keys and values in pages of its own under the pool's page ids,
read through the same page tables (as a draft's are). Its entry at position j combines the
target's final hidden state h_j and the next token t_{j+1}, so the target's own programs write
it: a speculating request's prompt chunk runs ``mtp_chunk``, and every decode step with a
speculating row runs ``mtp_verify`` (T = 2, or T = 1 without a proposal); each leaves the next
proposal. Steps on the two-program path (grammar rows, forks) run without the module.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.decode import speculative_mtp
from transformer_jax.model.config import ModelConfig
from transformer_jax.serving import step as step_lib
from transformer_jax.serving.paged_cache import PagedKVCache
from transformer_jax.serving.plan import row_sampling
from transformer_jax.serving.requests import State

Params = dict[str, Any]
STATICS = ("config", "sampler", "view")
DONATED = ("k_pages", "v_pages", "mk_pages", "mv_pages")


@functools.partial(jax.jit, static_argnames=STATICS, donate_argnames=DONATED)
def mtp_chunk(config: ModelConfig, params: Params, k_pages: Any, v_pages: Any, mk_pages: Any,
              mv_pages: Any, prefill: step_lib.PrefillChunk, following: jax.Array,
              ends: jax.Array, sampling: step_lib.RowSampling, adapters: Params | None, *,
              sampler: step_lib.Sampler, view: str = "auto") -> tuple[Any, ...]:
    """A prompt chunk through the target (forward and draw) and the module.

    Args:
      config, params: the target's config (static) and prepared weights (with ``mtp_0``).
      k_pages, v_pages, mk_pages, mv_pages: the engine's pages and the module's (updated).
      prefill: the step's ``PrefillChunk`` ([R, C] tokens).
      following: [R, C] int32 the prompt's token after each chunk position.
      ends: [R] bool whether the row's chunk ends its prompt (then the drawn token follows).
      sampling: the R rows' sampling settings; sampler, view: static, as ``engine_step``'s.
      adapters: the engine's stacked LoRA adapters, or None.

    Returns:
      (key pages, value pages, the module's key and value pages, [R] (or [R, 1 + K]) tokens,
      their log-probabilities, [R] int32 the module's prediction at each row's last position).
    """
    k, v, logits, _, hidden = step_lib._forward(config, params, k_pages, v_pages, None,
                                                prefill, None, adapters, view=view, hidden=True)
    tokens, logprobs = step_lib.sample_rows(logits, sampling, sampler)
    drawn = tokens if tokens.ndim == 1 else tokens[:, 0]
    rows = jnp.arange(following.shape[0])
    following = following.at[rows, prefill.last].set(
        jnp.where(ends, drawn, following[rows, prefill.last]))
    module = PagedKVCache(k=mk_pages, v=mv_pages, page_table=prefill.page_table,
                          lengths=prefill.start, view=view)
    proposal, module = speculative_mtp.propose(config, params, module, hidden, following,
                                               prefill.start, prefill.last)
    return k, v, module.k, module.v, tokens, logprobs, proposal


@functools.partial(jax.jit, static_argnames=STATICS, donate_argnames=DONATED)
def mtp_verify(config: ModelConfig, params: Params, k_pages: Any, v_pages: Any, mk_pages: Any,
               mv_pages: Any, rows: Any, sampling: step_lib.RowSampling,
               adapters: Params | None, *, sampler: step_lib.Sampler, view: str = "auto"
               ) -> tuple[Any, ...]:
    """``speculation.verify_step`` with the module (``speculative_mtp.verify``). ``rows`` are
    the ``speculation.VerifyRows``, ``sampling`` [B * T] rows; others as ``mtp_chunk``'s.

    Returns:
      (key pages, value pages, the module's key and value pages, [B, T] (or [B, T, 1 + K])
      tokens, their log-probabilities, [B] int32 accepted proposals a, [B] int32 each row's
      next proposal: the module's prediction at position ``start + a``).
    """
    cache = PagedKVCache(k=k_pages, v=v_pages, page_table=rows.page_table, lengths=rows.start,
                         view=view)
    draw = functools.partial(step_lib.sample_positions, rows=sampling, sampler=sampler)
    cache, module, proposal, tokens, logprobs, a = speculative_mtp.verify(
        config, step_lib._adapted(params, adapters, rows.adapter), cache,
        cache.replace(k=mk_pages, v=mv_pages), rows.tokens, rows.start, rows.num_drafts, draw)
    return cache.k, cache.v, module.k, module.v, tokens, logprobs, a, proposal


def is_mtp(req: Any) -> bool:
    """Whether a request speculates with the module."""
    return req.speculation is not None and req.speculation[0].method == "mtp"


class EngineMTP:
    """The module's pages beside the engine's pool (one more layer of the pool's size), and
    the speculating requests' proposals. ``engine``: one device, ``mtp_depth`` >= 1."""

    def __init__(self, engine: Any) -> None:
        speculative_mtp.check_mtp(engine.config, 1)
        self.engine = engine
        stored = jax.tree.leaves(engine._k)[0].dtype
        cache = PagedKVCache.init(speculative_mtp.cache_config(engine.config),
                                  engine.scheduler.pool.num_pages, engine.page_size,
                                  dtype=stored, view=engine.view)
        self.k, self.v = jax.device_put((cache.k, cache.v), jax.devices()[0])
        self.cache_bytes = cache.nbytes
        #: request id -> (the request's cached length it was made at, proposal)
        self._next: dict[int, tuple[int, int]] = {}
        #: proposals not read yet: ([(request, cached length, row)], [R] on the device)
        self._unread: list[tuple[list[tuple[Any, int, int]], jax.Array]] = []

    def proposal(self, req: Any) -> dict[int, list[int]]:
        """The request's proposal for its next round ({its id: [token]}), or {}."""
        for made, proposals in self._unread:
            host = np.asarray(jax.device_get(proposals))
            self._next.update((r.id, (n, int(host[i]))) for r, n, i in made)
        self._unread = []
        found = self._next.get(req.id)
        return {req.id: [found[1]]} if found is not None and found[0] == req.cached else {}

    def prefill(self, plan: Any, chunk: step_lib.PrefillChunk, rows: step_lib.RowSampling,
                sampler: step_lib.Sampler) -> tuple[jax.Array, jax.Array]:
        """Runs the step's prompt chunk (``plan`` None for idle rows); returns its rows' tokens
        and log-probabilities on the device, as ``Engine._run``."""
        eng = self.engine
        following = np.zeros(np.shape(chunk.tokens), np.int32)
        ends = np.zeros(len(following), bool)
        made = []
        for i, c in enumerate(() if plan is None else plan.chunks):
            after = c.req.tokens[c.start + 1:c.start + c.length + 1]
            following[i, :len(after)] = after
            ends[i] = c.start + c.length == c.req.prefill_target
            if ends[i] and is_mtp(c.req):
                made.append((c.req, c.req.prefill_target, i))
        eng._k, eng._v, self.k, self.v, tokens, logprobs, proposals = mtp_chunk(
            eng.config, eng.weights.params, eng._k, eng._v, self.k, self.v, chunk, following,
            ends, rows, eng._adapters, sampler=sampler, view=eng.view)
        if made:
            self._unread.append((made, proposals))
        return tokens, logprobs

    def verify(self, rows: Any, sampling: step_lib.RowSampling, sampler: step_lib.Sampler
               ) -> tuple[jax.Array, ...]:
        """Dispatches ``mtp_verify``; returns its outputs past the pages, on the device."""
        eng = self.engine
        eng._k, eng._v, self.k, self.v, *out = mtp_verify(
            eng.config, eng.weights.params, eng._k, eng._v, self.k, self.v, rows, sampling,
            eng._adapters, sampler=sampler, view=eng.view)
        return tuple(out)

    def keep(self, reqs: list[Any], proposals: np.ndarray) -> None:
        """Records each running request's next proposal ([B] by slot); forgets finished ones."""
        for req in reqs:
            if req.state == State.RUNNING and is_mtp(req):
                self._next[req.id] = (req.cached, int(proposals[req.slot]))
            else:
                self._next.pop(req.id, None)
        live = self.engine._requests
        for rid in [rid for rid in self._next if rid not in live]:
            del self._next[rid]

    def compile(self, scheduler: Any) -> int:
        """Runs ``mtp_chunk`` once on idle rows at every chunk shape; returns the shapes run."""
        shapes = 0
        for _, chunk in scheduler.idle_inputs(False, self.engine._adapters is not None):
            if chunk is not None:
                sampling, _ = row_sampling([None] * len(chunk.start), self.engine.config.vocab_size)
                jax.block_until_ready(self.prefill(None, chunk, sampling, step_lib.Sampler()))
                shapes += 1
        return shapes
