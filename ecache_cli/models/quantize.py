"""Weight quantization of a loaded model with torchao (``--quantize``, ``load_model(..., quantize=...)``).

What is quantized: every transformer block's projections (q, k, v, o and the SwiGLU gate, up and down;
in a mixture-of-experts block every expert's three, never the router). The embedding, the final norm,
the LM head and every norm stay in the compute dtype, and so does the KV store (the model's activations
are in the compute dtype). A quantized layer is not fused (``DiffusionLM.fuse_projections`` skips it and
``BlockParts.fused()`` is False): its projections run as their own modules, whose weights are torchao
tensor subclasses that ``F.linear`` dispatches to torchao's kernels.

Formats (``FORMATS``), as torchao 0.18 runs them (measured; README "Quantized weights"):

- ``int8``: weight-only int8, one scale per output row (``Int8WeightOnlyConfig``); CPU and CUDA, every
  float compute dtype.
- ``int4``: weight-only int4 in groups of ``group_size`` input columns, asymmetric (tinygemm): on CUDA
  ``Int4WeightOnlyConfig`` in the tile-packed layout, on CPU torchao's prototype
  ``PrototypeInt4WeightOnlyConfig`` (``_weight_int4pack_mm_for_cpu``). bfloat16 only: torchao's CUDA
  layout refuses other dtypes, and on CPU float32/float16 run ~100× slower than bfloat16 (measured:
  205 ms against 3.7 ms for a 1024×2048 matrix over 64 tokens), so they are refused.
- ``fp8``: float8 e4m3 weights and dynamically quantized activations with per-row scales
  (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``); CUDA devices of compute
  capability ≥ 8.9 (Ada, Hopper and later), bfloat16.

Loading quantizes layer by layer as the checkpoint is read (``loader.load_weights`` with
:func:`layer_groups`), so the full-precision model never exists whole: peak memory stays near the
quantized size plus one layer in full precision.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import EcacheError, UsageError

#: The ``--quantize`` values; ``none`` loads the weights as they are.
FORMATS = ("none", "int8", "int4", "fp8")
#: torchao's default int4 group size (``Int4WeightOnlyConfig.group_size``).
DEFAULT_GROUP_SIZE = 128
#: The group sizes the int4 kernels take (tinygemm).
GROUP_SIZES = (256, 128, 64, 32)
#: How to get torchao (the ``quant`` extra).
INSTALL = 'pip install -e ".[quant]" (or pip install "torchao>=0.18")'


@dataclass(frozen=True)
class QuantizeSource:
    """Where a quantize value was written, so that every refusal of it names it as the person wrote it.

    ``kind``: ``flag`` (``--quantize``: ``--quantize int4:16``), ``profile`` (a profile's ``quantize``
    key, ``path`` the file: ``p.yaml: quantize: int4:16``) or ``api`` (``load_model(..., quantize=...)``:
    ``load_model(quantize='int4:16')``). :data:`FLAG` and :data:`API` are the two without a path;
    :func:`profile_source` makes a profile's."""

    kind: str
    path: str | None = None

    def name(self, value, quoted: bool = False) -> str:
        """``value`` named as written here: ``--quantize int4:16``, ``p.yaml: quantize: int4:16``,
        ``load_model(quantize='int4:16')``. ``quoted``: the value in quotes (a text that is no format may
        be empty or hold spaces): ``--quantize 'int2'``, ``p.yaml: quantize: 'int2'``. A profile's value
        is written as YAML (``null``, ``5``, ``[int8]``), never as a Python repr."""
        if self.kind == "api":
            return f"load_model(quantize={value!r})"
        if self.kind == "profile":
            from ..contract.text import yaml_text

            shown = yaml_text(value) if quoted or not isinstance(value, str) else value
            return f"{self.path}: quantize: {shown}"
        return f"--quantize {value!r}" if quoted else f"--quantize {value}"


