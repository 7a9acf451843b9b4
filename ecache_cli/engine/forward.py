"""How one denoising step's forwards are grouped and run, from the rows' plans.

Rows whose plans differ in shape get forwards of their own, so no row pays for another's:

- every row refreshes: one full forward;
- some rows refresh, the step has no hooks and the store keeps no hidden states, and ``MERGE_REFRESH``
  is on (``group``'s ``merge``): one partial forward of the whole batch in which each refreshing row
  computes all T positions, so its K/V and logits are those of its full forward (every layer writes a
  row's computed K/V before its attention reads the row, so a row computing every position reads only
  fresh K/V; block-causal masks follow each query's own position); the other rows are padded by
  repeats to T and, packed (below), cost only their real entries outside attention;
- otherwise one partial forward of the whole batch at the widest non-refreshing row's width (a
  refreshing row computes only its logit sources and requested attention rows there, padded by
  repeats; the norms, projections and MLP run on the real entries alone, packed, when padding is at
  least a tenth of that layout: ``PACK_BELOW``), then one full forward of the refreshing rows alone on
  a scratch store whose K/V are copied into their rows; and, when only some rows grow their positions
  at a layer (``ForwardHooks.grow_from_layer``), the growing rows again on a copy of their store rows,
  so the others do not compute every position from that layer on. Their logits replace the partial
  forward's.

``computed`` counts what the forwards computed per row, padding included unless packed (layer-averaged
where a forward's positions change at a layer); ``planned`` the plan's own positions (layer-averaged
too: after a shrink, ``ForwardHooks.shrink``, the positions it kept). The widths and counts are read in
one host sync per step (plus one per shrink, inside the model). A shrink may drop positions whose logits
the step needs (``Shrink.keep_logits``): ``produced`` then says which targets got logits, and only those
can be committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..contract.rows import packed_rows, padded_index

#: A batch's partial forward packs its rows' real query entries (``DiffusionLM.forward``'s ``pack``) when
#: they are at most this share of the padded (B, S) layout: below it the per-position work saved
#: outweighs the few index operations per layer that packing adds.
PACK_BELOW = 0.9

#: A step whose rows refresh only in part runs one partial forward in which the refreshing rows compute
#: every position (the module docstring), instead of a partial forward and then a full forward of the
#: refreshing rows: one forward's kernel launches instead of two, for attention over the padded (B, T)
#: layout. Off: the two forwards. Read by the engine at every step.
MERGE_REFRESH = False


@dataclass(frozen=True)
class Group:
    """How one step's forwards are grouped: ``n_refresh`` rows refresh; ``part`` (B, T) bool positions of
    the partial forward (None when every row refreshes), ``width`` its query width; ``targets`` /
    ``attn`` the largest row counts of the targets and of the requested attention rows; ``n_grow``
    non-refreshing rows whose positions grow at a layer < n_layers; ``total_targets`` the targets of
    every row together (fewer than batch × ``targets``: the step's target index is padded); ``entries``
    the partial forward's real query entries, every row's positions (at least one) together; ``merged``:
    the refreshing rows compute every position in ``part`` (one forward for the step)."""

    n_refresh: int
    part: torch.Tensor | None
    width: int
    targets: int
    attn: int
    n_grow: int = 0
    total_targets: int = 0
    entries: int = 0
    merged: bool = False


@dataclass
class StepForward:
    """What a step's forwards produced. logits (B, R, V) for the sources; query (B, S) long positions of
    the partial forward (None when every row refreshed); computed / planned (B,) long; width the
    partial forward's query width (T when every row refreshed); split [(rows (n,) long, their store)]
    of the extra forwards; attn_pos (B, A) long requested attention rows or None; produced (B, R) bool
    the targets whose logits the forwards produced (None = all); logits_rows (B, R) bool the entries the
    LM head ran on (None = all; the others' logits are zeros)."""

    logits: torch.Tensor
    query: torch.Tensor | None
    computed: torch.Tensor
    planned: torch.Tensor
    width: int
    split: list = field(default_factory=list)
    attn_pos: torch.Tensor | None = None
    produced: torch.Tensor | None = None
    logits_rows: torch.Tensor | None = None

    def usable(self, valid: torch.Tensor) -> torch.Tensor:
        """(B, R) bool: the real targets ``valid`` (B, R) bool that got logits this step."""
        return valid if self.produced is None else valid & self.produced


def group(plan, state, tmask: torch.Tensor, policy_name: str, merge: bool = False) -> Group:
    """Group the step's forwards, reading every width in one host sync.

    ``tmask`` (B, T) bool: each row's current-block masked positions. ``merge``: the refreshing rows may
    run inside the partial forward, computing every position (the caller says so only when the store
    keeps no hidden states); taken when the plan has no hooks. Raises AssertionError when a
    non-refreshing row's ``compute`` misses the sources of its targets or its attention rows (a policy
    bug), after the sync that reads the widths.
    """
    B, T, L = state.batch, state.length, state.n_layers
    hooks = plan.hooks
    attn = None if hooks is None else hooks.attention_rows
    # [largest row's targets, all targets (a batch only: one row is never padded), largest attention rows]
    widest = tmask.sum(1).amax() if B > 1 else tmask.sum()
    counts = [widest, tmask.sum() if B > 1 else widest]
    if attn is not None:
        counts.append(attn.sum(1).amax())
    if plan.compute is None:  # every row refreshes (ForwardPlan.full)
        values = torch.stack(counts).tolist()
        return Group(B, None, T, values[0], values[2] if attn is not None else 0, total_targets=values[1])
    refresh = plan.refresh[:, None]  # (B, 1)
    need = state.sources(tmask) if attn is None else state.sources(tmask) | attn  # (B, T)
    computed = plan.compute | refresh  # (B, T)
    bad = (need > computed).any()  # a needed position neither computed nor refreshed
    merged = merge and hooks is None  # (with 0 < n_refresh < B; otherwise part is the same either way)
    part = computed if merged else torch.where(refresh, need, plan.compute)
    grow = None if hooks is None else hooks.grow_from_layer
    growing = [] if grow is None else [(grow.clamp(0, L).masked_fill(plan.refresh, L) < L).sum()]
    if B > 1:  # the widest row's positions, and the real query entries (every row at least one)
        row_width = part.sum(1)  # (B,)
        widths = [row_width.amax(), row_width.clamp(min=1).sum()]
    else:
        widths = [part.sum()]
    values = torch.stack(counts + growing + [plan.refresh.sum()] + widths + [bad.long()]).tolist()
    n_grow = values[len(counts)] if growing else 0
    n_refresh, width, *entries, bad = values[len(counts) + len(growing):]  # entries: a batch's only
    entries = entries[0] if entries else max(width, 1)
    assert not bad, f"policy {policy_name} did not plan the positions whose logits (or attention rows) this step needs"
    return Group(n_refresh, part, width, values[0], values[2] if attn is not None else 0, n_grow, values[1], entries,
                 merged)


def _layer_average(S: int, m: torch.Tensor, T: int, L: int) -> torch.Tensor:
    """Positions per layer, averaged: S below layer m, T from it on."""
    return (S * m + T * (L - m)) // L


def _shrunk_average(width, own: torch.Tensor, shrunk: list, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer-averaged query width and per-row real positions of a forward that started at ``width`` query
    rows, ``own`` (B,) long of them real, and shrank as ``shrunk`` says (``KVStore.shrunk``: (layer,
    width, kept (B,) long) in layer order). Returns ((B,) long, (B,) long), rounded down."""
    w_sum, own_sum = width * L, own * L
    for layer, w, kept in shrunk:
        w_sum -= (width - w) * (L - layer)
        own_sum = own_sum - (own - kept) * (L - layer)
        width, own = w, kept
    return torch.full_like(own_sum, w_sum // L), own_sum // L


def run_forwards(model, state, store, plan, grp: Group, sources: torch.Tensor, section,
                 valid: torch.Tensor | None = None) -> StepForward:
    """Run the step's forwards (see the module docstring); ``section(name)`` names each for the profiler.

    ``sources`` (B, R) long: the positions whose logits the step needs; ``valid`` (B, R) bool, or None:
    which of them are real targets, the others padding. When a batch's target index is padded, the LM
    head runs on the real ones alone (``DiffusionLM.forward``'s ``logits_rows``; padding gets zeros).
    Returns a :class:`StepForward`.
    """
    B, T, L = state.batch, state.length, state.n_layers
    dev = state.tokens.device
    hooks = plan.hooks
    attn_mask = None if hooks is None else hooks.attention_rows
    attn_pos = None if attn_mask is None else padded_index(attn_mask, grp.attn, exact=True)[0]  # (B, A)
    kw = {} if attn_pos is None else {"attn_pos": attn_pos}
    if valid is not None and B > 1 and grp.total_targets < B * grp.targets:
        kw["logits_rows"] = valid
    if grp.n_refresh == B:
        with section("ecache.forward.full"):
            logits = model(state.tokens, store, query_pos=None, logits_pos=sources, **kw)
        full = torch.full((B,), T, dtype=torch.long, device=dev)
        return StepForward(logits, None, full, full, T, [], attn_pos)
    query, real = padded_index(grp.part, grp.width, exact=True)  # (B, S)
    S = query.shape[1]
    refresh = plan.refresh
    own = plan.compute.sum(1)  # (B,)
    computed = torch.full((B,), S, dtype=torch.long, device=dev)
    plain = hooks is None and store.hidden is None  # packing leaves the layer hooks' forwards as they are
    if plain and B > 1 and grp.entries <= PACK_BELOW * B * S and getattr(model, "packs_rows", False):
        kw["pack"] = packed_rows(real, grp.entries)  # the rows' widths differ: no work on padding
        computed = real.sum(1).clamp_(min=1)  # (B,) each row's own entries (an empty row computes one)
    grow = None if hooks is None else hooks.grow_from_layer
    separate = False
    shrinks = () if hooks is None else hooks.shrinks
    if shrinks:
        kw["shrink"] = shrinks
    if grow is not None:  # refreshing rows never grow
        sl = grow.clamp(0, L).masked_fill(refresh, L)  # (B,)
        own = _layer_average(own, sl, T, L)
        separate = 0 < grp.n_grow < B
        if not separate and grp.n_grow > 0:
            kw["expand_from_layer"] = sl
            computed = _layer_average(S, sl.amin(), T, L).expand(B).clone()
    planned = torch.where(refresh, T, own)
    with section("ecache.forward.partial"):
        logits = model(state.tokens, store, query_pos=query, logits_pos=sources, **kw)  # (B, R, V)
    if store.shrunk:  # the positions changed at the shrinks' layers
        computed, own = _shrunk_average(S, own, store.shrunk, L)
        planned = torch.where(refresh, T, own)
    produced = None if store.produced is None else store.produced | refresh[:, None]  # refreshing rows: full
    out = StepForward(logits, query, computed, planned, S, [], attn_pos, produced, kw.get("logits_rows"))
    if separate:
        _grown_rows(model, state, store, out, sl, grp.n_grow, sources, section)
    if grp.n_refresh > 0 and not grp.merged:
        _refreshing_rows(model, state, store, out, refresh, grp.n_refresh, sources, section)
    return out


def _grown_rows(model, state, store, out: StepForward, sl: torch.Tensor, n: int, sources, section) -> None:
    """Run the ``n`` rows whose start layer ``sl`` (B,) is < n_layers again, on a copy of their store rows:
    below their start layer the same positions (their K/V rewritten with what they were), from it on every
    position from the cached layer inputs: exactly their single grown forward. Updates ``out``."""
    T, L = state.length, state.n_layers
    grows = sl < L  # (B,)
    idx = torch.argsort((~grows).to(torch.int8), stable=True)[:n]  # (n,) growing rows
    sub = store.take_rows(idx)
    kw = {"expand_from_layer": sl[idx]}
    if out.attn_pos is not None:
        kw["attn_pos"] = out.attn_pos[idx]
    if out.logits_rows is not None:
        kw["logits_rows"] = out.logits_rows[idx]
    with section("ecache.forward.partial"):
        logits = model(state.tokens[idx], sub, query_pos=out.query[idx], logits_pos=sources[idx], **kw)
    out.logits = out.logits.index_copy(0, idx, logits)
    store.put_rows(idx, sub)
    out.computed = out.computed + grows.long() * _layer_average(out.width, sl[idx].amin(), T, L)
    out.split.append((idx, sub))


def _refreshing_rows(model, state, store, out: StepForward, refresh: torch.Tensor, n: int, sources, section) -> None:
    """Run the ``n`` refreshing rows (``refresh`` (B,) bool) alone as one full forward on a scratch store,
    copied into their store rows; their logits replace the partial forward's. Updates ``out``."""
    idx = torch.argsort((~refresh).to(torch.int8), stable=True)[:n]  # (n,) refreshing rows
    sub = store.scratch_rows(idx)
    kw = {} if out.attn_pos is None else {"attn_pos": out.attn_pos[idx]}
    if out.logits_rows is not None:
        kw["logits_rows"] = out.logits_rows[idx]
    with section("ecache.forward.full"):
        logits = model(state.tokens[idx], sub, query_pos=None, logits_pos=sources[idx], **kw)
    out.logits = out.logits.index_copy(0, idx, logits)
    store.put_rows(idx, sub)
    out.computed = out.computed + refresh.long() * state.length
    out.split.append((idx, sub))


def extra_outputs(model, store, fwd: StepForward) -> dict:
    """The extra outputs the plan's hooks asked for, merged over the step's forwards: ``"attention"``:
    (positions (B, A) long, [per layer (B, A, T) float32]) when attention rows were requested."""
    if fwd.attn_pos is None:
        return {}
    probs = model.attention_rows(store)  # per layer (B, A, T)
    for idx, sub in fwd.split:  # rows that ran a forward of their own
        probs = [p.index_copy(0, idx, q) for p, q in zip(probs, model.attention_rows(sub))]
    return {"attention": (fwd.attn_pos, probs)}
