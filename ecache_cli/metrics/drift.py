"""Drift maths for ``ecache trace-drift``: cosine drift of cached K/V, token volatility, correlations.

Definitions (docs/METHOD.md §4):

- drift of a cached vector against the fresh one = 1 − cos(cached, fresh), per canvas position, with
  the position's vector being all KV heads of one layer concatenated (H_kv·D values). Cosine is
  invariant to RoPE (both vectors of a position carry the same rotation), so K after RoPE is fine.
  It is computed as ½‖â − b̂‖² (â, b̂ unit vectors) in float32: the same quantity as 1 − cos, but
  accurate for the tiny angles that matter here; bit-identical vectors give exactly 0.
- a step's drift of a layer = mean (and max) of the per-position drift over the positions served from
  the cache at that step (not computed by the live forward, not padding); 0 when none was served.
- volatility: the same cosine change, between the fresh K of a committed token at two consecutive
  steps, averaged over layers, binned by n = steps since its commit (``VolatilityBins``).
- correlations: Pearson and Spearman (scipy.stats) with two-sided p-values.

Trade-off: everything is per position on the device, then reduced per row; one (B, T) float32 buffer
per layer is alive at a time, so the cost is small next to the shadow forward that produces ``fresh``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

SETTLE_MIN_COUNT = 5  # volatility bins with fewer tokens are too noisy to decide where the curve settles


def cosine_drift(cached: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Per-position cosine drift 1 − cos between two K (or V) tensors of one layer.

    Args:
        cached, fresh: (B, H_kv, T, D), any float dtype (the store's).
    Returns:
        (B, T) float32 in [0, 2]; exactly 0 where the two vectors are bit-identical. A zero vector
        counts as orthogonal to a non-zero one (drift 1).
    """
    B, H, T, D = cached.shape
    a = cached.transpose(1, 2).reshape(B, T, H * D).float()  # (B, T, H*D)
    b = fresh.transpose(1, 2).reshape(B, T, H * D).float()
    same = (a == b).all(-1)  # (B, T)
    a = a / a.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    b = b / b.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    d = 0.5 * (a - b).pow(2).sum(-1)  # (B, T) = 1 - cos
    return d.clamp_(0.0, 2.0).masked_fill_(same, 0.0)


