"""torch.profiler traces of the denoising loop with named ranges, for TensorBoard and Chrome/Perfetto.

One profiler session per policy, over one request, separate from the timed runs (the profiler's own
cost would distort the timings). Named ranges:
- engine step sections (``engine/core.py``, on only while ``run.ranges`` is True): ``ecache.decision.plan``,
  ``ecache.forward.full`` / ``ecache.forward.partial``, ``ecache.sampling_commit``,
  ``ecache.decision.observe``;
- per layer ``ecache.layerNN.attention`` (attention norm through output projection, KV store write and
  attention included) and ``ecache.layerNN.mlp`` (MLP norm through down projection), from forward hooks
  installed on the model's modules for the traced run only and removed after it, so the model's code
  and its untraced forwards are untouched;
- ``ecache.request.<policy>`` around the whole request.

Files written under DIR: ``<policy>/<policy>.<timestamp>.pt.trace.json`` (``tensorboard_trace_handler``;
each policy is a run in TensorBoard's PyTorch Profiler tab: ``tensorboard --logdir DIR``),
``<policy>.chrome_trace.json`` (the same Chrome-trace JSON that the handler writes through
``export_chrome_trace``; chrome://tracing or ui.perfetto.dev) and
``<policy>.summary.txt`` (the profiler's operator table, by self time).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from torch.profiler import (
    ProfilerActivity,
    profile,
    record_function,
    tensorboard_trace_handler,
)

RANGE_PREFIX = "ecache."


class LayerRanges:
    """Context manager: per-layer attention and MLP profiler ranges through module hooks.

    For layer i: a pre-hook on the attention norm opens ``ecache.layer{i}.attention`` and a hook after
    the output projection closes it; the MLP norm and the down projection do the same for
    ``ecache.layer{i}.mlp`` (the order of ``DiffusionLM.forward``). Hooks are removed on exit.
    """

    def __init__(self, model):
        self.model = model
        self.handles: list = []
        self.open: list = []

    def _pair(self, first, last, name: str) -> None:
        def enter(module, args):
            self.open.append(record_function(name).__enter__())

        def leave(module, args, output):
            if self.open:
                self.open.pop().__exit__(None, None, None)

        self.handles += [first.register_forward_pre_hook(enter), last.register_forward_hook(leave)]

    def __enter__(self) -> "LayerRanges":
        for i in range(self.model.spec.n_layers):
            p = self.model.parts(i)
            self._pair(p.attn_norm, p.o, f"{RANGE_PREFIX}layer{i:02d}.attention")
            self._pair(p.mlp_norm, p.mlp_out, f"{RANGE_PREFIX}layer{i:02d}.mlp")
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        while self.open:  # an exception inside a layer leaves its range open
            self.open.pop().__exit__(None, None, None)
        self.handles = []


#: kineto's own line for a profiler starting or stopping (``USDT:<time> <pid>:<tid>
#: SyncActivityProfilerHandler.cpp:52] profiler_start``), written by C++ to file descriptor 2.
KINETO_LINE = re.compile(r"\] profiler_(start|stop)\s*$")


@contextlib.contextmanager
def kineto_lines_off():
    """File descriptor 2 points at a temporary file inside the block; after it, what was written there
    goes to stderr but kineto's ``profiler_start`` / ``profiler_stop`` lines (:data:`KINETO_LINE`),
    which no Python setting silences and which would break a progress line: no library's noise in a
    run's stderr, ``-q`` or not, while a warning printed in the block still reaches it."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 (a closed stderr): nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode("utf-8", "replace").splitlines()
                    if not KINETO_LINE.search(line)]
            if kept:
                print("\n".join(kept), file=sys.stderr, flush=True)


