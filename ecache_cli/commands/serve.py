"""``ecache serve``: an OpenAI-compatible HTTP server with step-level continuous batching."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .. import options as o

S = "Server"


def serve_cmd(
    model: o.Model = "tiny", device: o.Device = "auto", dtype: o.Dtype = "auto", threads: o.Threads = None, compile_step: o.Compile = None, force: o.Force = False,
    quantize: o.Quantize = None, group_size: o.GroupSize = None,
    host: Annotated[str, typer.Option(help="Address to listen on: 127.0.0.1 this machine only; 0.0.0.0 every interface (then pass --api-key).", rich_help_panel=S)] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free one, printed at start, also under --quiet).", rich_help_panel=S)] = 8000,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="ECACHE_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/* and /api/* \\[default: none].", rich_help_panel=S)] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", help="Rows decoded at once, over every batching group.", rich_help_panel=S)] = 32,
    max_queue: Annotated[int, typer.Option("--max-queue", help="Requests waiting for a row; more get 429 with Retry-After.", rich_help_panel=S)] = 256,
    batching: Annotated[str, typer.Option(help="continuous: requests join and leave running batches between denoising steps, as --admission decides; static: an idle engine takes up to --max-batch queued requests and runs them to the end (--admission fcfs).", rich_help_panel=S)] = "continuous",
    admission: Annotated[Optional[str], typer.Option(help="When a queued request joins the running rows: always (at the next step while there is room); fcfs (batches in arrival order: --batching static); auto (when the step-cost model fitted to this machine says it lowers the expected completion times; docs/SERVING.md) \\[default: auto].", rich_help_panel=S)] = None,
    prefix_cache: Annotated[Optional[bool], typer.Option("--prefix-cache/--no-prefix-cache", help="Keep prompts' keys and values across requests and reuse them for a prompt that starts with a stored prefix (docs/SERVING.md, 'Prefix reuse'): exact on block-diffusion models, an approximation on bidirectional ones \\[default: on for block diffusion, off otherwise].", rich_help_panel=S)] = None,
    prefix_cache_mb: Annotated[Optional[int], typer.Option("--prefix-cache-mb", help="Most MiB the reused keys and values take (least recently used evicted first) \\[default: 1024].", rich_help_panel=S)] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="The model id clients name and /v1/models lists \\[default: --model].", rich_help_panel=S)] = None,
    request_timeout: Annotated[Optional[float], typer.Option("--request-timeout", help="Seconds from arrival after which a request ends with finish_reason 'timeout' (its text so far) \\[default: none].", rich_help_panel=S)] = None,
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", help="Largest request body (413 above).", rich_help_panel=S)] = 1 << 20,
    max_prompt_tokens: Annotated[Optional[int], typer.Option("--max-prompt-tokens", help="Longest prompt in tokens, after the chat template (400 above) \\[default: the model's positions less --gen-length].", rich_help_panel=S)] = None,
    shutdown_grace: Annotated[float, typer.Option("--shutdown-grace", help="Seconds SIGTERM leaves running requests before ending them with finish_reason 'shutdown'.", rich_help_panel=S)] = 30.0,
    access_log: Annotated[bool, typer.Option("--access-log", help="Log every HTTP request on stderr \\[default: off].", rich_help_panel=S)] = False,
    gen_length: o.GenLength = None, block_length: o.BlockLength = None, steps: o.Steps = None,
    temperature: o.Temperature = None, top_k: o.TopK = None, top_p: o.TopP = None, remasking: o.Remasking = None,
    threshold: o.Threshold = None, factor: o.Factor = None, ban_eos: o.BanEos = None, low_eos_confidence: o.LowEos = None,
    early_exit: o.EarlyExit = None, schedule: o.Schedule = None, compat: o.Compat = None, alg_temp: o.AlgTemp = None,
    edit_threshold: o.EditThreshold = None,
    cache: o.Cache = None, tau: o.Tau = None, recent_k: o.RecentK = None, signal: o.Signal = None,
    block_refresh: o.BlockRefresh = None, refresh_every: o.RefreshEvery = None, profile: o.Profile = None,
    seed: Annotated[Optional[int], typer.Option(help="Seeds of requests without a 'seed' field drawn from this stream, so a session replays (a request's own seed is as ecache generate --seed) \\[default: random].", rich_help_panel=o.D)] = None,
    quiet: o.Quiet = False,
    ray: Annotated[bool, typer.Option("--ray", help="Serve the same app from Ray Serve replicas, each loading the model (the 'ray' extra; $RAY_ADDRESS: a running cluster; docs/SERVING.md) \\[default: off: one process].", rich_help_panel=o.R)] = False,
    replicas: Annotated[str, typer.Option("--replicas", help="With --ray: the number of replicas, or auto (Ray Serve's autoscaling on requests in flight per replica, target --max-batch, up to what the cluster holds).", rich_help_panel=o.R)] = "1",
    cores_per_replica: o.CoresPerReplica = 1,
):
    """Serve the model over an OpenAI-compatible HTTP API (needs the extra: pip install -e ".\\[serve]").

    The decode and cache flags are the server's defaults; a request may override policy, tau, threshold,
    block_length and steps in its body, and max_tokens sets its canvas (docs/SERVING.md lists every
    field). Endpoints: /v1/models, /v1/completions, /v1/chat/completions; Ollama's /api/tags,
    /api/version, /api/generate, /api/chat; /health, /health/live, /health/ready, /metrics.

    Examples: [cyan]ecache serve[/] · [cyan]ecache serve --model llada-8b --device cuda:0 --host 0.0.0.0 --api-key $KEY[/]
    """
    from ..errors import EcacheError, UsageError

    # the numeric flags' ranges (--max-batch, --port, --request-timeout, ...) are checked before this body
    # runs, in the words every command uses (config.option_ranges; cli.handle_errors)
    if batching not in ("continuous", "static"):
        raise UsageError(f"--batching {batching!r} is not a batching mode; use one of continuous, static")
    if admission is not None and admission not in ("always", "fcfs", "auto"):
        raise UsageError(f"--admission {admission!r} is not an admission rule; use one of always, fcfs, auto")
    if batching == "static" and admission not in (None, "fcfs"):
        raise UsageError(f"--batching static is --admission fcfs; drop --admission {admission} or --batching static")
    admission = "fcfs" if batching == "static" else admission or "auto"
    if served_model_name is not None and not served_model_name.strip():
        raise UsageError("--served-model-name is empty; give a name, or leave it out (the --model name)")
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key is empty; give a key, or leave it (and $ECACHE_API_KEY) out")
    if not ray and (replicas != "1" or cores_per_replica != 1):
        raise UsageError(f"--{'replicas' if replicas != '1' else 'cores-per-replica'} applies to Ray replicas; add --ray")
    if replicas != "auto" and not (replicas.isdigit() and int(replicas) >= 1):
        raise UsageError(f"--replicas {replicas!r}: give a number ≥ 1 or auto")
    if ray:
        from ..runs.ray_batch import require_ray

        require_ray("serve --ray")
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise EcacheError(f"ecache serve needs the 'serve' extra ({e.name} is missing): pip install -e \".[serve]\" "
                          "(or pip install 'ecache[serve]')") from None
    from ..console import err, warn
    from ..runs.models import check_quantize, check_start
    from ..runs.settings import not_used_by, resolve_settings, warn_model_rules, warn_unused_cache_flags
    from ..runtime import inspect_for_command, load_for_command
    from ..serve.app import ServeOptions, bind, create_app, run_server

    check_start(model, device, dtype, quantize=quantize)  # before the settings, as every model command
    flags = o.cache_flags(cache, tau, recent_k, signal, block_refresh, refresh_every)
    settings = resolve_settings(
        model, o.decode_flags(gen_length, block_length, steps, temperature, top_k, top_p, remasking, threshold, factor,
                              ban_eos, low_eos_confidence, early_exit, schedule, compat, alg_temp, edit_threshold),
        flags, profile=profile, compile=compile_step, quantize=quantize, group_size=group_size)
    check_quantize(settings, device, dtype)  # a profile's format this machine cannot run, named with the file
    sock = bind(host, port)  # before the model loads: a busy port fails at once
    # --quiet: no start-up or stop lines; warnings and errors stay, and so does the address when --port 0
    # picked it (printed nowhere else)
    say = (lambda *a, **k: None) if quiet else err.print
    say(settings.describe(model), markup=False, highlight=False)
    warn_unused_cache_flags([settings.cache], flags, not_used_by(settings))  # after the "using model" line
    if prefix_cache is False and prefix_cache_mb is not None:
        warn("--prefix-cache-mb is used only with --prefix-cache; ignored")
    mb_given = prefix_cache_mb is not None
    prefix_cache_mb = ServeOptions.prefix_cache_mb if prefix_cache_mb is None else prefix_cache_mb  # 1024
    name = served_model_name or model
    opts = ServeOptions(model_name=name, api_key=api_key, max_batch=max_batch, max_queue=max_queue, admission=admission,
                        request_timeout=request_timeout, max_body_bytes=max_body_bytes,
                        max_prompt_tokens=0, shutdown_grace=shutdown_grace,  # the prompt limit: once the model loads
                        seed=seed, prefix_cache=prefix_cache, prefix_cache_mb=prefix_cache_mb)
    if ray:  # the replicas load the model and listen (Ray Serve's proxy): this process only starts them
        from functools import partial

        from ..runs.ray_batch import replica_device, resources
        from ..serve.ray_serve import serve_ray

        port_ = sock.getsockname()[1]  # a free one under --port 0; Ray Serve's proxy binds it
        sock.close()
        load = partial(load_for_command, model, replica_device(device), dtype, threads or cores_per_replica,
                       compile=settings.compile, force=force, quantize=settings.quantization)
        # the pre-deploy check reads the checkpoint's config and tokenizer, never its weights
        inspect = partial(inspect_for_command, model, replica_device(device), dtype, compile=settings.compile,
                          force=force, quantize=settings.quantization)
        check = partial(prompt_limit, settings=settings, max_prompt_tokens=max_prompt_tokens)
        serve_ray(load, inspect, check, settings, opts, replicas, resources(device, cores_per_replica), host, port_,
                  say=say, say_url=err.print if port == 0 else say)
        return
    lm, _ = load_for_command(model, device, dtype, threads, compile=settings.compile, force=force, quantize=settings.quantization)
    opts.max_prompt_tokens = prompt_limit(lm, settings, max_prompt_tokens)  # before listening
    warn_model_rules(settings, lm.spec.sampler)  # the flags the model's rules ignore, as every command warns
    if prefix_cache is None and mb_given and not lm.spec.block_causal:
        warn("--prefix-cache-mb is used only with --prefix-cache (off by default on bidirectional models); ignored")
    app = create_app(lm, settings, opts)
    where, port_ = sock.getsockname()[:2]
    (err.print if port == 0 else say)(
        f"ecache serve: model {name if name == model else f'{name} (--model {model})'} on {lm.device}, "
        f"--admission {admission}, --max-batch {max_batch}, "
        f"{_prefix_line(prefix_cache, lm.spec.block_causal, prefix_cache_mb)}; listening "
        f"on http://{_url_host(where)}:{port_} (OpenAI API under /v1)", markup=False, highlight=False)
    loopback = _is_loopback(where)
    if api_key is None and loopback:
        say("no --api-key: listening on loopback only, so only this machine can reach the server; pass "
            "--api-key (or set ECACHE_API_KEY) and --host 0.0.0.0 to serve other machines",
            markup=False, highlight=False)
    elif api_key is None:
        warn(f"no --api-key and --host {host}: anyone who can reach port {port_} can use the model; pass --api-key "
             "(or set ECACHE_API_KEY)")
    run_server(app, sock, access_log=access_log)
    say("ecache serve: stopped", markup=False, highlight=False)


def prompt_limit(lm, settings, max_prompt_tokens: int | None) -> int:
    """The checks made once the model is loaded (``lm``: a ``LoadedModel``, or the ``ModelMeta`` of
    ``models.loader.inspect_model``: only its ``spec`` is read), before listening: the settings fit the model
    (``runs.settings.check_settings_fit``: what every request's run would refuse) and the prompt limit,
    ``--max-prompt-tokens`` or by default the positions ``--gen-length`` leaves. Returns that limit;
    raises UsageError (exit 2) naming the flag to change."""
    from ..errors import UsageError
    from ..runs.settings import check_settings_fit, no_room

    check_settings_fit(settings, lm.spec)
    room = lm.spec.max_positions - settings.decode.gen_length
    if room < 1:
        raise UsageError(no_room(lm.spec, settings.decode.gen_length, settings.decode.block_length))
    if max_prompt_tokens is None:
        return room
    if max_prompt_tokens > room:
        raise UsageError(f"--max-prompt-tokens {max_prompt_tokens} + --gen-length {settings.decode.gen_length} exceed "
                         f"the model's {lm.spec.max_positions} positions; use at most {room}")
    return max_prompt_tokens


def _prefix_line(on: bool | None, exact: bool, mb: int) -> str:
    """The start line's words on prefix reuse (``--prefix-cache``'s default: on where it is exact)."""
    if not (exact if on is None else on):
        return "--no-prefix-cache"
    kind = "exact" if exact else "approximate: a shared prefix's keys and values come from another request's canvas"
    return f"--prefix-cache ({kind}; at most {mb} MiB)"


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
