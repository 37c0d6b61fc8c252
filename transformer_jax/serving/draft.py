"""A draft model in the serving engine: a small model's proposals, its pages mirroring the pool.

The draft keeps its own pages under the same page ids as the engine's pool, read through the
same page tables. Every step it runs what the target runs into them: the prefill chunk, the
forks' page copies, and each decode row's last two tokens (the first closes the gap a fully
accepted round leaves). So the prefix cache, forks, preemption and the page tables serve both.
The draft's greedy next token at the decode rows starts its proposals; a verify step continues
them in one program (``propose``). The proposals are point masses, so the verify rule keeps the
target's output exact, greedy and sampled.
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
from transformer_jax.serving.paged_cache import PagedKVCache

Params = dict[str, Any]
STATICS = ("config", "view")


@functools.partial(jax.jit, static_argnames=STATICS, donate_argnames=("k_pages", "v_pages"))
def draft_rows(config: ModelConfig, params: Params, k_pages: Any, v_pages: Any,
               tokens: jax.Array, start: jax.Array, page_table: jax.Array, *,
               view: str = "auto") -> tuple[Any, Any, jax.Array]:
    """The draft's forward at the decode rows: each row's last two tokens ([B, 2] at
    positions ``start``, [B] = cached length - 1) written into its pages (``page_table`` [B, W],
    updated in place), and its greedy next token. Returns (key pages, value pages, [B] int32)."""
    cache = PagedKVCache(k=k_pages, v=v_pages, page_table=page_table, lengths=start, view=view)
    out = forward_chunk(decode_model(config), params, cache, tokens, start)
    return out.cache.k, out.cache.v, sampling.argmax(out.logits[:, -1])


@functools.partial(jax.jit, static_argnames=(*STATICS, "steps"),
                   donate_argnames=("k_pages", "v_pages"))
def draft_more(config: ModelConfig, params: Params, k_pages: Any, v_pages: Any,
               first: jax.Array, start: jax.Array, page_table: jax.Array, *, steps: int,
               view: str = "auto") -> tuple[Any, Any, jax.Array]:
    """``steps`` (static) more greedy draft steps from each row's first proposal (``first``
    [B] fed at ``start``); returns (key pages, value pages, [B, 1 + steps] int32 proposals)."""
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


def same_path(a: str, b: str) -> bool:
    """Whether two checkpoint paths name the same place (``gs://`` paths compared as given)."""
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


class EngineDraft:
    """The engine's draft model and its mirrored pages.

    Args:
      draft: a ``decode.speculative_loop.DraftModel`` (one device, the target's vocabulary).
      engine: the ``Engine`` it proposes for.
      path: where the draft was loaded from (requests naming another path are refused), or None.
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
        """Runs the step's chunk, fork copies and decode rows into the draft's pages."""
        params = self.model.weights.params
        if prefill is not None:
            self._prefill(prefill)
        if plan.copies:
            self.k, self.v = step_lib.copy_pages_jit(
                self.k, self.v, *step_lib.padded(*np.asarray(plan.copies, np.int32).T))
        self.next = None
        if plan.decodes:  # each row's last two tokens, from cached - 1
            rows = scheduler.decode_rows(plan.decodes, plan.width, ahead=-1)
            tokens = np.zeros((scheduler.num_slots, 2), np.int32)
            for req in plan.decodes:
                tokens[req.slot] = req.tokens[-2:]
            self.k, self.v, self.next = draft_rows(
                self.config, params, self.k, self.v, tokens, rows.positions, rows.page_table,
                view=self.view)

    def _prefill(self, chunk: Any) -> None:
        """Runs a prefill chunk (``scheduler.PrefillChunk``) into the draft's pages."""
        self.k, self.v, _, _ = step_lib.forward_jit(
            self.config, self.model.weights.params, self.k, self.v, None, chunk,
            quant=self.model.weights.quant, view=self.view)

    def propose(self, plan: Any, scheduler: Any, width: int, t: int) -> np.ndarray:
        """Each slot's T - 1 greedy proposals, [B, T - 1] int32 on the host."""
        rows = scheduler.decode_rows(plan.decodes, width, ahead=1)  # ``next`` fed at cached + 1
        self.k, self.v, proposals = draft_more(
            self.config, self.model.weights.params, self.k, self.v, self.next, rows.positions,
            rows.page_table, steps=t - 2, view=self.view)
        return np.asarray(jax.device_get(proposals))

    def compile(self, scheduler: Any, ts: list[int], adapters: bool) -> int:
        """Runs the draft's programs once on idle rows: its prefill chunk at every chunk shape,
        its decode rows and proposals at every page-table width and T in ``ts``; returns the
        shapes run."""
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