#: ``--quantize``'s source (the flag: its value, and ``--group-size`` beside it).
FLAG = QuantizeSource("flag")
#: ``load_model(..., quantize=...)``'s source.
API = QuantizeSource("api")


def profile_source(path) -> QuantizeSource:
    """The source of the ``quantize`` key of the profile at ``path`` (a path or its text)."""
    return QuantizeSource("profile", str(path))


@dataclass(frozen=True)
class Quantization:
    """A parsed ``--quantize`` value: ``fmt`` one of int8, int4, fp8; ``group_size`` the int4 group
    (input columns sharing a scale; None = :data:`DEFAULT_GROUP_SIZE`, lowered per layer to the largest
    of :data:`GROUP_SIZES` dividing a layer's input width).

    ``source``, ``written`` and ``group_flag`` say where the value came from, for the refusals that come
    later (:func:`group_for`, once the model's shapes are known); they do not take part in equality:
    ``source`` a :class:`QuantizeSource`, ``written`` the value as given (None: as ``str(self)``),
    ``group_flag`` whether ``--group-size`` gave the group size (else the value did: ``int4:64``)."""

    fmt: str
    group_size: int | None = None
    source: QuantizeSource = field(default=API, compare=False, repr=False)
    written: str | None = field(default=None, compare=False, repr=False)
    group_flag: bool = field(default=False, compare=False, repr=False)

    def __str__(self) -> str:
        return self.fmt if self.group_size is None else f"{self.fmt}:{self.group_size}"

    def group_label(self) -> str:
        """The value that set the int4 group size, as written at its source (``--quantize int4:256``,
        ``p.yaml: quantize: int4:256``, ``load_model(quantize='int4:256')``); a ``--group-size`` flag is named
        as itself by :func:`group_for`."""
        return self.source.name(self.written if self.written is not None else str(self))


def parse_quantize(value, group_size: int | None = None, source: QuantizeSource = FLAG) -> Quantization | None:
    """A quantize value as a :class:`Quantization`, None for ``none`` / None: the one parse and check of
    ``--quantize`` (and ``--group-size``), a profile's ``quantize`` key and ``load_model``'s ``quantize``.

    ``value``: a format name, any case, around spaces ignored (``"int8"``, ``"INT8"``), int4 optionally
    with its group size (``"int4:64"``, the form the records use); None means none; a
    :class:`Quantization` is returned as it is. ``group_size``: ``--group-size`` (input columns per
    scale). ``source``: where ``value`` was written (:data:`FLAG`, :data:`API`, :func:`profile_source`),
    which every message names (``--quantize int8:64 …``, ``p.yaml: quantize: int8:64 …``,
    ``load_model(quantize='int8:64') …``); ``--group-size`` is named as itself.

    Raises UsageError, one line: a value that is no format (``--quantize 'int2' is not a format; use one
    of none, int8, int4, fp8 (int4:64 sets int4's group size)``), a group size after ``:`` that is no
    number, two group sizes (``int4:64`` and ``--group-size 32``), a group size that is not one of
    :data:`GROUP_SIZES` (:func:`check_group_size`), or one on a format other than int4 (``--quantize
    int8:64 names a group size, which only int4 takes; use int8 or int4:64``)."""
    if isinstance(value, Quantization):
        return value if group_size is None else parse_quantize(value.fmt, group_size, value.source)
    if value is None:
        if group_size is not None:
            raise UsageError(f"--group-size {group_size} needs --quantize int4 (it sets int4's group size)")
        return None
    if not isinstance(value, str):
        raise UsageError(f"{source.name(value, quoted=True)} is not a format; use one of {', '.join(FORMATS)} "
                         "(int4:64 sets int4's group size)")
    fmt, sep, size = value.strip().lower().partition(":")
    if fmt not in FORMATS:
        raise UsageError(f"{source.name(value, quoted=True)} is not a format; use one of {', '.join(FORMATS)} "
                         "(int4:64 sets int4's group size)")
    inline = None
    if sep:
        try:
            inline = int(size)
        except ValueError:
            raise UsageError(f"{source.name(value, quoted=True)}: the group size after ':' must be a number, "
                             "e.g. int4:64") from None
        if fmt != "int4":
            raise UsageError(f"{source.name(value)} names a group size, which only int4 takes; use {fmt} or "
                             f"int4:{inline}")
        if group_size is not None and group_size != inline:
            raise UsageError(f"{source.name(value)} and --group-size {group_size} name two group sizes; keep one")
        check_group_size(inline, source.name(value))
    if fmt == "none":
        if group_size is not None:
            raise UsageError(f"--group-size {group_size} needs --quantize int4 (it sets int4's group size)")
        return None
    if group_size is not None and inline is None:
        if fmt != "int4":
            raise UsageError(f"--group-size {group_size} applies to --quantize int4 only, not {fmt}; drop it")
        check_group_size(group_size)
    return Quantization(fmt, inline if inline is not None else group_size, source=source, written=value.strip(),
                        group_flag=inline is None and group_size is not None)


