"""The static-shape step: the model's forward compiled once per shape bucket (``--compile``).

A denoising step's forward changes shape with every plan (query width, targets, rows in the batch).
CUDA graphs want fixed shapes and fixed addresses, so on CUDA :class:`StaticStep` pads each forward to
a small fixed set of buckets and compiles one graph per bucket (``torch.compile(dynamic=False,
mode="reduce-overhead")``, i.e. CUDA graphs); on CPU, where every padded row costs its compute, it
compiles with inductor graphs whose number of rows is symbolic too and runs them on the store's own
tensors with no row padded (``pad=False``, the CPU default: a bucket per query and logits width and
padding mask or none; a batch of one row may get a graph of its own). The bucketed form (``pad=True``):

- batch rows to a power of two (1, 2, 4, 8, ...), as nano-vLLM does for its CUDA-graph batch sizes
  (``nanovllm/engine/model_runner.py``, ``capture_cudagraph``); padded rows repeat row 0 and their
  outputs are dropped;
- query width to a power of two ≥ :data:`MIN_WIDTH`, or the whole canvas when that is narrower, by
  repeating a row's first query position: duplicates write identical K/V (``DiffusionLM.forward``);
- logits positions to a power of two ≥ :data:`MIN_LOGITS` (at most the width), by repeating the row's
  first one; the padded logits are dropped.

The canvas length T is symbolic in the graphs (``torch._dynamo.mark_dynamic`` on every T dimension),
so one graph per bucket serves prompts of every length; a width as wide as the canvas is the bucket
class ``"T"`` (:data:`CANVAS`). A full forward is the partial forward of every position in order (the
same K/V and logits), so it shares the class-``"T"`` graphs. On CUDA, where a CUDA graph is recorded
per concrete shape, the engine also widens a run's prompt width to the next of 16, 24, 32, 48, 64, 96,
... (:func:`prompt_bucket`; more left padding, masked, changes no token), bounding the recordings.

The K/V of a store the compiled forward writes live in one preallocated buffer per layer of the bucket's
batch rows and the run's canvas (a *slot*): the store's ``k[i]`` / ``v[i]`` become views of its first B
rows, so every step of a bucket hands the graph the same tensors (fixed addresses, what a CUDA graph
needs) and the graph writes the computed positions in place. A store is bound to a slot at its first
compiled forward and again after rows join or leave (one copy of its K/V then, none per step).

Forwards with hooks (``expand_from_layer``, ``attn_pos``, ``shrink``), over a store that keeps hidden
states, block-causal ones in the bucketed form (block diffusion's per-query mask is an input of the
unpadded graphs only), or with gradients on run eager (:attr:`StaticStep.stats` counts them). Graphs are bounded by
``max_graphs``: past it a new shape pads up to the cheapest compiled bucket that holds it (more rows,
a wider query or more logits rows, the same padding mask), and runs eager when none does. Compile
seconds are counted apart (:attr:`StaticStep.compile_s`) and the engine's clock leaves them out of
every time it reports. Compiled artefacts are cached on disk (inductor's FX graph cache under
:func:`cache_dir`), so a second process compiles the same buckets from the cache.
"""

from __future__ import annotations

import os
import shutil
import time
import types
import weakref
from dataclasses import dataclass, field

import torch

from ..errors import EcacheError
from ..kvstore import KVStore
from .base import attention_mask
from .layers import rope_tables

#: The smallest query-width bucket (positions): narrower partial forwards pad up to it.
MIN_WIDTH = 32
#: The smallest logits-rows bucket: a block of 32 masks needs one bucket all block long.
MIN_LOGITS = 32
#: Graphs compiled at most by default; shapes beyond run eager.
MAX_GRAPHS = 16


#: The width class of a query or logits bucket as wide as the canvas (its length is symbolic in the graph).
CANVAS = "T"


def _width(w, T: int) -> int:
    """A bucket width: ``w``, or the canvas length ``T`` for :data:`CANVAS`."""
    return T if w == CANVAS else w


