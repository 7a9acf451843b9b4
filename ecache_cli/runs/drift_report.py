"""Outputs of ``ecache trace-drift``: JSONL and TensorBoard sinks, the rich tables, and the PNG figure.

Sinks receive every (prompt, step) record as it is measured (``step``) and the finished report
(``close``), so a JSONL file or an event file is complete up to the last step even after Ctrl-C.
TensorBoard gets one run per prompt (``DIR/prompt-0000``, ...; overlay them in the UI) plus
``DIR/all-prompts`` with the volatility curve over every prompt. The figure uses matplotlib's Agg
backend (no display needed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..metrics.drift import SETTLE_MIN_COUNT, next_step_pairs
from ..terminal import fit
from .streams import write_jsonl
from .trace_drift import TraceReport


def make_sinks(jsonl: Path | None, tensorboard: Path | None, lm, settings, seed: int) -> list:
    """The sinks asked for: a :class:`JsonlSink` for ``--jsonl``, a :class:`TensorBoardSink` for
    ``--tensorboard`` (its text tab holds the model, the settings and the seed as JSON)."""
    sinks = []
    if jsonl is not None:
        sinks.append(JsonlSink(jsonl))
    if tensorboard is not None:
        settings_text = json.dumps({"model": lm.name, **settings.as_dict(), "seed": seed}, indent=1)
        sinks.append(TensorBoardSink(tensorboard, settings_text))
    return sinks


def figure_title(lm, settings) -> str:
    """The figure's title: model, cache policy and its parameters, gen and block length."""
    return (f"ecache trace-drift · {lm.name} · --cache {settings.cache} "
            + " ".join(f"{k}={v}" for k, v in settings.cache_params.items())
            + f" · gen {settings.decode.gen_length}, block {settings.decode.block_length}")


def plot_tau(settings) -> float | None:
    """The τ line of the figure: the entropy policy's τ, None for other policies."""
    return settings.cache_params.get("tau") if settings.cache == "entropy" else None


class JsonlSink:
    """One JSON record per (prompt, step), written and flushed as it is measured; ``-`` = stdout. A file is
    opened (and an existing one replaced) at the first record, so a run refused on its prompts after the
    model loads, or interrupted before its first step, leaves the file as it was (:attr:`records`: 0)."""

    def __init__(self, path: str | Path):
        import sys

        self.path, self.records = path, 0
        self.fh = sys.stdout if str(path) == "-" else None

    def step(self, record: dict, hist) -> None:
        """Write ``record`` as one line. A file that cannot be opened or written raises DataError naming
        ``--jsonl`` and its path (stdout's errors are the command's: a closed pipe, a full device)."""
        try:
            if self.fh is None:
                self.fh = open(self.path, "w", encoding="utf-8")
            write_jsonl(self.fh, record)
        except OSError as e:
            if str(self.path) == "-":
                raise
            from ..errors import DataError

            raise DataError(f"--jsonl {self.path}: cannot write ({e.strerror or e}); free space on the device or "
                            "write elsewhere") from None
        self.records += 1

    def close(self, report: TraceReport) -> None:
        if self.fh is not None and self.fh.name != "<stdout>":
            self.fh.close()