def masked_mean_max(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and max of ``values`` (B, T) over ``mask`` (B, T) bool, per row; (B,) float32 each, 0 for
    rows with an empty mask."""
    m = mask.float()
    n = m.sum(1)  # (B,)
    mean = (values * m).sum(1) / n.clamp_min(1.0)
    mx = values.masked_fill(~mask, 0.0).amax(1) if values.shape[1] else torch.zeros_like(n)
    return mean, mx


def layer_drift(cached_k: list[torch.Tensor], cached_v: list[torch.Tensor], fresh_k: list[torch.Tensor],
                fresh_v: list[torch.Tensor], served: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-layer K and V drift of the served positions.

    Args:
        cached_k, cached_v, fresh_k, fresh_v: one (B, H_kv, T, D) tensor per layer (the live store after
            the forward, and a shadow full forward's store on the same canvas).
        served: one (B, T) bool per layer, positions served from the cache at that layer (real tokens the
            live forward did not compute there; the same mask at every layer unless the forward was
            layer-selective).
    Returns:
        dict of (B, L) float32: ``k_mean``, ``k_max``, ``v_mean``, ``v_max`` (0 where a layer served
        nothing); ``k_pos`` (B, T) float32, each position's K drift averaged over the layers that served
        it (0 if none; for histograms).
    """
    out = {key: [] for key in ("k_mean", "k_max", "v_mean", "v_max")}
    k_sum = torch.zeros(served[0].shape, dtype=torch.float32, device=served[0].device)
    k_cnt = torch.zeros_like(k_sum)
    for ck, cv, fk, fv, sv in zip(cached_k, cached_v, fresh_k, fresh_v, served):
        dk, dv = cosine_drift(ck, fk), cosine_drift(cv, fv)  # (B, T) each
        for name, d in (("k", dk), ("v", dv)):
            mean, mx = masked_mean_max(d, sv)
            out[f"{name}_mean"].append(mean)
            out[f"{name}_max"].append(mx)
        k_sum += dk.masked_fill(~sv, 0.0)
        k_cnt += sv.float()
    res = {key: torch.stack(vals, 1) for key, vals in out.items()}  # (B, L)
    res["k_pos"] = k_sum / k_cnt.clamp_min(1.0)
    return res


def layer_mean_change(prev_k: list[torch.Tensor], cur_k: list[torch.Tensor]) -> torch.Tensor:
    """Cosine change of K between two steps, per position, averaged over layers.

    Args:
        prev_k, cur_k: one (B, H_kv, T, D) tensor per layer (fresh K of consecutive steps, same rows).
    Returns:
        (B, T) float32.
    """
    total = torch.zeros(cur_k[0].shape[0], cur_k[0].shape[2], dtype=torch.float32, device=cur_k[0].device)
    for p, c in zip(prev_k, cur_k):
        total += cosine_drift(p, c)
    return total / len(cur_k)


@dataclass
class VolatilityBins:
    """Running mean of a token's K change per step, binned by n = steps since the token was committed.

    The change attributed to bin n is between the canvases of steps s+n−1 and s+n of a token committed
    at step s (the canvas of step s+1 is the first that holds it), so bins start at n = 2.
    """

    sums: np.ndarray = field(default_factory=lambda: np.zeros(0))
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def add(self, age: torch.Tensor, change: torch.Tensor, mask: torch.Tensor) -> None:
        """Accumulate ``change`` (B, T) float at ``mask`` (B, T) bool into bins ``age`` (B, T) long (≥ 0)."""
        a, c = age[mask].long().cpu(), change[mask].double().cpu()
        if a.numel() == 0:
            return
        size = int(a.max()) + 1
        self._grow(size)
        self.sums[:size] += torch.bincount(a, weights=c, minlength=size).numpy()
        self.counts[:size] += torch.bincount(a, minlength=size).numpy()

    def merge(self, other: "VolatilityBins") -> None:
        """Add another accumulator's bins into this one."""
        self._grow(len(other.sums))
        self.sums[:len(other.sums)] += other.sums
        self.counts[:len(other.counts)] += other.counts

    def _grow(self, size: int) -> None:
        if size > len(self.sums):
            self.sums = np.concatenate([self.sums, np.zeros(size - len(self.sums))])
            self.counts = np.concatenate([self.counts, np.zeros(size - len(self.counts), dtype=np.int64)])

    def curve(self) -> list[dict]:
        """[{n, mean, count}] for every bin with data, n ascending (mean: 1 − cos, averaged over layers)."""
        return [{"n": int(n), "mean": float(self.sums[n] / self.counts[n]), "count": int(self.counts[n])}
                for n in range(len(self.counts)) if self.counts[n] > 0]

    def settle_steps(self, level: float, min_count: int = SETTLE_MIN_COUNT) -> int | None:
        """Smallest n whose mean change and every later bin's mean change is below ``level``, over the bins
        holding at least ``min_count`` tokens (the last bins of a run hold few and are noisy); None if the
        last such bin is not below it (or there is none)."""
        curve = [p for p in self.curve() if p["count"] >= min_count]
        settle = None
        for point in reversed(curve):
            if point["mean"] >= level:
                break
            settle = point["n"]
        return settle


def correlation(x, y) -> dict:
    """Pearson and Spearman correlation of two equal-length series, with two-sided p-values (scipy.stats).

    Returns {n, pearson_r, pearson_p, spearman_rho, spearman_p}; the statistics are None when fewer than
    3 finite pairs remain or either series is constant (the correlation is undefined).
    """
    from scipy import stats

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    out = {"n": int(len(x)), "pearson_r": None, "pearson_p": None, "spearman_rho": None, "spearman_p": None}
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return out
    pr, sr = stats.pearsonr(x, y), stats.spearmanr(x, y)
    out.update(pearson_r=_num(pr[0]), pearson_p=_num(pr[1]), spearman_rho=_num(sr[0]), spearman_p=_num(sr[1]))
    return out


def next_step_pairs(records: list[dict], signal: str, drift_key: str = "drift_k") -> tuple[list, list]:
    """Pair each step's ``signal`` (of the tokens committed at the previous step, as recorded) with the
    same step's drift, per prompt, keeping partial steps only (rows that served something from the
    cache). Equivalently: signal at step t vs drift at step t+1.

    Args:
        records: per-(prompt, step) dicts with ``signal`` {kind: float | None}, ``served`` and ``drift_key``.
    Returns:
        (signals, drifts), two lists of floats of equal length.
    """
    xs, ys = [], []
    for r in records:
        s = (r.get("signal") or {}).get(signal)
        if s is None or r["served"] == 0 or not math.isfinite(s):
            continue
        xs.append(float(s))
        ys.append(float(r[drift_key]))
    return xs, ys


def increment_pairs(records: list[dict], signal: str) -> tuple[list, list]:
    """(E_t, drift_{t+1} − drift_t) over consecutive steps of the same prompt that both served something
    from the cache; ``records`` in step order per prompt, as ``next_step_pairs`` takes them. Removes the
    slow growth of drift since the last refresh, which a plain next-step correlation also sees."""
    last: dict[int, dict] = {}
    xs, ys = [], []
    for r in records:
        prev = last.get(r["prompt"])
        last[r["prompt"]] = r
        s = (r.get("signal") or {}).get(signal)
        if prev is None or prev["step"] != r["step"] - 1 or s is None or not math.isfinite(s):
            continue
        if r["served"] > 0 and prev["served"] > 0:
            xs.append(float(s))
            ys.append(float(r["drift_k"] - prev["drift_k"]))
    return xs, ys


def _num(v) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None
