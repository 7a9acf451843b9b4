"""``ecache serve``: an OpenAI-compatible HTTP server over the engine with step-level continuous batching.

- ``protocol.py``: the request bodies (OpenAI fields plus the decoding extensions), their checks, the
  error shape, and how a request becomes a :class:`~ecache_cli.serve.scheduler.Job` (token ids, decode
  settings, the batching group it may share a run with).
- ``scheduler.py``: the one engine thread that owns the model: the queue, the runs of each group,
  rows joining and leaving between denoising steps, stop strings, cancellation and timeouts.
- ``metrics.py``: the Prometheus metrics of ``GET /metrics``.
- ``app.py``: the FastAPI routes, server-sent events, the API key, body limits and the uvicorn server
  with its SIGTERM handling.

FastAPI, uvicorn and prometheus-client come with the optional extra ``serve``
(``pip install -e ".[serve]"``); nothing here is imported by the other subcommands.
"""
