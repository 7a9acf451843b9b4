"""``ecache serve``: an OpenAI- and Ollama-compatible HTTP server over the engine with step-level continuous batching.

- ``protocol.py``: the request bodies (OpenAI fields plus the decoding extensions), their checks, the
  error shape, and how a request becomes a :class:`~ecache_cli.serve.scheduler.Job` (token ids, decode
  settings, the batching group it may share a run with).
- ``scheduler.py``: the one engine thread that owns the model: the warm-up, the queue, the runs of
  each group, rows joining and leaving between denoising steps, stop strings, cancellation and timeouts.
- ``admission.py``: the step-cost model and the ``--admission`` rules (always, fcfs, auto).
- ``metrics.py``: the Prometheus metrics of ``GET /metrics``.
- ``handling.py``: what every generating route does (key, body, job, queue, events) and the options.
- ``app.py``: the app, the OpenAI, health and metrics routes, server-sent events, x-request-id, and the
  uvicorn server with its SIGTERM handling.
- ``ollama.py``: Ollama's routes, translated into OpenAI requests.
- ``ray_serve.py``: ``--ray``: the same app as Ray Serve replicas (the optional extra ``ray``).

FastAPI, uvicorn and prometheus-client come with the optional extra ``serve``
(``pip install -e ".[serve]"``); nothing here is imported by the other subcommands.
"""