def check_group_size(group_size: int, label: str | None = None, quantize_given: bool = True) -> None:
    """UsageError unless ``group_size`` is one of :data:`GROUP_SIZES` (torchao's int4 kernels), one
    wording wherever it is given: ``--group-size 7`` (``label`` default) or the value that wrote it as
    its source names it (``--quantize int4:7``, ``p.yaml: quantize: int4:7``: :meth:`QuantizeSource.name`);
    ``quantize_given=False`` (``--group-size`` without ``--quantize``) names the flag it needs."""
    if group_size not in GROUP_SIZES:
        sizes = ", ".join(map(str, sorted(GROUP_SIZES)))
        need = "" if quantize_given else " with --quantize int4"
        raise UsageError(f"{label or f'--group-size {group_size}'} names a group size int4's kernels do not take; "
                         f"use one of {sizes}{need}")


@contextlib.contextmanager
def _quiet_import():
    """Import torchao without its start-up log lines (CUDA extensions that a CPU machine cannot load,
    a torch deprecation note): they are not errors of the run."""
    names = ("torchao", "torch.utils._pytree")
    saved = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


def require_torchao(q: Quantization):
    """The ``torchao`` module; raises EcacheError (exit 1) naming the extra when it is not installed."""
    try:
        with _quiet_import():
            import torchao
    except ImportError:
        raise EcacheError(f"--quantize {q.fmt} needs torchao, which is not installed: {INSTALL}") from None
    return torchao


def supported_here(device: torch.device) -> str:
    """The formats and dtypes this device runs, for people (the refusals name it)."""
    if device.type == "cuda":
        fp8 = "fp8 (bfloat16)" if _fp8_device(device) else "no fp8 (needs compute capability ≥ 8.9)"
        return f"int8 (any dtype), int4 (bfloat16), {fp8}"
    return "int8 (float32, bfloat16, float16), int4 (bfloat16)"


def _fp8_device(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_supported(q: Quantization, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a format this device and compute dtype cannot run (UsageError, one line naming what is
    supported here), then require torchao (EcacheError, exit 1, naming the extra). Call before loading."""
    name = str(dtype).replace("torch.", "")
    where = "CUDA" if device.type == "cuda" else "CPU"
    if q.fmt == "fp8":
        if device.type != "cuda":
            raise UsageError(f"--quantize fp8 needs a CUDA GPU of compute capability ≥ 8.9; on {where} use "
                             f"{supported_here(device)}")
        if not _fp8_device(device):
            cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
            raise UsageError(f"--quantize fp8 needs compute capability ≥ 8.9 (this GPU has {cap}); here use "
                             f"{supported_here(device)}")
    if q.fmt in ("int4", "fp8") and dtype != torch.bfloat16:
        raise UsageError(f"--quantize {q.fmt} runs in bfloat16 only here ({name} asked): add --dtype bfloat16; "
                         f"on {where} torchao runs {supported_here(device)}")
    require_torchao(q)


def _config(q: Quantization, device: torch.device, group_size: int):
    """torchao's config object for one module (see the module docstring for the choices)."""
    with _quiet_import():
        from torchao import quantization as tq

        if q.fmt == "int8":
            return tq.Int8WeightOnlyConfig(set_inductor_config=False)
        if q.fmt == "fp8":
            from torchao.quantization.granularity import PerRow

            return tq.Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
        if device.type == "cuda":
            return tq.Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="tile_packed_to_4d",
                                           set_inductor_config=False)
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False)


