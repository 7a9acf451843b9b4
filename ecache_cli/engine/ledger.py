"""What a run keeps for every row it has taken, in run order: prompt, final canvas, work counters and
times, and the per-row results built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GenerationResult:
    """One prompt's output. token_ids: the gen_length generated ids; answer_ids: up to (excluding) the
    first EOS/EOT; text: answer_ids decoded without special tokens; stats: see :meth:`Ledger.results`."""

    index: int
    prompt_ids: list[int]
    token_ids: list[int]
    answer_ids: list[int]
    text: str
    ended: bool
    stats: dict = field(default_factory=dict)


COUNTERS = ("nfe", "n_full", "n_partial", "computed", "planned")


class Ledger:
    """Per run row r: ``prompts[r]``, ``row_ids[r]`` (its random stream's input index), ``final[r]`` (T,) long
    canvas once finished, counters (N,) long ``nfe``, ``n_full``, ``n_partial``, ``computed``,
    ``planned`` (columns of one (N, 5) long tensor ``counts``, added to in one operation per step), and
    ``start_s[r]`` / ``finish_s[r]`` seconds from the run's start."""

    def __init__(self, width: int, device: torch.device):
        self.prompts: list[list[int]] = []
        self.row_ids: list[int] = []
        self.start_s: list[float] = []
        self.finish_s: list[float] = []
        self.final = torch.empty(0, width, dtype=torch.long, device=device)
        self.counts = torch.zeros(0, len(COUNTERS), dtype=torch.long, device=device)  # (N, 5)

    # each counter: (N,) long, a view of its column of ``counts``
    nfe = property(lambda self: self.counts[:, 0])
    n_full = property(lambda self: self.counts[:, 1])
    n_partial = property(lambda self: self.counts[:, 2])
    computed = property(lambda self: self.counts[:, 3])
    planned = property(lambda self: self.counts[:, 4])

    def add(self, prompt_ids: list[int], row_id: int | None, now: float) -> int:
        """Open a row; returns its index in the run."""
        r = len(self.prompts)
        self.prompts.append(prompt_ids)
        self.row_ids.append(r if row_id is None else int(row_id))
        self.start_s.append(now)
        self.finish_s.append(0.0)
        self.final = torch.cat([self.final, self.final.new_zeros(1, self.final.shape[1])])
        self.counts = torch.cat([self.counts, self.counts.new_zeros(1, len(COUNTERS))])
        return r

    def count(self, rows: torch.Tensor, refresh: torch.Tensor, computed: torch.Tensor, planned: torch.Tensor) -> None:
        """Add one step of rows ``rows`` (B,) long: a forward each, full where ``refresh``."""
        full = refresh.long()
        self.counts.index_add_(0, rows, torch.stack([torch.ones_like(full), full, 1 - full, computed, planned], 1))

    def finish(self, rows: torch.Tensor, tokens: torch.Tensor, now: float) -> None:
        """Rows ``rows`` (K,) long finished with canvases ``tokens`` (K, T) at ``now`` seconds."""
        self.final[rows] = tokens
        for r in rows.tolist():
            self.finish_s[r] = now

    def results(self, tokenizer, end_ids: set[int], P: int, wall_s: float,
                gen_length: int | None = None) -> list[GenerationResult]:
        """Per-row outputs in run order, with stats: nfe, full_forwards, partial_forwards, tokens_computed
        (positions the forwards computed for this row, padding included: ``StepRecord.computed``),
        tokens_planned (the plans' own positions, what the row would compute alone at batch 1),
        token_layer_share (tokens_computed over nfe × T), generated_tokens (answer tokens plus its end
        marker), tokens_per_forward (generated_tokens / nfe: TPF), prompt_tokens, wall_s (seconds from the
        row's joining to its finishing), tokens_per_s.
        ``gen_length``: the answer's positions after ``P`` (default: the rest of the canvas; a block-diffusion
        canvas decodes its last block whole, past the answer)."""
        out = []
        T = self.final.shape[1]
        nfe, full, part, comp, planned = zip(*self.counts.tolist()) if len(self.counts) else ((),) * 5
        for b, ids in enumerate(self.final[:, P:P + gen_length if gen_length is not None else T].tolist()):
            end = next((i for i, t in enumerate(ids) if t in end_ids), None)
            answer = ids if end is None else ids[:end]
            gen = len(answer) + (1 if end is not None else 0)
            wall = (self.finish_s[b] or wall_s) - self.start_s[b]
            stats = dict(nfe=nfe[b], full_forwards=full[b], partial_forwards=part[b], tokens_computed=comp[b],
                         tokens_planned=planned[b], token_layer_share=comp[b] / max(nfe[b] * T, 1),
                         generated_tokens=gen, tokens_per_forward=gen / max(nfe[b], 1),
                         prompt_tokens=len(self.prompts[b]), wall_s=wall,
                         tokens_per_s=gen / wall if wall > 0 else 0.0)
            text = tokenizer.decode(answer, skip_special_tokens=True) if tokenizer is not None else ""
            out.append(GenerationResult(index=b, prompt_ids=self.prompts[b], token_ids=ids, answer_ids=answer,
                                        text=text, ended=end is not None, stats=stats))
        return out
