"""``ecache serve --ray``: the same FastAPI app as ``ecache serve``, as a Ray Serve deployment of replicas.

The extra ``ray`` (``pip install 'ecache[ray]'``) brings Ray Serve. Each replica is a Ray actor that
loads the model once and builds the app of ``serve/app.py`` over it (``create_app``: the same routes,
scheduler, admission, limits and metrics), wrapped with ``serve.ingress``; Ray Serve's proxy listens
on ``--host``:``--port`` and routes each request to a replica (to the one with fewer requests in
flight of two picked at random). A replica reserves ``--cores-per-replica`` CPUs, or one GPU under a
CUDA ``--device`` (Ray gives each replica its own GPU, seen as ``cuda:0``).

Replicas: a fixed number, or ``auto``: Ray Serve's autoscaling on queue depth, from one replica up to
what the cluster holds, adding one when the requests in flight per replica
(``ongoing requests``, those running plus those queued in the replica) stay above the target:
``--max-batch``, the rows one replica decodes at once. Each replica takes up to ``--max-batch`` +
``--max-queue`` requests (``max_ongoing_requests``); beyond that the proxy holds them, as a single
server's queue would.

Differences from one server: ``/metrics`` and ``/health`` answer for the replica that serves the
request; SIGTERM and SIGINT on the command delete the deployment (each replica's lifespan stops its
engine; Ray waits ``--shutdown-grace`` seconds for running requests).
"""

from __future__ import annotations

import logging
from typing import Callable

from .handling import ServeOptions

#: Ray Serve's name for the deployed application (``serve status``).
APP_NAME = "ecache"


def replica_class():
    """The Ray Serve ingress class of a replica (built when called: ``ray.serve`` is imported only under ``--ray``).

    Its constructor takes ``load`` (a picklable callable returning ``(lm, _)``, e.g.
    ``runtime.load_for_command`` bound to the command's flags), ``settings`` (``runs.settings.Settings``)
    and ``opts`` (:class:`ServeOptions`); Ray Serve then calls ``__serve_build_asgi_app__`` for the app
    and runs its lifespan (the engine thread and its warm-up). ``check_health`` fails once the warm-up
    has failed, so Ray replaces the replica."""
    from ray import serve

    @serve.ingress()
    class EcacheReplica:
        def __init__(self, load: Callable, settings, opts: ServeOptions):
            self.lm = load()[0]
            self.settings, self.opts = settings, opts
            self.served = None

        def __serve_build_asgi_app__(self):
            from .app import create_app

            self.served = create_app(self.lm, self.settings, self.opts)
            return self.served

        def check_health(self):
            sched = self.served.state.scheduler if self.served is not None else None
            if sched is not None and sched.warmup_error is not None:
                raise RuntimeError(f"the engine's warm-up failed: {sched.warmup_error}")

    return EcacheReplica


def deployment_options(replicas: int | str, res: dict, opts: ServeOptions, capacity: int) -> dict:
    """``serve.deployment`` options: ``replicas`` a count, or ``auto`` (autoscaling from 1 to
    ``capacity`` replicas on ongoing requests per replica, target ``opts.max_batch``); ``res``: one
    replica's Ray resources (``runs.ray_batch.resources``)."""
    out = {"ray_actor_options": dict(res), "max_ongoing_requests": opts.max_batch + max(opts.max_queue, 1),
           "graceful_shutdown_timeout_s": opts.shutdown_grace, "health_check_period_s": 10.0}
    if replicas == "auto":
        out["autoscaling_config"] = {"min_replicas": 1, "max_replicas": max(capacity, 1),
                                     "target_ongoing_requests": opts.max_batch}
    else:
        out["num_replicas"] = int(replicas)
    return out


