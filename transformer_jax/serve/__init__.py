"""An OpenAI-compatible HTTP server on the serving engine: ``transformer-jax serve``.

Modules:
  cli          the command line (``cli/serve.py``): bind, load, compile, serve, drain
  server       the listening socket (bound before loading) and uvicorn's draining server
  app          the FastAPI app: routes, auth, error objects, server-sent events
  limits       request bodies read first: size (413) and time (408) limits
  protocol     the OpenAI request models (strict, naming the field) and ``APIError``
  completions  request -> prompt ids and ``SamplingParams``; events -> response objects
  runner       the engine on its own thread; each request's events into the event loop
  metrics      the Prometheus metrics of ``/metrics``

Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client).
"""
