"""The canvas of rows at their first step: prompts left padded, the generated positions masked."""

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
