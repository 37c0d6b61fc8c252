"""A draft model in the serving engine: proposals from a small model whose pages mirror the
target's.

The draft keeps its own pages (its own layers, kv heads and head size) under the same page ids
as the engine's pool, read through the same page tables. Every step it runs what the target
runs into them: the step's prefill chunk, the forks' page copies, and for each decode row its
last two tokens (positions ``cached - 1`` and ``cached``). So wherever a page holds the
target's keys and values it holds the draft's for the same tokens, and the prefix cache, forks,
preemption and the scheduler's page tables serve both without a second bookkeeping. The first
of the two tokens closes the one gap verification leaves: when a row keeps every proposal, the
draft never fed the last one, which is then the token before the row's last.

The draft's forward at the decode rows gives its next token (greedy) for every row; a verify
step continues from it with more greedy steps in one program (``propose``). The proposals are
point masses, so the verify rule (``decode.speculative``) keeps a proposal when the target's
own draw equals it: the output is the target's, greedy and sampled. Positions the draft writes
past a row's length hold stale entries, hidden by causality and overwritten before they are
read, as the verify step's rejected positions are.

Programs: the draft's prefill chunk (``step.forward_jit`` of the draft's config) per chunk
shape, ``draft_rows`` per page-table width and ``draft_more`` per width and number of steps.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import numpy as np

from transformer_jax.decode import sampling
from transformer_jax.decode.loop import decode_model
from transformer_jax.decode.speculative import forward_chunk, greedy_proposals
from transformer_jax.model.config import ModelConfig
from transformer_jax.serving import step as step_lib
from transformer_jax.serving.page_pool import NULL_PAGE
from transformer_jax.serving.paged_cache import PagedKVCache

Params = dict[str, Any]
STATICS = ("config", "view")


@functools.partial(jax.jit, static_argnames=STATICS, donate_argnames=("k_pages", "v_pages"))
def draft_rows(config: ModelConfig, params: Params, k_pages: Any, v_pages: Any,
               tokens: jax.Array, start: jax.Array, page_table: jax.Array, *,
               view: str = "auto") -> tuple[Any, Any, jax.Array]:
    """The draft's forward at the decode rows: each row's last two tokens written into its
    pages, and its greedy next token.

    Args:
      config, params: the draft's config (static) and prepared weights.
      k_pages, v_pages: the draft's pages (updated in place).
      tokens: [B, 2] int32 each row's token before its last, and its last.
      start: [B] int32 the position of ``tokens[:, 0]`` (the row's cached length - 1).
      page_table: [B, W] int32 each row's pages (``NULL_PAGE`` for an idle slot).
      view: static; how attention reads the pages (``PagedKVCache.view``).

    Returns:
      (key pages, value pages, [B] int32 the draft's next token per row).
    """
    cache = PagedKVCache(k=k_pages, v=v_pages, page_table=page_table, lengths=start, view=view)
    out = forward_chunk(decode_model(config), params, cache, tokens, start)
    return out.cache.k, out.cache.v, sampling.argmax(out.logits[:, -1])


@functools.partial(jax.jit, static_argnames=(*STATICS, "steps"),
                   donate_argnames=("k_pages", "v_pages"))
def draft_more(config: ModelConfig, params: Params, k_pages: Any, v_pages: Any,
               first: jax.Array, start: jax.Array, page_table: jax.Array, *, steps: int,
               view: str = "auto") -> tuple[Any, Any, jax.Array]:
    """``steps`` more greedy draft steps from each row's first proposal
    (``speculative.greedy_proposals``, ``generate``'s draft's too).

    Args:
      first: [B] int32 the first proposal (``draft_rows``' token), fed at ``start``.
      start: [B] int32 its position (the row's cached length + 1).
      steps: static, the further proposals.
      Others as ``draft_rows``'.

    Returns:
      (key pages, value pages, [B, 1 + steps] int32 the proposals, ``first`` included).
    """
    model = decode_model(config)

    def step(pages: tuple[Any, Any], token: jax.Array, pos: jax.Array
             ) -> tuple[jax.Array, tuple[Any, Any]]:
        cache = PagedKVCache(k=pages[0], v=pages[1], page_table=page_table, lengths=pos,
                             view=view)
        out = model.apply({"params": params}, token[:, None], pos[:, None], cache=cache)
        return out.logits[:, -1], (out.cache.k, out.cache.v)

    (k_pages, v_pages), proposals = greedy_proposals(step, (k_pages, v_pages), first, start,
                                                     steps)
    return k_pages, v_pages, proposals


def decode_table(plan: Any, scheduler: Any, width: int) -> np.ndarray:
    """[B, W] the decode rows' pages, ``NULL_PAGE`` for every other slot (one prefilling a
    prompt holds pages the draft must not write), a copy (the scheduler changes its table
    while the step may still be queued)."""
    table = np.full((scheduler.num_slots, width), NULL_PAGE, np.int32)
    for req in plan.decodes:
        table[req.slot] = scheduler.page_table[req.slot, :width]
    return table


def same_path(a: str, b: str) -> bool:
    """Whether two checkpoint paths name the same place (``gs://`` paths compared as given)."""
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


class EngineDraft:
    """The engine's draft model and its mirrored pages (module docstring).

    Args:
      draft: a ``decode.speculative_loop.DraftModel`` (one device, the target's vocabulary, no
        sliding-window layers; its tokenizer is the caller's to check, e.g. the server's).
      engine: the ``Engine`` it proposes for (its config, pool size, page size and view).
      path: where the draft was loaded from (requests naming another path are refused), or
        None when given as a model.
    """

    def __init__(self, draft: Any, engine: Any, path: str | None = None) -> None:
        draft.check_against(engine.config)
        if engine._rings is not None or step_lib.is_split(engine.mesh):
            raise ValueError("a draft model needs an engine on one device without "
                             "sliding-window (ring) layers")
        self.model, self.path = draft, path
        self.config: ModelConfig = draft.config
        self.view = engine.view
        cache = PagedKVCache.init(draft.config, engine.scheduler.pool.num_pages,
                                  engine.page_size, view=engine.view)
        self.k, self.v = jax.device_put((cache.k, cache.v), jax.devices()[0])
        self.cache_bytes = cache.nbytes
        #: The decode rows' next draft token of the running step ([B], on the device).
        self.next: jax.Array | None = None

    def mirror(self, plan: Any, prefill: Any, scheduler: Any) -> None:
        """Runs the step's prefill chunk, fork copies and decode rows into the draft's pages;
        keeps the decode rows' next draft token in ``next``."""
        params = self.model.weights.params
        if prefill is not None:
            self._prefill(prefill)
        if plan.copies:
            self.k, self.v = step_lib.copy_pages_jit(
                self.k, self.v, *step_lib.padded(*np.asarray(plan.copies, np.int32).T))
        self.next = None
        if plan.decodes:
            b = scheduler.num_slots
            tokens, start = np.zeros((b, 2), np.int32), np.zeros(b, np.int32)
            for req in plan.decodes:
                tokens[req.slot] = req.tokens[-2:]
                start[req.slot] = req.cached - 1
            self.k, self.v, self.next = draft_rows(
                self.config, params, self.k, self.v, tokens, start,
                decode_table(plan, scheduler, plan.width), view=self.view)

    def _prefill(self, chunk: Any) -> None:
        """Runs a prefill chunk (``scheduler.PrefillChunk``) into the draft's pages."""
        self.k, self.v, _, _ = step_lib.forward_jit(
            self.config, self.model.weights.params, self.k, self.v, None, chunk,
            quant=self.model.weights.quant, view=self.view)

    def propose(self, plan: Any, scheduler: Any, width: int, t: int) -> np.ndarray:
        """Each slot's T - 1 greedy proposals, continuing the mirrored decode rows ([B, T - 1]
        int32 on the host; the rows' pages grown for them first, writes past a row's pages
        go to the null page)."""
        b = scheduler.num_slots
        start = np.zeros(b, np.int32)
        for req in plan.decodes:
            start[req.slot] = req.cached + 1
        self.k, self.v, proposals = draft_more(
            self.config, self.model.weights.params, self.k, self.v, self.next, start,
            decode_table(plan, scheduler, width), steps=t - 2, view=self.view)
        return np.asarray(jax.device_get(proposals))

    def compile(self, scheduler: Any, ts: list[int], adapters: bool) -> int:
        """Runs the draft's programs once on idle rows, writing only into the null page: its
        prefill chunk at every chunk shape (the engine's ``adapters`` or not), and its decode
        rows and proposals at every page-table width and proposal count T - 1 for ``ts``;
        returns the shapes run. (Without the chunks, a load's first chunk of each shape
        compiled the draft's prefill mid-run: 0.4 s of a 1.1 s batch-1 run on this CPU.)"""
        b, shapes = scheduler.num_slots, 0
        for _, chunk in scheduler.idle_inputs(False, adapters):
            if chunk is not None:
                self._prefill(chunk)
                shapes += 1
        for width in scheduler.widths:
            table = np.zeros((b, width), np.int32)
            self.k, self.v, self.next = draft_rows(
                self.config, self.model.weights.params, self.k, self.v,
                np.zeros((b, 2), np.int32), np.zeros(b, np.int32), table, view=self.view)
            shapes += 1
            for t in ts:
                self.k, self.v, out = draft_more(
                    self.config, self.model.weights.params, self.k, self.v, self.next,
                    np.zeros(b, np.int32), table, steps=t - 2, view=self.view)
                jax.block_until_ready(out)
                shapes += 1
        return shapes
