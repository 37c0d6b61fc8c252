"""Several decode steps per host round: N engine decode steps in one device program.

When every running request decodes (none waiting, none in prefill, nothing queued), the engine
runs N decode steps as one program (``multi_decode``: the single step's forward and sampling in
a ``lax.fori_loop``, so the tokens are the single steps'), then hands each row's N tokens to the
scheduler in order. N is the largest power of two (up to ``max_steps``) not above the longest
remaining ``max_tokens``; rounds are skipped while anything needs the host between tokens.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.decode.loop import decode_context, is_split
from transformer_jax.model.config import ModelConfig
from transformer_jax.serving import step as step_lib
from transformer_jax.serving.page_pool import NULL_PAGE, pages_for
from transformer_jax.serving.plan import row_sampling
from transformer_jax.serving.requests import Request, State, TokenEvent
from transformer_jax.serving.step_times import StepClock

#: The most decode steps one round runs by default: 1, rounds off (slower on XLA:CPU,
#: docs/serving.md); set ``Engine.multistep.max_steps`` (e.g. 8) on an accelerator.
MAX_STEPS = 1


def multi_decode(config: ModelConfig, params: Any, k_pages: Any, v_pages: Any,
                 decode: step_lib.DecodeRows, rows: step_lib.RowSampling, stops: jax.Array,
                 left: jax.Array, *, steps: int, sampler: step_lib.Sampler, view: str = "auto",
                 mesh: Any = None) -> tuple[Any, Any, jax.Array, jax.Array]:
    """``steps`` engine decode steps on the B slots' rows in one program.

    Args:
      config, params, k_pages, v_pages, view, mesh: as ``step.engine_step``'s.
      decode, rows: the B rows' first step (no adapters) and sampling settings.
      stops: [B, S] int32 each row's stop tokens (-1 padding).
      left: [B] int32 the most tokens each row draws (its ``max_tokens`` left; 0 idle).
      steps: N (static).
      sampler: static sampling switches (no top log-probs).

    Returns:
      (key pages, value pages, [N, B] int32 tokens, [N, B] float32 log-probabilities); a
      row's tokens after its first stop token or past ``left`` are not meaningful.
    """
    b = decode.tokens.shape[0]

    def body(i: jax.Array, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        k, v, tokens, positions, table, out_tokens, out_logprobs = carry
        rows_i = rows.replace(token_index=rows.token_index + i)
        k, v, logits, _ = step_lib._forward(config, params, k, v,
                                            step_lib.DecodeRows(tokens, positions, table),
                                            None, None, None, view=view)
        new, logprobs = step_lib.sample_rows(logits, rows_i, sampler)
        stopped = jnp.any(new[:, None] == stops, axis=1) | (i + 1 >= left)
        table = jnp.where(stopped[:, None], NULL_PAGE, table)
        return (k, v, new, positions + 1, table, out_tokens.at[i].set(new),
                out_logprobs.at[i].set(logprobs))

    with decode_context(config, mesh):
        init = (k_pages, v_pages, decode.tokens, decode.positions, decode.page_table,
                jnp.zeros((steps, b), jnp.int32), jnp.zeros((steps, b), jnp.float32))
        k, v, *_, out_tokens, out_logprobs = jax.lax.fori_loop(0, steps, body, init)
    return k, v, out_tokens, out_logprobs


def jit_multi_decode(**jit_options: Any) -> Any:
    """``multi_decode`` jitted, its pages donated, with extra ``jax.jit`` options."""
    return jax.jit(multi_decode, static_argnames=("config", "steps", "sampler", "view", "mesh"),
                   donate_argnames=("k_pages", "v_pages"), **jit_options)


#: The rounds' program (one per N, page-table width and sampler switches).
multi_decode_jit = jit_multi_decode()


class MultiStep:
    """An engine's multi-step rounds (see the module docstring); ``engine`` is the ``Engine``.

    Attributes:
      max_steps: the most steps of one round (1 turns rounds off).
      rounds: rounds run; round_tokens: the tokens they emitted.
    """

    def __init__(self, engine: Any, max_steps: int = MAX_STEPS) -> None:
        self.engine = engine
        self.max_steps = max_steps
        self.rounds = 0
        self.round_tokens = 0

    def steps_for(self) -> int:
        """N for a round now, or 0 when the engine must run a single step."""
        e, sched = self.engine, self.engine.scheduler
        if (self.max_steps < 2 or sched.waiting or sched.prefilling or not sched.running
                or e._pending or e._adapters is not None or e._rings is not None
                or e.speculation.draft is not None or is_split(e.mesh)):
            return 0
        left = [0]
        for req in sched.running:
            p = req.params
            if (req.state != State.RUNNING or req.matcher is not None or p.stop
                    or req.speculation is not None or p.top_logprobs):
                return 0
            left.append(p.max_tokens - req.num_new)
        n = min(self.max_steps, max(left))
        if n < 2:
            return 0
        n = 1 << (n.bit_length() - 1)  # a power of two: few programs compile
        # The pages for N positions more, every row's, without preempting.
        need = sum(max(0, pages_for(r.cached + self._span(r, n), sched.page_size)
                       - len(r.pages))
                   for r in sched.running)
        return n if need <= sched.prefix.num_available else 0

    def compile(self) -> int:
        """Runs every greedy round shape (each N and page-table width) once on idle rows;
        returns how many."""
        e, sched = self.engine, self.engine.scheduler
        b, shapes = sched.num_slots, 0
        rows, sampler = row_sampling([None] * b, e.config.vocab_size)
        zeros = np.zeros(b, np.int32)
        n = 2
        while n <= self.max_steps:
            for w in sched.widths:
                e._k, e._v, *out = multi_decode_jit(
                    e.config, e.weights.params, e._k, e._v,
                    step_lib.DecodeRows(zeros, zeros, np.zeros((b, w), np.int32)), rows,
                    np.full((b, 1), -1, np.int32), zeros, steps=n, sampler=sampler,
                    view=e.view, mesh=e.mesh)
                jax.block_until_ready(out)
                shapes += 1
            n *= 2
        return shapes

    @staticmethod
    def _span(req: Request, n: int) -> int:
        """The positions ``req`` writes in a round of ``n`` steps."""
        return min(n, req.params.max_tokens - req.num_new)

    def round(self, clock: StepClock) -> list[tuple[Request, TokenEvent]] | None:
        """Runs a round when one can run (``steps_for``): its events, delivered; else None."""
        n = self.steps_for()
        if not n:
            return None
        e, sched = self.engine, self.engine.scheduler
        running = list(sched.running)
        for req in running:  # pages for its N positions (counted free above)
            if not sched._grow(req, req.cached + self._span(req, n), preempt=False):
                raise RuntimeError("a multi-step round found fewer pages than it counted")
        clock.lap("schedule")
        width = sched._width(max(len(r.pages) for r in running))
        b = sched.num_slots
        reqs: list[Request | None] = [None] * b
        s = 1 << (max(1, max(len(r.params.stop_token_ids) for r in running)) - 1).bit_length()
        stops, left = np.full((b, s), -1, np.int32), np.zeros(b, np.int32)
        for req in running:
            reqs[req.slot] = req
            ids = req.params.stop_token_ids
            stops[req.slot, :len(ids)] = ids
            left[req.slot] = req.params.max_tokens - req.num_new
        rows, sampler = row_sampling(reqs, e.config.vocab_size)
        clock.lap("inputs")
        e._k, e._v, out_tokens, out_logprobs = multi_decode_jit(
            e.config, e.weights.params, e._k, e._v, sched.decode_rows(running, width), rows,
            stops, left, steps=n, sampler=sampler, view=e.view, mesh=e.mesh)
        clock.lap("dispatch")
        out_tokens, out_logprobs = clock.lap("device", jax.device_get((out_tokens, out_logprobs)))
        events = []
        for i in range(n):  # a row that stopped earlier in the round takes no more tokens
            events += sched.commit_decodes([r for r in running if r.state == State.RUNNING],
                                           out_tokens[i], out_logprobs[i])
        self.rounds += 1
        self.round_tokens += len(events)
        delivered = e._deliver(events)
        e.steps += 1
        e.step_times.record(clock)
        return delivered