class TensorBoardSink:
    """Scalars and histograms with ``torch.utils.tensorboard.SummaryWriter``; global step = denoising step.

    Tags: ``signal/<kind>`` (of the tokens committed at the previous step), ``cache/refresh`` (0/1),
    ``cache/positions_computed``, ``cache/positions_served``, ``drift_k_mean/layer_NN``,
    ``drift_k_max/layer_NN``, ``drift_v_mean/layer_NN``, ``drift_v_max/layer_NN``,
    ``drift/k_mean_over_layers``, ``drift/v_mean_over_layers``, ``fidelity/mismatched_tokens``,
    ``fidelity/kl_nats``, histogram ``drift_k_positions`` (per-position K drift, mean over layers, of
    the served positions), and ``volatility/k_change`` (global step = steps since commit).
    """

    def __init__(self, logdir: str | Path, settings_text: str):
        from torch.utils.tensorboard import SummaryWriter

        self.SummaryWriter = SummaryWriter
        self.logdir, self.settings_text = Path(logdir), settings_text
        self.writers: dict[int, object] = {}

    def _writer(self, prompt: int):
        if prompt not in self.writers:
            w = self.SummaryWriter(log_dir=str(self.logdir / f"prompt-{prompt:04d}"))
            w.add_text("settings", self.settings_text, 0)
            self.writers[prompt] = w
        return self.writers[prompt]

    def step(self, r: dict, hist) -> None:
        w, t = self._writer(r["prompt"]), r["step"]
        for kind, v in (r["signal"] or {}).items():
            if v is not None:
                w.add_scalar(f"signal/{kind}", v, t)
        w.add_scalar("cache/refresh", float(r["refresh"]), t)
        w.add_scalar("cache/positions_computed", r["computed"], t)
        w.add_scalar("cache/positions_served", r["served"], t)
        for name in ("k", "v"):
            for stat in ("mean", "max"):
                for layer, v in enumerate(r[f"drift_{name}_{stat}"]):
                    w.add_scalar(f"drift_{name}_{stat}/layer_{layer:02d}", v, t)
        w.add_scalar("drift/k_mean_over_layers", r["drift_k"], t)
        w.add_scalar("drift/v_mean_over_layers", r["drift_v"], t)
        w.add_scalar("fidelity/mismatched_tokens", r["fidelity_mismatch"], t)
        w.add_scalar("fidelity/kl_nats", r["fidelity_kl"], t)
        if hist is not None and hist.numel() > 0:
            w.add_histogram("drift_k_positions", hist.numpy(), t)

    def close(self, report: TraceReport) -> None:
        for prompt, w in self.writers.items():
            for point in report.per_prompt.get(prompt, report.volatility).curve():
                w.add_scalar("volatility/k_change", point["mean"], point["n"])
            w.close()
        w = self.SummaryWriter(log_dir=str(self.logdir / "all-prompts"))
        for point in report.volatility.curve():
            w.add_scalar("volatility/k_change", point["mean"], point["n"])
        w.add_text("settings", self.settings_text, 0)
        w.add_text("summary", "```\n" + json.dumps(report.summary(), indent=1) + "\n```", 0)
        w.close()


# --- rich tables ----------------------------------------------------------------------------------------