def trace_run(run, out_dir: Path, name: str, max_steps: int | None = 64) -> dict:
    """Iterate ``run`` (an unstarted engine :class:`Run`) with its first ``max_steps`` denoising steps
    under torch.profiler (None: all of them; the rest run untraced so the request still completes).
    The profiler's own start and stop lines are not printed (:func:`kineto_lines_off`).

    Writes the files named in the module docstring for ``name``; returns {files, steps, ranges, ops}:
    ranges maps each ecache range to {count, total_ms} (inclusive CPU time), ops splits operator self
    time into matrix work and the rest.
    """
    out_dir = Path(out_dir)
    (out_dir / name).mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if run.engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    steps = iter(run)
    traced = 0
    run.ranges = True
    prof = profile(activities=activities, on_trace_ready=tensorboard_trace_handler(str(out_dir / name),
                                                                                   worker_name=name))
    with LayerRanges(run.engine.model):
        with kineto_lines_off():
            prof.start()
        try:
            with record_function(f"{RANGE_PREFIX}request.{name}"):
                for _ in steps:
                    traced += 1
                    if max_steps is not None and traced >= max_steps:
                        break
        finally:
            with kineto_lines_off():
                prof.stop()
    run.ranges = False
    for _ in steps:  # finish the request untraced
        pass
    tb = sorted((out_dir / name).glob("*.pt.trace.json"))
    chrome = out_dir / f"{name}.chrome_trace.json"
    if tb:  # the TensorBoard file is a Chrome trace already; kineto saves a trace once, so copy it
        shutil.copyfile(tb[-1], chrome)
    averages = prof.key_averages()
    summary = out_dir / f"{name}.summary.txt"
    summary.write_text(averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
    ranges = {e.key: {"count": e.count, "total_ms": e.cpu_time_total / 1e3}
              for e in averages if e.key.startswith(RANGE_PREFIX)}
    return {"files": {"tensorboard": [str(p) for p in tb], "chrome_trace": str(chrome), "summary": str(summary)},
            "steps": traced, "ranges": ranges, "ops": _op_split(averages),
            "forward_breakdown": forward_breakdown(chrome) if tb else None}


def _op_split(averages) -> dict:
    """Self CPU time (ms) of matrix work (matmuls, attention kernels) vs every other operator."""
    matmul_ops = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
                  "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                  "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention",
                  "aten::_scaled_dot_product_cudnn_attention")
    mat = sum(e.self_cpu_time_total for e in averages if e.key in matmul_ops)
    ops = sum(e.self_cpu_time_total for e in averages if e.key.startswith("aten::"))
    return {"matmul_attention_self_ms": mat / 1e3, "all_aten_self_ms": ops / 1e3}



MATRIX_OPS = ("aten::linear", "aten::matmul", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::scaled_dot_product_attention")


def forward_breakdown(chrome_trace: Path) -> dict:
    """Where the time of each traced forward goes, from a Chrome trace of ``trace_run``.

    For every ``ecache.forward.full`` / ``ecache.forward.partial`` range: the top-level operators inside
    it (not nested in another operator) are split into matrix work (``MATRIX_OPS``: projections, LM head,
    attention) and other operators (norms, RoPE, gathers, scatters into the KV store, casts); what is
    left of the range is Python and dispatch overhead outside any operator. Returns, per kind, the
    count and the mean milliseconds of each part. The profiler's own per-operator cost inflates the
    other-operator and Python parts somewhat (more on small operators).
    """
    events = json.loads(Path(chrome_trace).read_text())["traceEvents"]
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"),
                 key=lambda e: (e["ts"], -e["dur"]))
    out = {}
    for kind in ("full", "partial"):
        ranges = [e for e in events if e.get("ph") == "X" and e.get("name") == f"ecache.forward.{kind}"]
        if not ranges:
            continue
        total = matrix = other = 0.0
        for r in ranges:
            t0, t1, end = r["ts"], r["ts"] + r["dur"], -1.0
            for e in ops:
                if e["ts"] < t0 or e["tid"] != r["tid"]:
                    continue
                if e["ts"] >= t1:
                    break
                if e["ts"] < end:  # nested in the previous top-level operator
                    continue
                end = e["ts"] + e["dur"]
                if e["name"] in MATRIX_OPS:
                    matrix += e["dur"]
                else:
                    other += e["dur"]
            total += r["dur"]
        n = len(ranges)
        out[kind] = {"count": n, "mean_ms": total / n / 1e3, "matrix_ms": matrix / n / 1e3,
                     "other_ops_ms": other / n / 1e3, "python_ms": (total - matrix - other) / n / 1e3}
    return out
