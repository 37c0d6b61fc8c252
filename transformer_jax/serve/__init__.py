"""An OpenAI-compatible HTTP server on the serving engine: ``transformer-jax serve``.

Modules:
  cli          the command line: load, build and compile the engine, run uvicorn, drain
  app          the FastAPI app: routes, auth, error objects, server-sent events
  protocol     the OpenAI request models (strict, naming the field) and ``APIError``
  completions  request -> prompt ids and ``SamplingParams``; events -> response objects
  runner       the engine on its own thread; each request's events into the event loop
  metrics      the Prometheus metrics of ``/metrics``

Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client).
"""
