"""The canvas: rows at their first step (prompts left padded, the generated positions masked), and a
step's commits written into it."""

from __future__ import annotations

import torch


def new_canvas(prompts: list[list[int]], P: int, G: int, width: int, block_length: int, block_causal: bool,
               mask_id: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Tokens, padding mask and block offsets of rows with ``prompts`` on a canvas of ``P`` prompt and
    ``width`` generated positions, the answer being ``G`` tokens.

    Each prompt ends at position P (left padding). Bidirectional models: every generated position is a
    mask. Block diffusion (``block_causal``, docs/MODELS.md §10): blocks of ``block_length`` are laid from
    each row's first token, so the prompt's last ``len(p) % block_length`` tokens share the first decoded
    block with the first masks (the row's block offset), and the masks run to the end of the block
    holding the answer's last token (at most ``block_length - 1`` positions past it, within ``width``);
    positions after them are padding.

    Returns:
        tokens (n, P + width) long, key_mask (n, P + width) bool (False = padding), and block_offset (n,)
        long for block diffusion, else None; all on the CPU.
    """
    n = len(prompts)
    tokens = torch.full((n, P + width), pad_id, dtype=torch.long)
    key_mask = torch.zeros(n, P + width, dtype=torch.bool)
    offset = torch.zeros(n, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        end = P + width
        if block_causal:
            offset[b] = len(p) % block_length
            end = P + -(-(int(offset[b]) + G) // block_length) * block_length - int(offset[b])
        key_mask[b, P - len(p):end] = True
        tokens[b, P:end] = mask_id
    return tokens, key_mask, offset if block_causal else None


def reused(kv: torch.Tensor | None) -> int:
    """The prompt positions ``kv`` (2, L, H_kv, n, D) or None (none) holds: n."""
    return 0 if kv is None else kv.shape[3]


def write_reused(store, rows: list[int], first: int, reuse: dict, P: int, prompts: list[list[int]]) -> None:
    """Write the given keys and values of joining run rows ``rows`` (now batch rows ``first``, ``first``
    + 1 ...) into their ``store`` rows at their prompts' first positions, taking them out of ``reuse``
    (run row → (2, L, H_kv, n, D) K after RoPE and V, or None: ``Run.add``'s ``reuse``). A row's
    prompt ``prompts[r]`` ends at canvas position ``P`` (left padding) and its token i has RoPE position
    i (``KVStore.positions``), so keys computed for the same tokens at the start of any prompt fit."""
    for b, r in enumerate(rows, first):
        kv = reuse.pop(r, None)
        if reused(kv):
            store.write_span(b, P - len(prompts[r]), kv)


def apply_commits(st, targets: torch.Tensor, commit: torch.Tensor, x0: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Write a step's tokens into the decode state ``st``: ``x0`` (B, R) at the committed ``targets`` (B, R)
    (``commit`` (B, R) bool). A target holding a mask is committed (its commit order and step recorded); one
    holding a token is edited (token editing, ``decoding/editing.py``). Writing ``mask_id`` (the
    block-diffusion loops may propose it) leaves or makes a mask. A padded target repeats its row's first
    one, uncommitted: adding 0 leaves it. Returns (B,) bool, the rows that edited a token."""
    current = st.tokens.gather(1, targets)  # (B, R)
    hit = torch.zeros_like(st.tokens).scatter_add_(1, targets, commit.long()) > 0  # (B, T)
    st.tokens = st.tokens.scatter_add(1, targets, torch.where(commit, x0 - current, 0))
    masked = st.masked & ~hit | hit & (st.tokens == mask_id)
    new = st.masked & ~masked  # masks committed
    hit = hit & ~(st.masked & masked)  # a mask that stays one is no edit either
    st.masked = masked
    seen = new.cumsum(1)  # (B, T) long: this step's commits up to each position (order within the step)
    st.commit_order = torch.where(new, seen + (st.n_committed - 1)[:, None], st.commit_order)
    st.commit_step = torch.where(new, st.row_step[:, None], st.commit_step)
    st.n_committed = st.n_committed + seen[:, -1]
    return (hit & ~new).any(1)
