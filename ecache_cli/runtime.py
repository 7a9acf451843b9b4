"""Process-wide runtime settings chosen once per command: torch's CPU thread count, then this process's
rank and the model (:func:`load_for_command`).

``--threads N`` (every subcommand; ``$ECACHE_THREADS``) sets ``torch.set_num_threads(N)`` before the
model loads. When it is not given, the embedded model gets :data:`DEFAULT_THREADS`: measured with
``bench/threads.py`` (BENCHMARKS.md, "Threads"), one thread decodes the 1.2M-parameter model 19×
faster than two on the 2-core machine while one other process keeps a core busy, 24× with more load
(OpenMP threads wait for each other at every small operator; no idle-machine measurement yet). Other
models keep torch's own default (one thread per core), which suits their larger matrices.
"""

from __future__ import annotations

from .errors import UsageError

#: Threads for the embedded model when ``--threads`` is not given (measured: bench/threads.py).
DEFAULT_THREADS = 1


def resolve_threads(threads: int | None, model: str | None) -> int | None:
    """The thread count to set: ``threads`` if given, else :data:`DEFAULT_THREADS` for the embedded
    model and None (keep torch's default) for any other.

    A count above the CPUs this process may run on (:func:`available_cpus`) is lowered to that number
    (:func:`set_threads` warns once): more threads than cores only wait for each other, and a huge count
    (``--threads 100000``) would exhaust the machine's process table before torch fails.
    Raises UsageError for a count < 1.
    """
    from .models.loader import EMBEDDED

    if threads is not None:
        if threads < 1:
            raise UsageError(f"--threads {threads} must be ≥ 1 (e.g. --threads 2; $ECACHE_THREADS sets it too)")
        return min(threads, available_cpus())
    return DEFAULT_THREADS if model is None or str(model) in EMBEDDED else None


def available_cpus() -> int:
    """The CPU cores this process may run on: its affinity mask where the OS has one (Linux: a
    container's or ``taskset``'s limit), else ``os.cpu_count()``; at least 1."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def set_threads(threads: int | None, model: str | None) -> int:
    """Apply :func:`resolve_threads` to torch; return the thread count torch now uses."""
    import torch

    n = resolve_threads(threads, model)
    if threads is not None and n is not None and n < threads:
        from .console import warn

        warn(f"--threads {threads} is more than the {n} CPU core(s) this process may use; using {n}")
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def load_for_command(model: str, device: str | None, dtype: str | None, threads: int | None, ranks: bool = False,
                     compile: bool = False, force: bool = False, quantize=None,
                     chat: bool | None = False):
    """A subcommand's set-up before its runs: :func:`set_threads` (before the model loads; ``$ECACHE_THREADS``
    too), then with ``ranks`` this process's rank (``distributed.setup()``: torchrun / accelerate launch;
    the rank's device is ``dist.device(device)``), then ``load_model(model, device, dtype, force=force,
    quantize=quantize)`` (without ``force`` (``--force``) a model whose weights exceed the device's free
    memory is refused before any weight is read; ``quantize``: ``Settings.quantization``, the parsed format
    naming where it was written, so that a refusal at the load names the flag or the profile, or a name such
    as ``int8``; None loads the weights as stored); with
    ``compile`` the model's forward is the static-shape compiled step (``models/compiled.py``
    ``StaticStep``: ``lm.model`` wraps the loaded model). ``chat``: the command's ``--chat/--no-chat`` (None:
    the template when the model has one; False: the command applies none), so a checkpoint folder without
    the file that holds its chat template gets one note saying its prompts go in without it
    (``models.loader.no_chat_template_note``), from rank 0 only.

    Returns ``(lm, dist)``: the ``LoadedModel`` and the ``DistEnv``, None without ``ranks`` (one process).
    Raises UsageError for a bad thread count, device or dtype (``cuda:N`` under several ranks too),
    ModelLoadError for a model that cannot be loaded or does not fit, EcacheError for ``compile`` without a compiler
    (before the model loads).
    """
    from .models.loader import load_model

    set_threads(threads, model)
    dist = None
    if ranks:
        from . import distributed

        dist = distributed.setup()
        device = dist.device(device)
    if compile:
        from .models.compiled import check_compiler

        check_compiler(_device_kind(device))
    lm = load_model(model, device, dtype, force=force, quantize=quantize)
    if chat is not False and (dist is None or dist.is_main):
        from .console import note
        from .models.loader import no_chat_template_note

        if why := no_chat_template_note(lm):
            note(why)
    if compile:
        from .models.compiled import StaticStep

        lm.model = StaticStep(lm.model)
    return lm, dist


def inspect_for_command(model: str, device: str | None, dtype: str | None, compile: bool = False,
                        force: bool = False, quantize=None):
    """:func:`load_for_command`'s checks without the weights: ``compile``'s compiler, then
    ``models.loader.inspect_model`` (device, dtype, quantize, the checkpoint's config, tokenizer and spec,
    and without ``force`` whether the weights fit the free memory). Returns its ``ModelMeta`` (``.spec``);
    raises as :func:`load_for_command` does before it reads a weight."""
    from .models.loader import inspect_model

    if compile:
        from .models.compiled import check_compiler

        check_compiler(_device_kind(device))
    return inspect_model(model, device, dtype, force=force, quantize=quantize)


def _device_kind(device: str | None):
    """The torch device type a ``--device`` value will load on (``auto``: CUDA when available)."""
    import torch

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(str(device).split(":")[0] if str(device).startswith("cuda") else "cpu")


def compile_line(model) -> str | None:
    """The stderr line on what a ``--compile`` model compiled (``models/compiled.py``), None for eager."""
    from .models.compiled import compile_line as line

    return line(model)