def sci(x: float | None) -> str:
    """Compact number for tables: '0', '3.2e-4', or '–' for None."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if x == 0:
        return "0"
    mant, exp = f"{x:.1e}".split("e")
    return f"{mant}e{int(exp)}"


def shown_records(records: list[dict], rows: int) -> tuple[list[dict], int]:
    """Condense per prompt: every ⌈steps/rows⌉-th step, every refresh step that follows a partial step
    (the first of a run of refreshes) and the last step (rows ≤ 0: all). Returns (records, stride)."""
    if rows <= 0:
        return records, 1
    by_prompt: dict[int, list[dict]] = {}
    for r in records:
        by_prompt.setdefault(r["prompt"], []).append(r)
    stride = max(1, max(-(-len(v) // rows) for v in by_prompt.values()) if by_prompt else 1)
    keep = []
    for rs in by_prompt.values():
        keep += [r for i, r in enumerate(rs) if i % stride == 0 or i == len(rs) - 1
                 or (r["refresh"] and i > 0 and not rs[i - 1]["refresh"])]
    return keep, stride


def render_steps(console, report: TraceReport, rows: int, wide: bool = False) -> None:
    """Per-step table on ``console`` (stderr). The default view fits 80 columns; ``wide`` adds the
    K drift's maximum and the V drift (every number is in ``--jsonl``). Cells are never cut (fold)."""
    from rich import box
    from rich.table import Table

    shown, stride = shown_records(report.records, rows)
    multi = len({r["prompt"] for r in report.records}) > 1
    sig = report.signal
    caption = (f"{len(shown)} of {len(report.records)} steps shown (every {stride} steps, the first refresh "
               f"after partial steps, the last); all steps in --jsonl" if stride > 1 else None)
    t = Table(title="trace-drift: per-step signal, KV drift and fidelity", caption=caption, header_style="bold",
              box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0))
    if multi:
        t.add_column("#", justify="right")
    cols = ("step", "blk", "fwd", "comp", "srv", "E(t−1)", "K drift", "K max", "V drift", "worst", "fid.", "ms")
    visible = [c not in ("K max", "V drift") or wide for c in cols]
    for col, on in zip(cols, visible):
        if on:
            t.add_column(col, justify="right", no_wrap=True, overflow="fold")
    for i, r in enumerate(shown):
        if multi and i > 0 and r["prompt"] != shown[i - 1]["prompt"]:
            t.add_section()
        partial = r["served"] > 0
        worst = max(range(len(r["drift_k_mean"])), key=lambda i: r["drift_k_mean"][i]) if partial else None
        cells = [str(r["step"]), str(r["block"]), "[bold yellow]full[/]" if r["refresh"] else "part",
                 str(r["computed"]), str(r["served"]), _fmt_signal((r["signal"] or {}).get(sig)),
                 sci(r["drift_k"]) if partial else "–", sci(max(r["drift_k_max"])) if partial else "–",
                 sci(r["drift_v"]) if partial else "–", "–" if worst is None else str(worst),
                 f"{r['fidelity_mismatch']}/{r['committed']}", f"{r['forward_ms']:.1f}"]
        t.add_row(*([str(r["prompt"])] if multi else []), *[c for c, on in zip(cells, visible) if on])
    _prose(console, fit(t))
    _prose(console, f"fwd: full refresh or partial forward; comp / srv: positions computed / served from the cache; "
                  f"E(t−1): {sig} of the previous step's commits (decides this step's refresh); drift: "
                  "1 − cos(cached, fresh) of K/V (all KV heads of a layer) over the served positions, mean over "
                  f"layers{' (K max: over layers and positions)' if wide else ''}; worst layer: largest mean K drift; "
                  "fid.: committed "
                  "tokens whose greedy choice differs under a fresh full forward / committed; ms: live forward "
                  "only (the shadow forward is timed apart).", style="dim", highlight=False)


def _prose(console, *objects, **kwargs) -> None:
    """Print prose wrapped at words to the console's width (ecache's consoles soft-wrap, which keeps
    one-line errors whole but would leave a paragraph as long as a terminal's edge cuts it)."""
    from ..terminal import prose

    prose(console, *objects, **kwargs)