def capacity(ray, res: dict) -> int:
    """How many replicas of resources ``res`` the connected cluster holds (its GPUs, or CPUs / cores)."""
    total = ray.cluster_resources()
    if res.get("num_gpus"):
        return int(total.get("GPU", 0) // res["num_gpus"])
    return int(total.get("CPU", 0) // max(res.get("num_cpus", 1), 1))


def check_capacity(ray, replicas: int | str, res: dict) -> int:
    """The replicas of resources ``res`` the connected cluster holds (:func:`capacity`); EcacheError
    (exit 1) when ``replicas`` (a count) exceeds it, naming the flags to lower."""
    from ..errors import EcacheError

    cap = capacity(ray, res)
    if replicas != "auto" and int(replicas) > cap or cap < 1:
        raise EcacheError(f"--replicas {replicas}: the Ray cluster holds {cap} replica(s) of {_resources_text(res)} "
                          "each; lower --replicas or --cores-per-replica, or add machines to the cluster")
    return cap


def deploy(load: Callable, settings, opts: ServeOptions, replicas: int | str, res: dict, host: str, port: int,
           blocking_timeout_s: float | None = None) -> str:
    """Start Ray Serve's proxy on ``host``:``port`` and deploy the replicas (Ray must be connected:
    ``ray.init``). Returns the URL once every replica has loaded the model and built its app. Raises
    EcacheError when the replicas fail to start (their error in one line) or the cluster cannot hold
    ``replicas`` of ``res``."""
    import ray
    from ray import serve

    from ..errors import EcacheError

    cap = check_capacity(ray, replicas, res)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve's start-up INFO lines stay off stderr
    serve.start(http_options={"host": host, "port": port})
    dep = serve.deployment(replica_class(), name="ecache", **deployment_options(replicas, res, opts, cap))
    try:
        serve.run(dep.bind(load, settings, opts), name=APP_NAME, route_prefix="/")
    except Exception as e:  # a replica's constructor or lifespan failed: Ray's error holds the cause's text
        raise EcacheError(f"the Ray Serve replicas did not start: {_last_line(e)} (the replicas' errors: Ray's "
                          "logs/serve/ folder of the session, e.g. /tmp/ray/session_latest/logs/serve/)") from None
    return f"http://{host}:{port}"


def _last_line(e: BaseException) -> str:
    """The last non-empty line of an exception's text (Ray wraps the replica's traceback in it)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def probe(ray, inspect: Callable, check: Callable, res: dict):
    """Run ``check(meta)`` in a Ray task with one replica's resources ``res`` over what ``inspect``
    finds of the model without loading its weights (``runtime.inspect_for_command``: a ``ModelMeta``,
    with the model's ``spec``), before any replica starts: the checks a single server makes after loading
    (the settings fit the model, limits that need the model's positions), made where the replicas will
    run (their device, dtype and free memory), in seconds and without a model's memory. Returns
    ``check``'s value; an EcacheError that ``inspect`` or ``check`` raises is raised here (exit 1 or 2 as
    usual)."""
    from ..errors import EcacheError

    def run_check():
        try:
            return True, check(inspect())
        except EcacheError as e:
            return False, e

    ok, value = ray.get(ray.remote(run_check).options(**res).remote())
    if not ok:
        raise value
    return value


def shutdown() -> None:
    """Delete the deployment and stop Ray Serve (the replicas' lifespans stop their engines)."""
    from ray import serve

    serve.shutdown()


def serve_ray(load: Callable, inspect: Callable, check: Callable, settings, opts: ServeOptions, replicas: int | str,
              res: dict, host: str, port: int, say: Callable, say_url: Callable) -> None:
    """``ecache serve --ray``, blocking until SIGINT or SIGTERM: connect to Ray (``runs.ray_batch.ray_session``),
    make the checks of a loaded model on what ``inspect`` finds without the weights (:func:`probe` with
    ``check``, which returns the prompt limit),
    deploy (:func:`deploy`), print the address (``say_url``) and wait; then delete the deployment.
    Raises EcacheError as :func:`deploy` and :func:`probe` do."""
    import dataclasses
    import signal
    import threading

    from ..runs.ray_batch import ray_session, require_ray

    ray = require_ray("serve --ray")
    with ray_session(ray):
        check_capacity(ray, replicas, res)  # before the probe
        opts = dataclasses.replace(opts, max_prompt_tokens=probe(ray, inspect, check, res))
        url = deploy(load, settings, opts, replicas, res, host, port)
        try:
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            what = "autoscaled replicas" if replicas == "auto" else f"{replicas} replica(s)"
            say_url(f"ecache serve --ray: model {opts.model_name}, {what} of {_resources_text(res)}, --admission "
                    f"{opts.admission}, --max-batch {opts.max_batch} each; listening on {url} (OpenAI API under /v1)",
                    markup=False, highlight=False)
            while not stop.wait(0.5):
                pass
        finally:
            shutdown()
    say("ecache serve: stopped", markup=False, highlight=False)


def _resources_text(res: dict) -> str:
    return "1 GPU" if res.get("num_gpus") else f"{res['num_cpus']} CPU core(s)"