def block_linears(model, i: int) -> list[tuple[str, nn.Linear]]:
    """Layer ``i``'s projections that quantization replaces, with role names (``q``, ``down``,
    ``expert3.gate``...): q, k, v, o and the dense SwiGLU's gate, up, down, or every expert's (a
    routed one's and a shared one's; the router stays). A checkpoint's fused q, k, v projection is ``q``."""
    from .layers import SwiGLU

    p = model.parts(i)
    out = [(r, lin) for r, lin in (("q", p.q), ("k", p.k), ("v", p.v), ("o", p.o)) if lin is not None]
    if p.moe is None:
        return out + [("gate", p.gate), ("up", p.up), ("down", p.down)]
    experts = [m for m in p.moe.modules() if isinstance(m, SwiGLU)]
    return out + [(f"expert{j}.{r}", lin) for j, e in enumerate(experts)
                  for r, lin in (("gate", e.gate_proj), ("up", e.up_proj), ("down", e.down_proj))]


def group_for(q: Quantization, in_features: int, where: str) -> int:
    """The int4 group size of a layer with ``in_features`` input columns (``where`` names the layer:
    ``layer 0's q projection``): the asked one, else :data:`DEFAULT_GROUP_SIZE` or the largest smaller one
    of :data:`GROUP_SIZES` that divides them. Raises UsageError when the asked one does not divide them,
    naming what set it (:meth:`Quantization.group_label`) and the sizes that do, in its form:
    ``--group-size 256 does not divide layer 0's q projection's 128 input columns; use 128 or 64 or 32``,
    ``--quantize int4:256 names a group size that does not divide …; use int4:128 or int4:64 or int4:32``."""
    if q.group_size is not None:
        if in_features % q.group_size:
            fits = [g for g in GROUP_SIZES if in_features % g == 0]
            if q.group_flag:
                raise UsageError(f"--group-size {q.group_size} does not divide {where}'s {in_features} input "
                                 f"columns; use {' or '.join(map(str, fits)) if fits else '--quantize int8'}")
            raise UsageError(f"{q.group_label()} names a group size that does not divide {where}'s {in_features} "
                             f"input columns; use {' or '.join(f'int4:{g}' for g in fits) if fits else 'int8'}")
        return q.group_size
    for g in GROUP_SIZES:
        if g <= DEFAULT_GROUP_SIZE and in_features % g == 0:
            return g
    raise UsageError(f"--quantize int4: {where} has {in_features} input columns, a multiple of none of "
                     f"{', '.join(map(str, GROUP_SIZES))}; use --quantize int8")


def check_shapes(model, q: Quantization) -> None:
    """Refuse (UsageError) an int4 group size that does not fit every quantized layer (checked on the
    model before its weights load: the shapes are known on the meta device)."""
    if q.fmt != "int4":
        return
    for i in range(model.spec.n_layers):
        for role, lin in block_linears(model, i):
            group_for(q, lin.in_features, f"layer {i}'s {role} projection")