def _fmt_signal(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def no_drift_reason(report: TraceReport) -> str | None:
    """Why ``report`` holds no KV drift to show, in the words of both the text summary and the figure's
    drift panels; None where it holds some. Either no step served a position from the cache (every step
    a full refresh, e.g. ``--cache none``), or a block-diffusion model, whose drift is zero by
    construction (docs/METHOD.md §5): what it measures is at most float rounding."""
    partial = [r for r in report.records if r["served"] > 0]
    if not report.records:
        return "no KV drift measured: no denoising step was traced"
    if not partial:
        return ("no KV drift measured: " + ("every step was a full refresh, so nothing was served from the cache"
                                            if all(r["refresh"] for r in report.records) else
                                            "no step served a position from the cache"))
    if report.block_causal:
        worst = max(max(r["drift_k_max"], default=0.0) for r in partial)
        rounding = ("every K drift measured is exactly 0" if worst == 0 else
                    f"the largest K drift measured, {sci(worst)}, is float rounding")
        return ("no KV drift: it is zero by construction for this block-diffusion model (block-causal attention: "
                "its queries read from the cache only finished blocks, whose keys and values never change); "
                + rounding)
    return None


def _exact_note(console, report: TraceReport) -> None:
    """For a block-diffusion model: why its drift is zero (docs/METHOD.md §5), with the largest measured."""
    if report.block_causal and any(r["served"] > 0 for r in report.records):  # a reason is then always given
        _prose(console, f"{no_drift_reason(report)}, so the signal-vs-drift figures above carry no information",
               highlight=False)


def render_summary(console, report: TraceReport) -> None:
    """Correlations and the volatility curve on ``console`` (stderr)."""
    from rich.table import Table

    corr = report.correlation()
    _prose(console, "\n[bold]Signal vs next-step drift[/] (scipy.stats, two-sided p-values)", highlight=False)
    for c in corr.values():
        _prose(console, f"  x = {c['x']}\n  y = {c['y']}", highlight=False, style="dim")
        if c["pearson_r"] is None:
            _prose(console, f"  n = {c['n']} pairs: undefined (fewer than 3 pairs or a constant series)",
                   highlight=False)
        else:
            # one statistic a line: a narrow terminal wraps between them, never inside "ρ = +0.976"
            _prose(console, f"  n = {c['n']}\n  Pearson r = {c['pearson_r']:+.3f} (p = {c['pearson_p']:.2g})\n"
                          f"  Spearman ρ = {c['spearman_rho']:+.3f} (p = {c['spearman_p']:.2g})", highlight=False)
    if report.records and not any(r["served"] > 0 for r in report.records):
        _prose(console, f"  ({no_drift_reason(report)})", highlight=False)
    curve = report.volatility.curve()
    settle = report.volatility.settle_steps(report.level)
    t = Table(title="Volatility of committed tokens' K (fresh features, mean over layers)", header_style="bold")
    for col in ("steps since commit n", "mean change (1 − cos)", "tokens measured"):
        t.add_column(col, justify="right")
    shown = _condense_curve(curve, report.level, settle)
    for p in shown:
        mark = " ←" if settle is not None and p["n"] == settle else ""
        t.add_row(str(p["n"]), sci(p["mean"]) + mark, str(p["count"]))
    if len(shown) < len(curve):
        t.caption = (f"{len(shown)} of {len(curve)} bins shown: the first 12, powers of two, the last, and every bin "
                     f"of ≥ {SETTLE_MIN_COUNT} tokens at or above the level (--json has all)")
    _prose(console, fit(t))
    tps = report.tokens_per_step()
    if not curve:
        _prose(console, "volatility: no token stayed on the canvas for 2 steps after its commit; nothing to bin")
    elif settle is None:
        _prose(console, f"volatility: the mean K change never stays below the level {report.level:g} "
                      f"(--volatility-level) in the bins of ≥ {SETTLE_MIN_COUNT} tokens", highlight=False)
    else:
        _prose(console, f"volatility: from n = {settle} steps after its commit on, a token's mean K change per step is "
                      f"below {report.level:g} (--volatility-level; bins of ≥ {SETTLE_MIN_COUNT} tokens); "
                      f"at {tps:.2f} tokens committed per step that is "
                      f"≈ {settle * tps:.0f} tokens"
                      + ("" if report.block_causal else ", a guide for EntropyCache's --recent-k"), highlight=False)
    _exact_note(console, report)
    routed = report.summary()["route_change_mean"]
    if routed is not None:
        _prose(console, f"routing: on partial steps, caching changed {100 * routed:.1f}% of the computed positions' "
                        "expert choices against a full forward (mean over the MoE layers)", highlight=False)
    _prose(console, f"time: live steps {report.live_s:.2f} s, shadow forwards {report.shadow_s:.2f} s "
                  "(excluded from the live times)",
                  style="dim", highlight=False)


def _condense_curve(curve: list[dict], level: float, settle: int | None, head: int = 12) -> list[dict]:
    """The first ``head`` bins, then bins at powers of two, the last one, and the bins that decide the
    verdict: the settling bin ``settle`` and every bin of ≥ ``SETTLE_MIN_COUNT`` tokens at or above
    ``level`` (a hidden one would leave "never stays below" unexplained)."""
    out = []
    for i, p in enumerate(curve):
        deciding = p["n"] == settle or (p["count"] >= SETTLE_MIN_COUNT and p["mean"] >= level)
        if i < head or (p["n"] & (p["n"] - 1)) == 0 or i == len(curve) - 1 or deciding:
            out.append(p)
    return out


# --- figure -------------------------------------------------------------------------------------------


def plot(report: TraceReport, path: str | Path, title: str, tau: float | None = None) -> None:
    """Write a 2×2 PNG: signal over steps with refreshes (prompt 0), drift over steps, signal vs
    next-step drift (all prompts), and the volatility curve. matplotlib's own warnings (an empty legend,
    a log axis without data...) are kept off the user's stderr: the panels say in words what is missing."""
    import warnings

    from ..outputs import pyplot

    plt = pyplot()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig = figure(report, title, tau)
        try:
            fig.savefig(path, dpi=110)
        finally:
            plt.close(fig)


def figure(report: TraceReport, title: str, tau: float | None = None):
    """The matplotlib figure :func:`plot` writes (the caller closes it). Where the report has no KV drift to
    show (:func:`no_drift_reason`), the drift panel and the signal-vs-drift panel say why."""
    from ..outputs import pyplot

    plt = pyplot()

    recs = [r for r in report.records if r["prompt"] == (report.records[0]["prompt"] if report.records else 0)]
    sig = report.signal
    unit = "nats" if "entropy" in sig else "1 − p"
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), constrained_layout=True)
    (a1, a2), (a3, a4) = axes
    reason = no_drift_reason(report)
    _plot_signal(a1, recs, sig, unit, tau)
    _plot_drift(a2, recs, reason)
    steps = [r["step"] for r in recs]
    if steps:
        a1.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
        a2.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
    _plot_next_step(a3, report, sig, unit, tau, reason)
    _plot_volatility(a4, report)
    fig.suptitle(title, fontsize=11)
    return fig


