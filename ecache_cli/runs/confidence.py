"""A confidence figure per answer: the mean entropy of the committed tokens' distributions.

``mean_entropy`` (nats) of an answer is the mean, over the canvas positions of the answer and its end
marker (``GenerationResult.stats["generated_tokens"]`` positions; the EOS filler after the end is
left out), of the entropy of the distribution the committed token was drawn from at the step that
committed it (``StepRecord.entropy``: entropy of softmax(raw logits), float64 nats). A confident
model commits near-deterministic tokens (entropy near 0); an answer to a question outside what the
model was trained on is committed from flat distributions (high entropy). It is read from the
StepRecords the engine yields, without touching the engine, and costs no host sync per step.

``threshold_for(lm)`` reads the model's own reference figure, stored beside the checkpoint in
``ecache_model.json`` (``mean_entropy_p99``: the 99th percentile of ``mean_entropy`` over the
model's own domains' test split; made by ``scripts/entropy_percentile.py``), or None.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

#: The file beside a checkpoint that says what the model was trained for and its confidence reference.
MODEL_CARD_FILE = "ecache_model.json"


class EntropyMeter:
    """Collects, per row of one batched run, the entropy of each committed canvas position.

    ``observe(rec)`` takes each StepRecord of the run (``rec.rows`` (B_active,) original row indices,
    ``rec.targets`` (B_active, R) absolute canvas positions, ``rec.committed`` (B_active, R) bool,
    ``rec.entropy`` (B_active, R) float64 nats); ``mean(row, n_positions)`` averages the first
    ``n_positions`` generated positions that were committed (None when none was).
    """

    def __init__(self, batch: int, prompt_len: int, gen_length: int, device: torch.device | str = "cpu"):
        self.P = prompt_len
        self.ent = torch.full((batch, gen_length), float("nan"), dtype=torch.float64, device=device)  # (B, G)

    def observe(self, rec) -> None:
        """Record the entropies of the tokens committed at this step (device ops only, no sync)."""
        # a block-diffusion row decodes its last block whole, past the answer: those positions are not kept
        hit = rec.committed & (rec.targets < self.P + self.ent.shape[1])
        rows = rec.rows[:, None].expand_as(rec.targets)[hit]
        pos = (rec.targets - self.P)[hit]
        self.ent[rows, pos] = rec.entropy[hit].to(self.ent.dtype)

    def means(self, n_positions: list[int]) -> list[float | None]:
        """Per row b: the mean entropy over its first ``n_positions[b]`` generated positions that were
        committed, in nats, or None when it committed none there."""
        ent = self.ent.cpu()
        out = []
        for b, n in enumerate(n_positions):
            e = ent[b, :max(int(n), 0)]
            e = e[~torch.isnan(e)]
            out.append(float(e.mean()) if e.numel() else None)
        return out


def measure_run(run) -> list[float | None]:
    """Iterate ``run`` (an engine ``Run``) to its end and return each row's ``mean_entropy``, in the
    order of ``run.results()``."""
    meter = EntropyMeter(run.B, run.P, run.G, run.state.tokens.device)
    for rec in run:
        meter.observe(rec)
    return meter.means([r.stats["generated_tokens"] for r in run.results()])


def model_card(path: Path | str) -> dict:
    """The checkpoint's ``ecache_model.json`` as a dict ({} when absent or unreadable)."""
    try:
        data = json.loads((Path(path) / MODEL_CARD_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def threshold_for(lm) -> float | None:
    """The loaded model's ``mean_entropy_p99`` (nats) from its ``ecache_model.json``, or None."""
    v = model_card(lm.path).get("mean_entropy_p99")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def trained_tasks(lm_or_path) -> list[str] | None:
    """The task domains the model was trained on (``trained_tasks`` of its ``ecache_model.json``), or
    None when the checkpoint does not say (any official checkpoint)."""
    path = getattr(lm_or_path, "path", lm_or_path)
    tasks = model_card(path).get("trained_tasks")
    return [str(t) for t in tasks] if isinstance(tasks, list) else None


def warn_untrained(lm, task: str | None) -> bool:
    """Warn (stderr, once) when ``task`` is not one the model was trained on (its
    ``ecache_model.json`` lists them; the embedded model: arith, code, list). Returns True if it warned."""
    tasks = trained_tasks(lm)
    if task is None or tasks is None or task in tasks:
        return False
    from ..console import warn

    warn(f"model {lm.name} was trained only on {', '.join(tasks)}, not {task}: its answers to {task} mean nothing "
         "(expect empty or wrong answers, and speedups of no use); use a model trained for it, e.g. llada-8b: "
         f"`ecache models pull llada-8b`, then `ecache calibrate --model llada-8b --task {task}` (a --task run "
         "needs the model's calibrated profile)")
    return True
