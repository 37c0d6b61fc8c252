"""An OpenAI-compatible HTTP server on the serving engine: ``transformer-jax serve``.

A request flows ``limits`` (its body, whole) -> ``app`` (routes, auth) -> ``protocol``
(validation) -> ``completions`` (prompt ids, ``SamplingParams``) -> ``runner`` (the engine's
thread) -> ``response`` (OpenAI objects, SSE chunks; ``tools``, ``reasoning``). ``server``
binds the socket and drains on SIGTERM; ``metrics`` serves ``/metrics``. Needs the ``serve``
extra.
"""
