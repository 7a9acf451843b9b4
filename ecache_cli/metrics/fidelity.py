"""Fidelity of a cached policy against ``none`` on the same requests: identical outputs, token agreement.

Requests are paired by (prompt, repeat) key. Two numbers:
- identical share: requests whose answer (generated ids up to the end marker) equals ``none``'s;
- token agreement: over the generated positions of each pair, the share holding the same token. The
  generated positions of a pair are the first ``max(len(a), len(b)) + 1`` of the gen_length canvas
  (both answers and their end marker), capped at gen_length: the EOS filler after both answers
  have ended is not counted, so early-ending requests do not inflate agreement.
"""

from __future__ import annotations

from typing import Sequence

from .throughput import RowMeasure


def pair_agreement(a: RowMeasure, b: RowMeasure) -> tuple[int, int]:
    """(matching positions, compared positions) of two requests' generated canvases."""
    n = min(max(len(a.answer_ids), len(b.answer_ids)) + 1, len(a.token_ids), len(b.token_ids))
    same = sum(1 for x, y in zip(a.token_ids[:n], b.token_ids[:n]) if x == y)
    return same, n


def fidelity(rows: Sequence[RowMeasure], reference: Sequence[RowMeasure]) -> dict:
    """{identical_share, token_agreement, pairs}: shares in [0, 1] over requests present in both; None
    when no request pairs up."""
    ref = {r.key: r for r in reference}
    pairs = [(r, ref[r.key]) for r in rows if r.key in ref]
    if not pairs:
        return {"identical_share": None, "token_agreement": None, "pairs": 0}
    identical = sum(1 for a, b in pairs if a.answer_ids == b.answer_ids)
    same = total = 0
    for a, b in pairs:
        s, n = pair_agreement(a, b)
        same, total = same + s, total + n
    return {"identical_share": identical / len(pairs), "token_agreement": same / total if total else 1.0,
            "pairs": len(pairs)}
