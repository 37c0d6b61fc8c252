"""The serving engine: continuous batching over a paged KV cache, one compiled step at a time.

``Engine`` owns a model's prepared weights, B sequence slots and a pool of KV pages.
``add_request`` and ``cancel`` may be called from any thread: they are queued under a lock and
applied between steps. Each ``step`` runs the compiled programs of ``step.py``: a decode token
for every running sequence and, within the token budget, chunks of waiting prompts; then each
new token goes to its request's consumer. The scheduling is ``scheduler.py``'s.

A request decodes what ``generation.generate`` gives its prompt alone (the same forward,
sampling and draws: token i with ``fold_in(key(seed), i)``). A request that can never fit is
refused when it is added; one that runs out of pages while decoding preempts the newest request
(which is recomputed later) instead of failing.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.decode.loop import (
    DecodeWeights,
    Params,
    check_tensor_parallel,
    expert_shards,
    is_split,
    prepare,
    tensor_shards,
)
from transformer_jax.decode.prompts import validate_prompts
from transformer_jax.model import multi_lora
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.lora import LoraConfig
from transformer_jax.serving import step as step_lib
from transformer_jax.serving.multistep import MultiStep
from transformer_jax.serving.overlap import Overlap
from transformer_jax.serving.page_pool import pages_for
from transformer_jax.serving.paged_cache import PagedKVCache, check_pageable, check_sizes
from transformer_jax.serving.plan import row_sampling
from transformer_jax.serving.requests import (
    Completion,
    Request,
    SamplingParams,
    State,
    TokenEvent,
    with_text,
)
from transformer_jax.serving.scheduler import MIN_CONTEXT, Scheduler
from transformer_jax.serving.speculation import Speculation
from transformer_jax.serving.step_times import StepClock, StepTimes
from transformer_jax.serving.text import TextStream

logger = logging.getLogger(__name__)

TokenCallback = Callable[[TokenEvent], Any]


class Engine:
    """Serves requests with continuous batching over a paged KV cache.

    Args:
      config: the model's config.
      weights_or_params: ``DecodeWeights`` from ``decode.prepare`` (for this config), or the
        model's parameters (prepared here once).
      num_slots: B, the most sequences decoded at once.
      num_pages: P pages in the pool, page 0 (the null page) included.
      page_size: positions per page.
      token_budget: the most tokens one step runs: B decode rows plus prompt chunks of up to
        ``token_budget - B`` tokens, padding included.
      mesh: optional mesh with a ``"tensor"`` axis to run each step over, as ``generate``
        takes it (None: the ``DecodeWeights``' own).
      prefix_caching: share full pages between requests with the same prefix (off, with a
        log line, for a model whose local layers keep rings).
      cache_dtype: the pages' storage dtype: a floating dtype (name), or ``"int8"``; the
        model's compute dtype by default.
      min_context: the narrowest context (positions) a step attends over (``Scheduler``).
      view: how attention reads the pages: ``"auto"``, ``"gather"``, ``"pool"`` or
        ``"blocks"`` (``PagedKVCache``).
      tokenizer: optional ``TextTokenizer``: every ``TokenEvent`` then carries its text delta
        and requests may have stop strings.
      quant: prepare the parameters with weights quantised (``"int8"``, ``"int4"``,
        ``"int4:G"``); given ``DecodeWeights`` must match it.
      adapters: optional {name: (adapter tree, ``LoraConfig``)} of LoRA adapters of these
        weights, named by ``SamplingParams.adapter``; one step batches rows of different ones.
      draft: optional draft model for speculative decoding (a ``DraftModel`` or a checkpoint
        path) for requests with ``speculative="draft:..."``.
      max_prefill_rows: the most prompts one step prefills (default: as many as the token
        budget holds; 1 compiles fewer chunk shapes).
      overlap: dispatch steady decode steps one step ahead of reading their tokens.

    Raises:
      ValueError: for sizes out of range, an unknown ``cache_dtype`` or ``view`` (naming
        them), or a mesh the model cannot be split over (``decode.check_tensor_parallel``).
    """

    def __init__(self, config: ModelConfig, weights_or_params: DecodeWeights | Params,
                 num_slots: int, num_pages: int, page_size: int, token_budget: int,
                 mesh: Mesh | None = None, *, prefix_caching: bool = True,
                 cache_dtype: jnp.dtype | str | None = None,
                 min_context: int = MIN_CONTEXT, view: str = "auto",
                 tokenizer: Any = None, quant: str | None = None, draft: Any = None,
                 adapters: Mapping[str, tuple[Any, LoraConfig]] | None = None,
                 max_prefill_rows: int | None = None, overlap: bool = True) -> None:
        check_sizes(view, num_slots=num_slots, num_pages=num_pages, page_size=page_size,
                    token_budget=token_budget, min_context=min_context)
        if token_budget <= num_slots:
            raise ValueError(f"token_budget ({token_budget}) must exceed num_slots "
                             f"({num_slots}): each step decodes one token per slot and "
                             "prefills with the rest")
        check_pageable(config, cache_dtype)
        if isinstance(weights_or_params, DecodeWeights):
            weights_or_params.check_for(config, mesh, "Engine", quant)
            self.weights = weights_or_params
        else:
            self.weights = prepare(config, weights_or_params, mesh, quant=quant)
        self.mesh = self.weights.mesh
        check_tensor_parallel(config, tensor_shards(self.mesh), expert_shards(self.mesh))
        self.config = config
        self.tokenizer = tokenizer
        #: The LoRA adapters' names; a row's adapter id is its index here plus one.
        self.adapter_names: tuple[str, ...] = tuple(adapters or ())
        self._adapters = None if not adapters else self._stack(adapters)
        self._grammars: Any = None  # the tokenizer as llguidance reads it, on first use
        self.page_size = page_size
        self.token_budget = token_budget
        cache = PagedKVCache.init(config, num_pages, page_size, dtype=cache_dtype, view=view,
                                  slots=num_slots)
        self.view = view
        self._k, self._v = cache.k, cache.v
        self._rings = None if cache.ring is None else (cache.k_ring, cache.v_ring)
        if is_split(self.mesh):  # each device its K/T kv heads of every page
            placed = NamedSharding(self.mesh, step_lib.page_spec(config))
            self._k, self._v = jax.device_put((self._k, self._v), placed)
            if self._rings is not None:
                self._rings = jax.device_put(
                    self._rings, NamedSharding(self.mesh, step_lib.ring_spec(config)))
        else:
            # Committed from the start, as every step's outputs are (else each program
            # would compile again for committed pages).
            self._k, self._v, self._rings = jax.device_put((self._k, self._v, self._rings),
                                                           jax.devices()[0])
        #: Bytes of the pages and the local layers' rings.
        self.cache_bytes = cache.nbytes
        if cache.ring is not None and prefix_caching:
            logger.info("prefix caching is off: the %d local layers keep only their window of "
                        "%d positions per slot, which a prefix hit would not compute",
                        cache.ring.n_local, cache.ring.window)
            prefix_caching = False
        self.scheduler = Scheduler(num_slots, num_pages, page_size, config.max_seq_len,
                                   token_budget - num_slots, prefix_caching, min_context,
                                   forks=self._rings is None, max_prefill_rows=max_prefill_rows)
        self._lock = threading.Lock()
        self._pending: list[tuple[str, Any]] = []
        self._requests: dict[int, Request] = {}
        self._ids, self.steps = itertools.count(), 0  # request ids; steps run
        #: Where the steps' time went (``serving.step_times``), and the running step's clock.
        self.step_times, self.step_clock = StepTimes(), StepClock()
        #: Speculative decoding, multi-step rounds and overlapped steps.
        self.speculation, self.multistep = Speculation(self, draft), MultiStep(self)
        self.overlap = Overlap(self, overlap)

    def _stack(self, adapters: Mapping[str, tuple[Any, LoraConfig]]) -> Params:
        """The adapters stacked over the prepared weights, placed as the step splits them."""
        for name in adapters:
            if not isinstance(name, str) or not name:
                raise ValueError(f"adapter names must be non-empty strings, got {name!r}")
        stack = multi_lora.stack_adapters(self.weights.params, list(adapters.values()),
                                          names=list(adapters))
        if is_split(self.mesh):
            specs = step_lib.adapter_specs(self.config, self.mesh, stack, self.weights.out_first)
            return jax.device_put(stack, jax.tree.map(
                lambda s: NamedSharding(self.mesh, s), specs,
                is_leaf=lambda x: isinstance(x, P)))
        return jax.device_put(stack, jax.devices()[0])

    def update_weights(self, weights_or_params: DecodeWeights | Params) -> None:
        """Replaces the weights with ones of the same shapes, dtypes and placement (a trainer's
        new policy), so no step program compiles again; empties the prefix cache.

        Raises:
          RuntimeError: the engine is not idle. ValueError: weights of another layout.
        """
        if not self.idle:
            raise RuntimeError("update_weights needs an idle engine (requests are in flight)")
        from transformer_jax.serving.refresh import refreshed

        self.weights = refreshed(self.weights, weights_or_params)
        self.scheduler.prefix.clear()

    # Thread-safe requests --------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                    on_token: TokenCallback | None = None) -> int:
        """Queues a request (callable from any thread; it joins at the next step).

        Args:
          prompt_ids: the prompt's token ids (non-empty, in [0, V)).
          params: its ``SamplingParams`` (default greedy, 16 tokens).
          on_token: called with each ``TokenEvent`` on the thread running ``step``.

        Returns:
          The request's id.

        Raises:
          ValueError: for a bad prompt or setting (naming it), or a request that can never
            fit (the model's context or the whole pool).
          TypeError: for ``params`` that are not a ``SamplingParams``.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        (prompt,) = validate_prompts([prompt_ids], self.config.vocab_size)
        params.validate(self.config.vocab_size)
        self.check_fits(len(prompt), params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer (Engine(tokenizer=...))")
        req = Request.new(-1, prompt, params, on_token)
        if params.adapter is not None:
            if params.adapter not in self.adapter_names:
                raise ValueError(f"adapter {params.adapter!r} is not loaded; the engine has "
                                 f"{list(self.adapter_names) or 'none'}")
            req.adapter = self.adapter_names.index(params.adapter) + 1
        if params.grammar is not None:
            req.matcher = self._grammar_tokenizer().matcher(params.grammar)
        if params.speculative is not None:
            self.speculation.admit(req)
        if self.tokenizer is not None:
            req.text = TextStream(self.tokenizer, req.tokens, params.stop,
                                  params.stop_token_ids)
        with self._lock:
            req.id = rid = next(self._ids)
            self._pending.append(("add", req))
        return rid

    def cancel(self, request_id: int) -> None:
        """Cancels a request (from any thread; applied before the next step): its consumer
        gets a last event, reason ``"cancelled"``. Unknown or finished ids are ignored."""
        with self._lock:
            self._pending.append(("cancel", request_id))

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Raises ValueError unless a request of this size can ever be served."""
        total = prompt_len + max_tokens
        if total > self.config.max_seq_len:
            raise ValueError(f"the request needs {total} positions (prompt {prompt_len} + "
                             f"max_tokens {max_tokens}), more than the model's max_seq_len "
                             f"{self.config.max_seq_len}")
        # The last new token is never written into the cache.
        pages = pages_for(total - 1, self.page_size)
        capacity = self.scheduler.pool.capacity
        if pages > capacity:
            raise ValueError(f"the request needs {pages} pages of {self.page_size} positions "
                             f"(prompt {prompt_len} + max_tokens {max_tokens}), more than the "
                             f"whole pool's {capacity} pages")

    # Steps -----------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """No request waiting, prefilling or running, and none queued to be added."""
        with self._lock:
            return not self._pending and self.scheduler.idle

    def step(self) -> list[TokenEvent]:
        """Applies the queued adds and cancels, runs one step and delivers its tokens; returns
        the events of this step (empty when there was nothing to run)."""
        return [event for _, event in self._step()]

    def _step(self) -> list[tuple[Request, TokenEvent]]:
        clock = self.step_clock = StepClock()  # the phases' laps (``step_times``)
        delivered = self._deliver(clock.lap("schedule", self._apply_pending()))
        sched = self.scheduler
        if self.overlap.step(clock, delivered):  # a step dispatched ahead, the last one read
            return delivered
        if (events := self.multistep.round(clock)) is not None:  # several decode steps
            return delivered + events
        plan = clock.lap("schedule", sched.schedule())
        if plan is None:
            return delivered
        decode, prefill, rows, sampler = sched.inputs(plan, self.config.vocab_size,
                                                      slot=self._rings is not None,
                                                      adapters=self._adapters is not None)
        b = sched.num_slots
        if self.speculation.draft is not None:  # the draft's pages follow the pool's
            self.speculation.draft.mirror(plan, prefill, sched)
        clock.lap("inputs")
        # The chunk, then the decode rows, both dispatched before either result is read.
        # Forward and sampling are two programs each with grammar rows or forks.
        verify, started = None, time.perf_counter()
        if plan.forks or sched.has_grammar(plan):
            chunk_logits = None if prefill is None else self._forward(None, prefill)
            if plan.copies:  # the forks' partial pages, before any step writes past the prompt
                self._k, self._v = step_lib.copy_pages_jit(
                    self._k, self._v, *step_lib.padded(*np.asarray(plan.copies, np.int32).T))
            logits = clock.lap("dispatch", self._forward(decode, None) if plan.decodes else None)
            rows = rows.replace(allowed=sched.grammar_masks(plan, self.config.vocab_size))
            clock.lap("inputs")
            chunk = None if prefill is None else step_lib.sample_from_jit(
                chunk_logits, sched.sources(plan),
                step_lib.row_slice(rows, b, b + plan.sample_rows), sampler)
            rows_out = None if logits is None else step_lib.sample_jit(
                logits, step_lib.row_slice(rows, 0, b), sampler)
        else:
            chunk = None if prefill is None else self.speculation.prefill(
                plan, prefill, step_lib.row_slice(rows, b, b + plan.sample_rows), sampler)
            started = time.perf_counter()  # the decode rows' time, after the chunk's dispatch
            verify = self.speculation.dispatch(plan, rows, sampler) if plan.decodes else None
            rows_out = (self._run(decode, None, step_lib.row_slice(rows, 0, b), sampler)
                        if plan.decodes and verify is None else None)
        clock.lap("dispatch")
        if chunk is not None:
            tokens, logprobs = clock.lap("device", jax.device_get(chunk))
            delivered += self._deliver(sched.commit_prefill(plan, tokens, logprobs))
        if verify is not None:
            delivered += self.speculation.finish(verify, self._deliver, chunk is not None)
        if rows_out is not None:
            tokens, logprobs = clock.lap("device", jax.device_get(rows_out))
            if any(r.speculation is not None for r in plan.decodes):  # for its choice
                self.speculation.plain_step(plan, tokens, time.perf_counter() - started,
                                            chunk is not None, sampler)
            delivered += self._deliver(sched.commit_decodes(plan.decodes, tokens, logprobs))
        self.steps += 1
        self.step_times.record(clock, prefill=chunk is not None)
        return delivered

    def _deliver(self, events: list[tuple[Request, TokenEvent]]
                 ) -> list[tuple[Request, TokenEvent]]:
        """Gives each event its text (with a tokenizer) and to its request's consumer; forgets
        finished requests."""
        self.step_clock.lap("commit")
        if self.tokenizer is not None:
            events = [(req, with_text(req, event, self.scheduler.cancel))
                      for req, event in events]
        for req, event in events:
            if req.state == State.FINISHED:
                self._requests.pop(req.id, None)
            if req.on_token is not None:
                req.on_token(event)
        self.step_clock.lap("deliver")
        return events

    def _grammar_tokenizer(self) -> Any:
        """The ``grammar.GrammarTokenizer`` of the engine's tokenizer (built once)."""
        if self.tokenizer is None:
            raise ValueError("a grammar (structured outputs) needs the engine's tokenizer "
                             "(Engine(tokenizer=...))")
        if self._grammars is None:
            from transformer_jax.serving.grammar import GrammarTokenizer

            self._grammars = GrammarTokenizer(self.tokenizer, self.config.vocab_size)
        return self._grammars

    def _run(self, decode: step_lib.DecodeRows | None, prefill: step_lib.PrefillChunk | None,
             rows: step_lib.RowSampling, sampler: step_lib.Sampler) -> tuple[Any, Any]:
        """Runs one step program on the engine's pages; returns its [R] tokens and logprobs."""
        if decode is not None and not is_split(self.mesh):  # a lagged step's: one program
            decode = decode.replace(tokens=jax.device_put(decode.tokens, jax.devices()[0]))
        self._k, self._v, tokens, logprobs, self._rings = step_lib.step_jit(
            self.config, self.weights.params, self._k, self._v, decode, prefill, rows,
            sampler=sampler, view=self.view, mesh=self.mesh, quant=self.weights.quant,
            rings=self._rings, adapters=self._adapters)
        return tokens, logprobs

    def _forward(self, decode: step_lib.DecodeRows | None,
                 prefill: step_lib.PrefillChunk | None) -> jax.Array:
        """Runs one step's forward on the engine's pages; returns its [R, V] logits."""
        self._k, self._v, logits, self._rings = step_lib.forward_jit(
            self.config, self.weights.params, self._k, self._v, decode, prefill,
            view=self.view, mesh=self.mesh,
            quant=self.weights.quant, rings=self._rings, adapters=self._adapters)
        return logits

    def compile(self, structured: bool = False, speculative: int = 0) -> int:
        """Compiles the step programs a greedy load runs by running each once on idle rows:
        the decode rows and every chunk shape at every page-table width. With ``structured``,
        also the programs of greedy steps with grammar rows; with ``speculative`` k, the
        verify programs of up to k proposals. Sampling steps compile on first use.

        Returns:
          The number of step shapes run.

        Raises:
          ValueError: ``speculative`` on an engine that cannot speculate.
        """
        if speculative:
            self.speculation.check_engine()
        shapes = self.scheduler.idle_inputs(self._rings is not None, self._adapters is not None)
        for decode_rows, chunk in shapes:
            n = len(decode_rows.tokens) if chunk is None else len(chunk.start)
            sampling, _ = row_sampling([None] * n, self.config.vocab_size)  # greedy, idle
            jax.block_until_ready(self._run(decode_rows, chunk, sampling, step_lib.Sampler()))
            if structured:
                masks = np.full((n, self._grammar_tokenizer().words), -1, np.int32)
                jax.block_until_ready(step_lib.sample_jit(
                    self._forward(decode_rows, chunk), sampling.replace(allowed=masks),
                    step_lib.Sampler()))
        return len(shapes) + (self.speculation.compile(speculative) if speculative else 0)

    def _apply_pending(self) -> list[tuple[Request, TokenEvent]]:
        with self._lock:
            pending, self._pending = self._pending, []
        events = []
        for kind, item in pending:
            if kind == "add":
                self._requests[item.id] = item
                self.scheduler.submit(item)
                continue
            req = self._requests.pop(item, None)
            if req is None or req.state == State.FINISHED:
                continue
            self.scheduler.cancel(req)
            events.append((req, TokenEvent(req.id, None, req.num_new,
                                           finish_reason="cancelled")))
        return events

    def run_until_idle(self, max_steps: int | None = None) -> dict[int, Completion]:
        """Steps until no request is left (or ``max_steps`` steps ran).

        Returns:
          {request id: ``Completion``} of the requests that finished meanwhile.
        """
        done: dict[int, Completion] = {}
        steps = 0
        while not self.idle and (max_steps is None or steps < max_steps):
            ran = self.steps
            for req, event in self._step():
                if event.finish_reason is not None:
                    done[req.id] = req.completion()
            if self.steps == ran and not self.scheduler.idle:  # the scheduler makes progress
                raise RuntimeError(f"the engine cannot make progress: "
                                   f"{self.scheduler.describe()}")
            steps += 1
        return done

    # Introspection ---------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def pages_in_use(self) -> int:
        """Pages held by requests (parked prefix pages not counted)."""
        return len(self.scheduler.pool.held())

    def check_no_leaks(self) -> None:
        """AssertionError unless an idle engine holds no page or slot (``Scheduler``'s)."""
        self.scheduler.check_no_leaks()


