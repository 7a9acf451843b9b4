"""Per-row random streams: a row's draws depend on its seed and its index in the input, never on the batch.

Every draw of a step (Gumbel token noise, random / origin remasking scores, alg_temp keys) comes from
the row's own ``torch.Generator``, for exactly its valid targets, so a prompt decodes the same whatever
batch it lands in, and a row joining a running batch draws what it would draw alone.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch


def row_generator(seed: int, row_id: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The random stream of input row ``row_id`` under ``seed``: a torch.Generator on ``device``.

    Seeded with a 63-bit value that numpy's SeedSequence derives from (seed mod 2**64, row_id), the
    standard way to spawn independent streams from one seed, so streams of nearby seeds or rows do not
    overlap.
    """
    assert row_id >= 0, f"row_id {row_id} must be ≥ 0"
    state = np.random.SeedSequence([int(seed) % 2**64, int(row_id)]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(state) >> 1)


class RowStreams:
    """The streams of one run's rows, made on first use (greedy runs never draw)."""

    def __init__(self, seed: int, device: torch.device | str):
        self.seed, self.device = seed, device
        self._gens: dict[int, torch.Generator] = {}

    def generator(self, row_id: int) -> torch.Generator:
        if row_id not in self._gens:
            self._gens[row_id] = row_generator(self.seed, row_id, self.device)
        return self._gens[row_id]

    def drawer(self, rows: torch.Tensor, row_ids: Sequence[int], valid: torch.Tensor) -> Callable[..., torch.Tensor]:
        """``draw(*tail)``: U[0, 1) float64 (B, R, *tail), row b from the stream of ``row_ids[rows[b]]``
        (``rows`` (B,) long the batch rows' indices in the run, ``row_ids`` their input indices).

        Row b draws exactly (its valid targets, ``valid`` (B, R) bool, which come first) × tail values;
        padding entries get 0.5 (finite, never committed). The counts are read in one host sync, on the
        step's first draw.
        """
        counts: list[tuple[int, int]] = []

        def draw(*tail: int) -> torch.Tensor:
            if not counts:
                counts.extend((row_ids[r], n) for r, n in torch.stack([rows, valid.sum(1)], 1).tolist())
            out = torch.full((len(counts), valid.shape[1], *tail), 0.5, dtype=torch.float64, device=valid.device)
            for b, (r, n) in enumerate(counts):
                if n:
                    out[b, :n] = torch.rand((n, *tail), dtype=torch.float64, device=valid.device,
                                            generator=self.generator(r))
            return out

        return draw