def bucket(n: int, floor: int = 1, cap: int | None = None) -> int:
    """The smallest power of two ≥ max(n, floor), at most ``cap`` (when given, ``cap`` ≥ n)."""
    b = 1 << (max(int(n), int(floor), 1) - 1).bit_length()
    return b if cap is None else min(b, cap)


def prompt_bucket(P: int, G: int, limit: int) -> int:
    """The canvas's prompt width for prompts of at most ``P`` tokens: the smallest of 16, 24, 32, 48, 64,
    96, ... (powers of two and 1.5 times them) ≥ P, so runs over different prompts share canvases (and
    graphs); ``P`` itself when that bucket + ``G`` would pass the model's ``limit`` positions."""
    b = bucket(P, 16)
    if b // 4 * 3 >= P and b >= 32:
        b = b // 4 * 3
    return b if b + G <= limit else P


def cache_dir() -> str:
    """The folder of the compiled artefacts: ``$TORCHINDUCTOR_CACHE_DIR`` when set, else
    ``$XDG_CACHE_HOME/ecache/inductor`` (``~/.cache/ecache/inductor``)."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.environ["TORCHINDUCTOR_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ecache", "inductor")


def prepare_compiler() -> None:
    """Import torch's compiler with the artefacts under :func:`cache_dir` (set before the import, which
    otherwise settles on ``/tmp/torchinductor_<user>``) and mark ``BlockParts.fused`` and
    ``SparseMoE.is_stacked`` constant results
    for traced forwards. Raises EcacheError (one line) when that folder cannot be created."""
    folder = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir())
    try:
        import torch._dynamo  # noqa: F401  (creates the artefact folder)
    except OSError as e:
        raise EcacheError(f"--compile: the compiled-artefact folder {folder} cannot be used ({e.strerror}); "
                          "set TORCHINDUCTOR_CACHE_DIR to a writable folder") from None
    from .base import BlockParts
    from .moe import SparseMoE

    torch.compiler.assume_constant_result(BlockParts.fused)  # marks the function; idempotent
    torch.compiler.assume_constant_result(SparseMoE.is_stacked)


def check_compiler(device: torch.device) -> None:
    """Raise EcacheError (one line naming the fix) when inductor cannot build code on ``device``'s host:
    on CPU it compiles C++ with ``$CXX`` or ``g++`` / ``clang++`` / ``c++`` (``torch._inductor.cpp_builder``);
    CUDA kernels are Triton's, whose launchers are built with a C compiler (``$CC``, ``gcc``, ``cc``,
    ``clang``)."""
    if device.type == "cpu":
        names = [os.environ.get("CXX"), "g++", "clang++", "c++"]
        what = "a C++ compiler"
    else:
        names = [os.environ.get("CC"), "gcc", "cc", "clang"]
        what = "a C compiler (Triton builds its launchers)"
    if any(n and shutil.which(n) for n in names):
        return
    raise EcacheError(f"--compile needs {what} and none is on PATH; install one (Debian/Ubuntu: apt-get install "
                      "build-essential; conda: conda install gxx_linux-64) or drop --compile")


@dataclass
class CompileStats:
    """What the static step did: ``graphs`` buckets compiled (each as [rows, query width, logits rows,
    padding mask or not] in ``buckets``: ``"T"`` as wide as the canvas, ``"any"`` symbolic),
    ``traces`` graphs dynamo traced for them (one per bucket; more when a guard failed),
    ``compile_s`` seconds spent compiling (the calls that traced or compiled, outside every reported
    decode time), ``compiled_calls`` forwards run by a graph, ``eager_calls`` forwards run eager (hooks,
    kept hidden states, gradients, or beyond ``max_graphs``), ``rebinds`` stores bound to a slot (K/V
    copies)."""

    graphs: int = 0
    traces: int = 0
    compile_s: float = 0.0
    compiled_calls: int = 0
    eager_calls: int = 0
    rebinds: int = 0
    max_graphs: int = MAX_GRAPHS
    mode: str = ""
    buckets: list = field(default_factory=list)

    def as_dict(self) -> dict:
        """JSON-ready (``compile`` key of the profile document and the manifest)."""
        return {"graphs": self.graphs, "traces": self.traces, "max_graphs": self.max_graphs,
                "compile_s": round(self.compile_s, 3), "compiled_calls": self.compiled_calls,
                "eager_calls": self.eager_calls, "rebinds": self.rebinds, "mode": self.mode,
                "buckets": [list(b) for b in self.buckets]}


class _Slot:
    """Preallocated K/V of ``rows`` batch rows and a canvas of T positions, one (rows, H_kv, T, D) tensor
    per layer, and the store bound to it (a weak reference: a store that dies frees its slot)."""

    def __init__(self, like: KVStore, rows: int):
        self.k = [t.new_zeros((rows, *t.shape[1:])) for t in like.k]
        self.v = [t.new_zeros((rows, *t.shape[1:])) for t in like.v]
        if self.k[0].device.type == "cuda":  # fixed addresses: the CUDA graphs read and write them in place
            for t in self.k + self.v:
                torch._dynamo.mark_static_address(t, guard=False)
        self.owner = None

    def owned_by(self, store: KVStore) -> bool:
        return self.owner is not None and self.owner() is store

    def free(self) -> bool:
        return self.owner is None or self.owner() is None

    def holds(self, store: KVStore) -> bool:
        """Whether ``store``'s K/V are this slot's first B rows (no join or leave since binding)."""
        return self.owned_by(store) and all(
            a.data_ptr() == b.data_ptr() and a.is_contiguous() for a, b in zip(store.k + store.v, self.k + self.v))

    def bind(self, store: KVStore, copy: bool) -> None:
        """Make ``store``'s K/V views of this slot's first B rows (copying them in when ``copy``)."""
        B = store.k[0].shape[0]
        if copy:
            for dst, src in zip(self.k + self.v, store.k + store.v):
                dst[:B].copy_(src)
        store.k = [t[:B] for t in self.k]
        store.v = [t[:B] for t in self.v]
        self.owner = weakref.ref(store)


def _core(model, tokens, k, v, attn_mask, cos, sin, query_pos, logits_pos):
    """The traced forward: ``model.forward`` over a store made of the given K/V, no hooks. tokens (B, T);
    k, v lists of (B, H_kv, T, D) (written in place); attn_mask (B, 1, 1, T) bool, or (B, 1, S, T) block-causal,
    or None; cos, sin
    (B, 1, T, D) float32; query_pos (B, S) long; logits_pos (B, R) long. Returns logits (B, R, V).
    Bucketed form: B, S, R fixed per bucket, T symbolic; unpadded form: every size symbolic."""
    store = KVStore(k=list(k), v=list(v), key_mask=None, positions=None, attn_mask=attn_mask, rope=(cos, sin))
    return model(tokens, store, query_pos=query_pos, logits_pos=logits_pos)


class StaticStep(torch.nn.Module):
    """The model with its hook-free forwards compiled per shape bucket (module docstring); every other
    attribute (``spec``, ``new_store``, ``attention_rows``, ...) is the wrapped model's.

    ``model``: a ``DiffusionLM``. ``max_graphs``: graphs compiled at most (then eager). ``mode``: the
    ``torch.compile`` mode (default ``"reduce-overhead"`` on CUDA, inductor's default on CPU). ``pad``:
    the buckets and slots above (default: on CUDA, where CUDA graphs need them); without, rows are not
    padded (their number is symbolic, like the canvas length) and the graphs run on the store's own
    tensors: on CPU, where compute grows with every padded row, the faster choice.
    Raises EcacheError when the host has no compiler (:func:`check_compiler`).
    """

    def __init__(self, model, max_graphs: int = MAX_GRAPHS, mode: str | None = None, pad: bool | None = None):
        super().__init__()
        self.model = model
        device = next(model.parameters()).device
        self.pad = device.type == "cuda" if pad is None else pad
        check_compiler(device)
        prepare_compiler()
        self.mode = mode if mode is not None else ("reduce-overhead" if device.type == "cuda" else "default")
        self._cuda = device.type == "cuda"
        self._seen: dict[tuple, object] = {}  # bucket key -> its compiled function
        self._slots: dict[tuple, list[_Slot]] = {}
        self.stats = CompileStats(max_graphs=max_graphs, mode=f"{self.mode} ({device.type})")

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def prompt_bucket(self, P: int, G: int, limit: int) -> int:
        """The prompt width a run's canvas gets: on CUDA :func:`prompt_bucket` (each canvas length is a
        CUDA-graph recording of its own; the engine widens the left padding, which changes no row's
        tokens: padding is masked, RoPE positions count real tokens only), on CPU ``P`` (the graphs
        take any canvas length)."""
        return prompt_bucket(P, G, limit) if self._cuda else P

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling so far (the engine's clock leaves them out)."""
        return self.stats.compile_s

    def forward(self, tokens, store: KVStore, query_pos=None, logits_pos=None, expand_from_layer=None,
                attn_pos=None, shrink=None, logits_rows=None, pack=None):
        """``DiffusionLM.forward``, same arguments and result; compiled when no hook is asked for, the
        store keeps no hidden states, gradients are off and the bucket is (or may become) one of the
        ``max_graphs`` graphs, else the wrapped model's eager forward. ``logits_rows`` and ``pack`` are
        passed to the eager forward; a compiled graph, whose shapes are fixed, computes every entry's
        logits (the entries outside ``logits_rows`` are not used) and every padded query entry."""
        model = self.model
        if (expand_from_layer is not None or attn_pos is not None or shrink is not None
                or store.hidden is not None or (store.block is not None and self.pad) or torch.is_grad_enabled()):
            self.stats.eager_calls += 1
            return model(tokens, store, query_pos, logits_pos, expand_from_layer, attn_pos, shrink, logits_rows,
                         pack)
        store.queries = store.shrunk = store.produced = None  # what an eager forward without hooks leaves
        if not self.pad:
            return self._unpadded(tokens, store, query_pos, logits_pos)
        B, T = tokens.shape
        full = query_pos is None
        query_pos, logits_pos, widths = self._widths(tokens, store, query_pos, logits_pos)
        R = logits_pos.shape[1]
        key = (bucket(B), *widths, store.attn_mask is not None)
        new = key not in self._seen
        if new and len(self._seen) >= self.stats.max_graphs:
            key, new = self._larger(key, T), False
            if key is None:
                self.stats.eager_calls += 1
                return model(tokens, store, None if full else query_pos, logits_pos)
        Bb, Sb, Rb = key[0], _width(key[1], T), _width(key[2], T)
        slot = self._slot(store, Bb, full=full)
        rows = None  # padded rows repeat row 0
        if Bb > B:
            rows = torch.cat([torch.arange(B), torch.zeros(Bb - B, dtype=torch.long)]).to(tokens.device)
        inference = torch.is_inference_mode_enabled()

        def pad(t, width=None, dim=None):  # (B, n, ...) -> (Bb, width, ...): rows, then positions repeated
            if t is None:
                return None
            if width is not None and width > t.shape[1]:
                t = torch.cat([t, t[:, :1].expand(B, width - t.shape[1], *t.shape[2:])], 1)
            t = (t if rows is None else t.index_select(0, rows)).contiguous()  # strides fixed too
            t = t.clone() if inference and not t.is_inference() else t  # one kind of tensor: no retrace
            if dim is not None:  # this dimension is the canvas length: symbolic
                torch._dynamo.mark_dynamic(t, dim)
            return t

        for t in slot.k + slot.v:
            torch._dynamo.mark_dynamic(t, 2)
        args = (model, pad(tokens, dim=1), slot.k, slot.v, pad(store.attn_mask, dim=3), pad(store.rope[0], dim=2),
                pad(store.rope[1], dim=2), pad(query_pos, Sb, 1 if key[1] == CANVAS else None),
                pad(logits_pos, Rb, 1 if key[2] == CANVAS else None))
        logits = self._call(key, new, args)
        out = logits[:B, :R]
        return out.clone() if self._cuda else out  # a CUDA graph's outputs are overwritten by its next replay

    def _widths(self, tokens, store: KVStore, query_pos, logits_pos):
        """The forward's query and logits positions ((B, S), (B, R) long; every position when None) and
        their width classes (a bucket, or ``CANVAS`` for the whole canvas: T is symbolic in the graphs);
        fills the store's RoPE tables on its first forward, as ``DiffusionLM.forward`` does."""
        if store.rope is None:
            s = self.model.spec
            store.rope = rope_tables(store.positions, s.head_dim if s.rotary_dim is None else s.rotary_dim,
                                     s.rope_theta)
        B, T = tokens.shape
        if query_pos is None:  # every position, in order: the partial forward's graph at width T computes the same
            query_pos = torch.arange(T, device=tokens.device).expand(B, T)
        if logits_pos is None:
            logits_pos = query_pos
        Sb = bucket(query_pos.shape[1], MIN_WIDTH, T)
        Rb = bucket(logits_pos.shape[1], MIN_LOGITS, Sb)
        return query_pos, logits_pos, (CANVAS if Sb == T else Sb, CANVAS if Rb == T else Rb)

    def _unpadded(self, tokens, store: KVStore, query_pos, logits_pos):
        """The CPU form (``pad=False``), on the store's own tensors: rows and canvas length symbolic,
        nothing padded but the query and logits widths (to the buckets above, or the whole canvas)."""
        model = self.model
        B = tokens.shape[0]
        query_pos, logits_pos, widths = self._widths(tokens, store, query_pos, logits_pos)
        Sb, Rb, R = _width(widths[0], tokens.shape[1]), _width(widths[1], tokens.shape[1]), logits_pos.shape[1]
        # the attention mask: block-causal (per query, block diffusion), the padding mask, or none
        key = ("any", *widths, "block" if store.block is not None else store.attn_mask is not None)
        new = key not in self._seen
        if new and len(self._seen) >= self.stats.max_graphs:
            self.stats.eager_calls += 1
            return model(tokens, store, query_pos, logits_pos)
        inference = torch.is_inference_mode_enabled()

        def ready(t, width=None, *dims):  # widened by repeats, contiguous, one kind of tensor, dims symbolic
            if t is None:
                return None
            if width is not None and width > t.shape[1]:
                t = torch.cat([t, t[:, :1].expand(B, width - t.shape[1])], 1)
            t = t.contiguous()
            t = t.clone() if inference and not t.is_inference() else t
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(t, d)
            return t

        for t in store.k + store.v:  # written in place: passed as they are
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 2)
        query = ready(query_pos, Sb, *((0, 1) if key[1] == CANVAS else (0,)))
        if store.block is None:
            mask = ready(store.attn_mask, None, 0, 3)  # (B, 1, 1, T)
        else:  # (B, 1, S, T) of the widened queries (a repeat attends as the position it repeats)
            mask = ready(attention_mask(store, query), None, *((0, 2, 3) if key[1] == CANVAS else (0, 3)))
        args = (model, ready(tokens, None, 0, 1), store.k, store.v, mask,
                ready(store.rope[0], None, 0, 2), ready(store.rope[1], None, 0, 2), query,
                ready(logits_pos, Rb, *((0, 1) if key[2] == CANVAS else (0,))))
        return self._call(key, new, args)[:, :R]

    def _call(self, key: tuple, new: bool, args: tuple) -> torch.Tensor:
        """Run bucket ``key``'s graph on ``args`` (compiling it when ``new``), counting compile seconds
        and traces."""
        from torch._dynamo.utils import counters

        traced = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        if self._cuda:
            torch.compiler.cudagraph_mark_step_begin()
        if new:
            self._seen[key] = self._compile()
        try:
            logits = self._seen[key](*args)
        except Exception as e:  # a compiler that fails on this machine: one line, not inductor's traceback
            if not new:
                raise
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise EcacheError(f"--compile: compiling the forward failed ({type(e).__name__}: {first}); "
                              "run without --compile") from None
        if new:
            self.stats.graphs = len(self._seen)
            self.stats.buckets.append(list(key))
        if new or counters["stats"]["unique_graphs"] != traced:  # compiled (or recorded) in this call
            if self._cuda:
                torch.cuda.synchronize()
            self.stats.compile_s += time.perf_counter() - t0
            self.stats.traces += counters["stats"]["unique_graphs"] - traced
        self.stats.compiled_calls += 1
        return logits

    def _compile(self):
        """A compiled copy of :func:`_core` for one bucket: a code object of its own, so dynamo keeps one
        cache entry (one guard check per call) per bucket."""
        code = _core.__code__.replace(co_name=f"_core_{len(self._seen)}")
        fn = types.FunctionType(code, _core.__globals__, code.co_name)
        return torch.compile(fn, dynamic=False, fullgraph=True, mode=None if self.mode == "default" else self.mode)

    def _larger(self, key: tuple, T: int) -> tuple | None:
        """The cheapest compiled bucket that holds ``key``'s forward on a canvas of ``T`` (as many rows,
        width and logits rows or more, the same padding mask), or None."""
        def size(k):
            return k[0], _width(k[1], T), _width(k[2], T)

        fits = [k for k in self._seen if k[3] == key[3] and all(a >= b for a, b in zip(size(k), size(key)))]
        return min(fits, key=lambda k: (size(k)[0] * size(k)[1], size(k)[2]), default=None)

    def _slot(self, store: KVStore, Bb: int, full: bool) -> _Slot:
        """The slot ``store`` is bound to for batch bucket ``Bb``, binding it first when needed (a copy
        of its K/V, skipped for a full forward, which writes every position before reading any)."""
        T = store.k[0].shape[2]
        slots = self._slots.setdefault((Bb, T, store.k[0].dtype), [])
        for s in slots:
            if s.holds(store):
                return s
        slot = next((s for s in slots if s.owned_by(store)), None) or next((s for s in slots if s.free()), None)
        if slot is None:
            slot = _Slot(store, Bb)
            slots.append(slot)
        for other in (s for group in self._slots.values() for s in group):
            if other is not slot and other.owned_by(store):  # the store moved to another bucket
                other.owner = None
        self._drop_free_slots(keep=slot)
        slot.bind(store, copy=not full)
        self.stats.rebinds += 1
        return slot

    def _drop_free_slots(self, keep: _Slot) -> None:
        """Free the memory of slots whose stores are gone: all of them but one beside ``keep`` in its own
        bucket and canvas (the next scratch store's), so a long-lived process over many canvases holds
        only its live stores' slots."""
        for key in list(self._slots):
            slots = self._slots[key]
            free = [s for s in slots if s is not keep and s.free()]
            for s in free[1:] if keep in slots else free:
                slots.remove(s)
            if not slots:
                del self._slots[key]


def compile_report(model) -> dict | None:
    """What ``model``'s static step did (:meth:`CompileStats.as_dict`), or None for an eager model."""
    return model.stats.as_dict() if isinstance(model, StaticStep) else None


def compile_line(model) -> str | None:
    """One line for stderr on what ``model``'s static step compiled, or None for an eager model."""
    if not isinstance(model, StaticStep):
        return None
    s = model.stats
    return (f"--compile: {s.graphs} graph(s) compiled in {s.compile_s:.1f} s (not in any reported time; "
            f"at most {s.max_graphs}), {s.compiled_calls} compiled forward(s), {s.eager_calls} eager")

