"""Per-row fields: the one way batch rows are kept, set aside, appended and initialised.

Everything that holds one entry per batch row (the decode state, the KV store, a cache policy's
bookkeeping) declares which of its attributes are per row and along which dimensions, with
:class:`PerRow`. Rows leave the batch (``keep``), are copied out (``take``) and come back or join
(``append``) through the functions here alone, so no caller guesses which tensors are per row. (The
KV store, whose rows are the large ones, moves them in place in preallocated buffers instead:
``kvstore.py``; ``compact_order`` is the order that moves fewest.)
This module imports nothing of ecache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch


@dataclass(frozen=True)
class PerRow:
    """How an attribute holds one entry per batch row.

    dims: the tensor dimensions that run over rows: (0,) for a (B, ...) tensor, (0, 1) for a pairwise
    (B, B, ...) tensor. A list or tuple of tensors (e.g. one per layer) applies ``dims`` to each element.
    items: True for a Python list with one item per row (any objects).
    An attribute that is None stays None.
    """

    dims: tuple[int, ...] = (0,)
    items: bool = False


ROW = PerRow()  #: the common case: rows along dimension 0


def _select(t: torch.Tensor, dims: tuple[int, ...], rows: torch.Tensor) -> torch.Tensor:
    for d in dims:
        t = t.index_select(d, rows)
    return t


def _cat(a: torch.Tensor, b: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    if dims == (0,):
        return torch.cat([a, b], 0)
    n, m = a.shape[dims[0]], b.shape[dims[0]]
    shape = list(a.shape)
    for d in dims:
        shape[d] = n + m
    out = a.new_zeros(shape)  # entries pairing an old row with a new one start at 0
    old = [slice(None)] * a.dim()
    new = [slice(None)] * a.dim()
    for d in dims:
        old[d], new[d] = slice(0, n), slice(n, n + m)
    out[tuple(old)] = a
    out[tuple(new)] = b
    return out


def take_value(value, spec: PerRow, rows: torch.Tensor):
    """Rows ``rows`` (K,) long of ``value``, copied (one ``index_select`` per tensor dimension, no sync)."""
    if value is None:
        return None
    if spec.items:
        return [value[i] for i in rows.tolist()]
    if isinstance(value, (list, tuple)):
        return type(value)(_select(t, spec.dims, rows) for t in value)
    return _select(value, spec.dims, rows)


def cat_value(a, b, spec: PerRow):
    """``a``'s rows followed by ``b``'s; None on either side gives None."""
    if a is None or b is None:
        return None
    if spec.items:
        return list(a) + list(b)
    if isinstance(a, (list, tuple)):
        return type(a)(_cat(x, y, spec.dims) for x, y in zip(a, b))
    return _cat(a, b, spec.dims)


def take(obj, fields: Mapping[str, PerRow], rows: torch.Tensor) -> dict:
    """The per-row ``fields`` of ``obj`` at rows ``rows`` (K,) long, copied: a dict for :func:`append`."""
    return {name: take_value(getattr(obj, name), spec, rows) for name, spec in fields.items()}


def keep(obj, fields: Mapping[str, PerRow], rows: torch.Tensor) -> None:
    """Keep only rows ``rows`` (K,) long of every per-row field of ``obj``, in that order."""
    for name, spec in fields.items():
        setattr(obj, name, take_value(getattr(obj, name), spec, rows))


def append(obj, fields: Mapping[str, PerRow], taken: dict) -> None:
    """Append the rows ``taken`` (a :func:`take` result, or fields of new rows) after ``obj``'s rows."""
    for name, spec in fields.items():
        setattr(obj, name, cat_value(getattr(obj, name), taken[name], spec))


def compact_order(leaving: torch.Tensor) -> torch.Tensor:
    """The rows that stay when rows ``leaving`` (B,) bool leave, as a ``keep`` index (K,) long that moves
    as few rows as possible: every staying row below K keeps its slot, and the staying rows from K on
    fill the freed slots below K in order. Row order is not kept (each row carries its run index, e.g.
    ``DecodeState.rows``). Reads the count K from the device (one sync, in ``nonzero``)."""
    stay = (~leaving).nonzero().squeeze(1)  # (K,) ascending
    K = stay.numel()
    keep = torch.arange(K, device=leaving.device)
    keep[leaving[:K].nonzero().squeeze(1)] = stay[stay >= K]  # as many freed slots below K as stayers above
    return keep


def padded_index(mask: torch.Tensor, width: int | None = None,
                 exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn a (B, T) bool mask into a (B, S) index of its True positions in ascending order.

    S is the largest row count, at least 1: ``width`` when the caller has already read it (no device
    sync; it must not be below the largest count, or rows are cut), else read from the device (one
    sync). Short rows are padded by repeating their first position (or 0 for an empty row); ``valid``
    (B, S) bool marks the real entries. ``exact``: ``width`` is the largest count itself (what the
    engine reads), so a single row has no padding to fill (four operations instead of nine).
    """
    if width is not None and mask.shape[0] == 1:  # one row: its True positions as they come, no sort
        S = max(int(width), 1)
        found = torch.nonzero_static(mask[0], size=S, fill_value=-1)  # (S, 1), −1 past the row's count
        if exact and width >= 1:  # a view with the strides of any (1, S) index (compiled graphs guard on them)
            return found.view(1, S), torch.ones((1, S), dtype=torch.bool, device=mask.device)
        found = found[:, 0]
        valid = found >= 0
        return torch.where(valid, found, found[:1].clamp(min=0))[None], valid[None]
    counts = mask.sum(1)  # (B,)
    S = max(int(counts.max()) if width is None else int(width), 1)
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :S]  # (B, S) True positions first
    valid = torch.arange(S, device=mask.device)[None, :] < counts[:, None]  # (B, S)
    return torch.where(valid, order, order[:, :1]), valid


def packed_rows(valid: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The real entries of a padded (B, S) index as one packed list, and the way back.

    ``valid`` (B, S) bool: the real entries (``padded_index``'s second result); every row's first entry
    counts as real too (an empty row's padding is its entry 0). ``n``: how many entries that makes,
    ``valid.sum(1).clamp(min=1).sum()``, read by the caller with its other counts (no sync here).
    Returns (order (n,) long: the flat indices ``b * S + s`` of the real entries, row by row; unpack
    (B * S,) long: for every entry, its place in ``order``, a padding entry that of its row's first
    entry, which ``padded_index`` repeats in it). ``x.reshape(B * S, -1)[order]`` packs per-entry
    values, ``packed[unpack].view(B, S, -1)`` restores the padded layout.
    """
    B, S = valid.shape
    real = valid.clone()
    real[:, 0] = True
    flat = real.reshape(-1)
    order = torch.argsort((~flat).to(torch.int8), stable=True)[:n]  # (n,) real entries first, in order
    place = flat.long().cumsum(0) - 1  # (B*S,) the packed place of each real entry
    first = place.view(B, S)[:, :1].expand(B, S).reshape(-1)  # the row's first entry's place
    return order, torch.where(flat, place, first)