def is_quantized(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a torchao quantized tensor (any subclass that is not a plain tensor or parameter)."""
    return type(weight) not in (torch.Tensor, nn.Parameter)


@torch.no_grad()
def quantize_layer(model, i: int, q: Quantization) -> None:
    """Quantize layer ``i``'s projections (:func:`block_linears`) in place; their weights must be loaded
    (not on the meta device). The layer's fused matrices (``BlockParts.qkv``, ``gate_up``, a MoE block's
    ``stacked``) are dropped, so the full-precision copies are freed and the forward runs the quantized
    modules. Raises UsageError for an int4 group size that does not fit (:func:`group_for`)."""
    from torchao.quantization import quantize_

    p = model.parts(i)
    p.qkv = p.qkv_bias = p.gate_up = None
    for m in (p.moe.modules() if p.moe is not None else ()):
        if hasattr(m, "stacked"):
            m.stacked = None
        if hasattr(m, "gate_up"):
            m.gate_up = None
    for role, lin in block_linears(model, i):
        if is_quantized(lin.weight):
            continue
        group = group_for(q, lin.in_features, f"layer {i}'s {role} projection") if q.fmt == "int4" else 0
        lin.weight.requires_grad_(False)
        quantize_(lin, _config(q, lin.weight.device, group))
        if not is_quantized(lin.weight):  # torchao skips a shape it cannot take, with a log line only
            raise UsageError(f"--quantize {q}: torchao left layer {i}'s {role} projection "
                             f"({lin.out_features}×{lin.in_features}) unquantized; use --quantize int8")


def quantize_model(model, q: Quantization) -> None:
    """Quantize every layer of a loaded model in place, one after the other (:func:`quantize_layer`);
    ``model.quantization`` records ``q``. Prefer ``load_model(..., quantize=...)``, which quantizes
    each layer as it is read."""
    for i in range(model.spec.n_layers):
        quantize_layer(model, i, q)
    model.quantization = q


def release_freed_memory() -> None:
    """Hand the C heap's freed pages back to the OS (glibc ``malloc_trim``; nothing elsewhere). Loading
    frees one full-precision layer after another; glibc keeps such freed blocks (tens of MiB, under its
    adaptive mmap threshold) in the heap, so without this the process's RSS stays near the
    full-precision size although the live tensors are the quantized ones."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass


def layer_groups(model) -> list[list[str]]:
    """The model's state-dict names grouped for layer-by-layer loading: first every name outside the
    transformer blocks (embedding, final norm, LM head), then one list per layer (in layer order),
    found by parameter identity through ``model.parts(i)``. Works on the meta device."""
    owner: dict[int, int] = {}
    for i in range(model.spec.n_layers):
        p = model.parts(i)
        mods = [p.attn_norm, p.q, p.k, p.v, p.o, p.mlp_norm, p.gate, p.up, p.down, p.moe, p.q_norm, p.k_norm]
        for m in mods:
            if m is not None:
                for t in m.parameters():
                    owner.setdefault(id(t), i)
    groups: list[list[str]] = [[] for _ in range(model.spec.n_layers + 1)]
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    for k in model.state_dict(keep_vars=True):
        t = named.get(k)
        groups[owner.get(id(t), -1) + 1].append(k)
    return groups


def weight_bytes(model) -> int:
    """Bytes of the model's weights as stored: every parameter and buffer, a torchao tensor counted as
    its inner tensors (int8/int4 data, scales, zero points), storage shared by views counted once."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        names = getattr(t, "tensor_data_names", None)
        if names is not None and is_quantized(t):
            for n in list(names) + list(getattr(t, "optional_tensor_data_names", None) or []):
                inner = getattr(t, n, None)
                if isinstance(inner, torch.Tensor):
                    add(inner)
            return
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()

    for t in list(model.parameters()) + list(model.buffers()):
        add(t)
    return total


def quantization_name(model) -> str:
    """``none`` or the model's quantization as the records write it (``int8``, ``int4``, ``int4:64``)."""
    q = getattr(model, "quantization", None)
    return "none" if q is None else str(q)