def panel_notes(fig) -> list[str]:
    """The texts written on the figure's panels (the notes of :func:`figure`), panel by panel, each on one
    line (as wrapped on the panel, joined at spaces)."""
    return [" ".join(t.get_text().split()) for ax in fig.axes for t in ax.texts]


def _legend(ax, **kwargs) -> None:
    """A legend where the panel has labelled artists (matplotlib warns on an empty one)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def _note(ax, text: str, width: int = 62) -> None:
    """``text`` wrapped in the middle of the panel, on a white box over whatever is drawn."""
    import textwrap

    ax.text(0.5, 0.5, textwrap.fill(text, width, break_on_hyphens=False), transform=ax.transAxes, ha="center",
            va="center", fontsize=9, color="dimgray", bbox=dict(facecolor="white", edgecolor="lightgray", alpha=0.9))


def _mark_refresh(ax, recs: list[dict]) -> None:
    """A vertical line at each full-refresh step of ``recs``."""
    for i, s in enumerate(r["step"] for r in recs if r["refresh"]):
        ax.axvline(s, color="tab:orange", alpha=0.25, lw=1.2, label="full refresh" if i == 0 else None)


def _plot_signal(ax, recs: list[dict], sig: str, unit: str, tau: float | None) -> None:
    """One prompt's signal per step, its refreshes and τ (entropy signals)."""
    xs = [(r["step"], r["signal"][sig]) for r in recs if r["signal"] and r["signal"].get(sig) is not None]
    _mark_refresh(ax, recs)
    if xs:
        ax.plot(*zip(*xs), "-o", ms=2.5, lw=1, color="tab:blue", label=f"E(t−1) = {sig} of step t−1's commits")
    if tau is not None and "entropy" in sig:
        ax.axhline(tau, color="tab:red", ls="--", lw=1, label=f"τ = {tau:g} {unit}")
    ax.set(title=f"Signal that decides each step's refresh (prompt {recs[0]['prompt'] if recs else 0})",
           xlabel="denoising step t", ylabel=f"signal E ({unit})")
    _legend(ax, loc="best", fontsize=8, framealpha=0.9)


