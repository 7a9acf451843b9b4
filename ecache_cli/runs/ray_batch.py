"""``ecache generate --input FILE --ray N``: the batches of ``generate --input`` decoded by N Ray actors.

The extra ``ray`` (``pip install 'ecache[ray]'``) brings Ray Data. This process reads and checks
every ``--input`` record, plans a resumed ``--output`` and writes the records exactly as
``runs/generate.py`` does (the same ``_Job``: record order, one flush per record, ``--resume``); only
the decoding moves. The records to decode are cut into batches of ``--batch-size`` in input order,
as one process cuts them, and a Ray Dataset of those batches goes through ``map_batches`` on a pool
of N actors (each loads the model once and reserves ``--threads`` CPU cores, default 1, or one GPU
under a CUDA ``--device``). The dataset
keeps its input order (``DataContext.execution_options.preserve_order``), so this process receives
the batches in order as they finish and writes each record as soon as those before it are written.

Each record is the one a single process writes: an actor decodes a batch with ``_Job._decode``, and
sampling is batch-invariant (record i's random stream is derived from ``--seed`` and i alone), so
the text, token ids and settings equal plain ``generate``'s; only the per-run measurements (``stats``
times, ``memory``) are the actor's.

Ray: a running cluster when ``$RAY_ADDRESS`` names one (``ray start --head`` on this machine, or a
remote one), else a local instance started here and shut down at the end; an instance the caller
already started (``ray.is_initialized()``) is used and left running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import pickle
import warnings
from typing import Callable

from ..errors import EcacheError
from .generate import GenerateOptions, _Job

#: The one-line fix when Ray is missing (README "Scaling out").
INSTALL = "pip install 'ecache[ray]' (from a checkout: pip install -e \".[ray]\")"


def require_ray(what: str):
    """``import ray``, or EcacheError (exit 1) naming ``what`` needs the ``ray`` extra and how to install it."""
    try:
        import ray
    except ImportError:
        raise EcacheError(f"{what} needs Ray, the 'ray' extra: {INSTALL}") from None
    return ray


def check_ray_options(opts: GenerateOptions, replicas: int, ranks) -> None:
    """``generate --ray N``: N ≥ 1, an ``--input`` FILE (all records read
    before the batches are cut), no live view (the canvas is on an actor) and no launcher ranks
    (one process drives the actors); one-line UsageErrors. Then Ray itself (:func:`require_ray`)."""
    from ..errors import UsageError

    if replicas < 1:
        raise UsageError(f"--ray {replicas} must be ≥ 1 (the number of Ray actors, each loading the model)")
    if opts.input_file is None or str(opts.input_file) == "-":
        raise UsageError("--ray decodes the records of --input FILE; pass --input FILE (a JSONL file, not stdin)")
    if opts.watch or opts.stream:
        raise UsageError(f"--{'watch' if opts.watch else 'stream'} shows the canvas of this process; under --ray the "
                         "actors decode: leave it out")
    if ranks.active:
        raise UsageError(f"--ray and {ranks.world_size} launcher ranks both spread the batches; use one: drop --ray, "
                         "or run one process")
    require_ray("generate --ray")


def replica_device(device: str | None) -> str | None:
    """The ``--device`` a replica loads on: ``cuda`` for any CUDA device (Ray gives each replica its own
    GPU, which it sees as ``cuda:0``), else ``device`` unchanged."""
    return "cuda" if device is not None and device.startswith("cuda") else device


def resources(device: str | None, cores: int) -> dict:
    """The Ray resources of one replica: one GPU when ``device`` names CUDA (Ray picks the GPU and the
    replica sees it as ``cuda:0``), else ``cores`` CPUs."""
    if device is not None and device.startswith("cuda"):
        return {"num_cpus": 1, "num_gpus": 1}
    return {"num_cpus": cores, "num_gpus": 0}


@contextlib.contextmanager
def ray_session(ray):
    """Ray connected for the block (module docstring: ``$RAY_ADDRESS``, else a local instance), and
    shut down at its end if it was started here."""
    started = not ray.is_initialized()
    if started:  # Ray's own INFO and WARNING lines (start-up, token auth, progress) stay off stderr
        ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


class _Decoder:
    """A Ray Data actor: loads the model once (``load()``, e.g. ``runtime.load_for_command`` bound to
    the command's flags, returning ``(lm, _)``), then decodes the batches it is given. A batch row holds
    ``items``: a pickled list of ``gen_input.Item`` (one ``--batch-size`` batch); the reply's ``records``
    is that batch's records as a JSON list."""

    def __init__(self, load: Callable, settings, opts: GenerateOptions):
        from ..distributed import DistEnv

        lm = load()[0]
        self.job = _Job(lm, settings, opts, None, DistEnv())

    def __call__(self, batch: dict) -> dict:
        out = [json.dumps(self.job._decode(pickle.loads(p), _NoProgress()), ensure_ascii=False)
               for p in batch["items"]]
        return {"records": out}


class _NoProgress:
    """The per-step progress an actor does not show (this process counts finished batches)."""

    def step(self, *args) -> None:
        pass


class RayJob(_Job):
    """A generate run whose batches are decoded by a pool of Ray actors (module docstring)."""

    #: set by :func:`run` before the run starts: (load, replicas, per-replica resources)
    pool: tuple = ()

    def _feed(self, source, reporter):
        """Queue every item (``--input`` items: a list, all checked), cut the ones to decode into
        batches in input order, and write records as the dataset yields the batches, in order."""
        size = self.opts.batch_size
        todo = []
        for it in source:
            if it.index in self.skip:
                continue
            self.queue.append(it)
            if it.error is None and it.index not in self.keep:
                todo.append(it)
        self._emit()  # records kept from --output or invalid ones ahead of the first batch
        batches = [todo[i:i + size] for i in range(0, len(todo), size)]
        if batches:
            for records in self._stream(batches):
                got = json.loads(records)
                for rec in got:
                    self.results[rec["index"]] = rec
                    self.decoded.append(rec)
                reporter.advance(len(got))
                self._emit()
        self._emit()
        return None

    def _stream(self, batches: list[list]):
        """The records of each batch (a JSON list), in input order, from the actor pool."""
        import ray

        load, replicas, res = self.pool
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False  # this process reports records done (gen_progress.py)
        ctx.print_on_execution_start = False
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        worker_opts = dataclasses.replace(self.opts, quiet=True, stream=False, watch=False, output=None, resume=False)
        rows = [{"items": pickle.dumps(b)} for b in batches]
        ds = ray.data.from_items(rows, override_num_blocks=len(rows))
        pool = ray.data.ActorPoolStrategy(size=min(replicas, len(rows)))
        # max_restarts=0: an actor that dies fails the run (the records written stay, --resume continues);
        # Ray 2.60 takes it only among the remote args it calls deprecated
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`ray_remote_args` is deprecated")
            ds = ds.map_batches(_Decoder, fn_constructor_args=(load, self.settings, worker_opts), batch_size=1,
                                compute=pool, max_restarts=0, **res)
        for row in ds.iter_rows():
            yield row["records"]


def run(lm, settings, opts: GenerateOptions, out, err_console, load: Callable, replicas: int, res: dict) -> int:
    """``runs.generate.run`` with the batches decoded by ``replicas`` Ray actors of resources ``res``
    (:func:`resources`), each loading the model with ``load`` (a picklable callable returning
    ``(lm, _)``). ``lm``: this process's model, for reading and checking the input (tokenizer, limits).
    Returns the number of records decoded. Raises EcacheError when Ray is missing (:func:`require_ray`)."""
    from . import generate

    ray = require_ray("generate --ray")

    class Job(RayJob):
        pool = (load, replicas, res)

    with ray_session(ray):
        return generate.run(lm, settings, opts, out, err_console, job_cls=Job)