def _plot_drift(ax, recs: list[dict], reason: str | None = None) -> None:
    """One prompt's K and V drift per step (log scale), broken at refresh steps (nothing served); with
    ``reason`` (:func:`no_drift_reason`) written on the panel where the report has no drift to show."""
    _mark_refresh(ax, recs)
    steps = [r["step"] for r in recs]
    nan = float("nan")
    series = (("K drift, mean over layers", "-o", "tab:green", lambda r: r["drift_k"]),
              ("V drift, mean over layers", "-o", "tab:purple", lambda r: r["drift_v"]),
              ("K drift, max over layers and positions", ":", "tab:green", lambda r: max(r["drift_k_max"])))
    drawn = False
    for label, style, color, get in series:
        ys = [get(r) if r["served"] > 0 and get(r) > 0 else nan for r in recs]
        if any(y == y for y in ys):
            ax.plot(steps, ys, style, ms=2.5, lw=1, color=color, label=label)
            drawn = True
    title = "KV drift of the cache-served positions (partial steps)"
    if drawn:
        ax.set_yscale("log")
        if reason:  # drift drawn, yet none by construction (block diffusion): the lines leave no room for a note
            title += "\nno KV drift by construction (block-causal): float rounding only"
    else:
        ax.set_yticks([])
        _note(ax, reason or "no KV drift to draw for this prompt: none of its steps served a position whose drift "
                            "is above 0")
    ax.set(title=title, xlabel="denoising step t", ylabel="drift 1 − cos(cached, fresh)")
    _legend(ax, loc="best", fontsize=8, framealpha=0.9)


def _plot_next_step(ax, report: TraceReport, sig: str, unit: str, tau: float | None,
                    reason: str | None = None) -> None:
    """The signal at step t against the K drift at step t+1, every prompt, with its correlations; with
    ``reason`` (:func:`no_drift_reason`), why there is no drift to correlate."""
    x, y = next_step_pairs(report.records, sig)
    c = report.correlation()["next_step_drift"]
    pos = [(a, b) for a, b in zip(x, y) if b > 0]
    if pos:
        ax.scatter(*zip(*pos), s=10, alpha=0.6, color="tab:green")
        ax.set_yscale("log")
    stat = ("undefined (fewer than 3 pairs or a constant series)" if c["pearson_r"] is None else
            f"Pearson r = {c['pearson_r']:+.2f} (p={c['pearson_p']:.1g}), Spearman ρ = {c['spearman_rho']:+.2f} "
            f"(p={c['spearman_p']:.1g}), n = {c['n']}")
    if reason:
        _note(ax, reason + ("" if c["pearson_r"] is None else ", so these correlations carry no information"))
    elif not pos:
        _note(ax, "no pair to draw: no partial step with a K drift above 0 follows a step with a signal")
    ax.set(title=f"Signal at step t vs K drift at step t+1 (partial steps t+1, all prompts)\n{stat}",
           xlabel=f"E_t: {sig} of step t's commits ({unit})", ylabel="K drift at t+1 (1 − cos, mean over layers)")
    if tau is not None:  # the entropy policy only serves from the cache after E_t ≤ τ
        ax.axvline(tau, color="tab:red", ls="--", lw=1)
        ax.text(0.02, 0.02, "entropy policy: partial steps follow E_t ≤ τ only;\n"
                "for the full range run --cache dual or a large --tau",
                transform=ax.transAxes, fontsize=8, color="dimgray", va="bottom")


def _plot_volatility(ax, report: TraceReport) -> None:
    """Committed tokens' K change per step against the steps since their commit, the level and where
    the curve settles below it (bins of few tokens drawn faint)."""
    curve = report.volatility.curve()
    pts = [(p["n"], p["mean"]) for p in curve if p["mean"] > 0 and p["count"] >= SETTLE_MIN_COUNT]
    few = [(p["n"], p["mean"]) for p in curve if p["mean"] > 0 and p["count"] < SETTLE_MIN_COUNT]
    if pts:
        ax.plot(*zip(*pts), "-o", ms=3, color="tab:blue", label="mean K change per step")
    if few:
        ax.plot(*zip(*few), "o", ms=3, color="tab:blue", alpha=0.3, label=f"bins of < {SETTLE_MIN_COUNT} tokens")
    if pts or few:
        ax.set_yscale("log")
    ax.axhline(report.level, color="tab:red", ls="--", lw=1, label=f"level {report.level:g}")
    settle = report.volatility.settle_steps(report.level)
    if settle is not None:
        ax.axvline(settle, color="tab:gray", ls=":", lw=1.2, label=f"below the level from n = {settle}")
    ax.set(title="Volatility of committed tokens' K (fresh features, all prompts)",
           xlabel="steps since the token was committed n", ylabel="1 − cos(K at step n−1, K at step n)")
    ax.legend(loc="upper right", fontsize=8)
