"""``--watch``: one row of a run shown live on a terminal, step by step (``ecache generate``, ``ecache chat``).

Each denoising step redraws one frame (rich ``Live``, no automatic refresh: exactly one frame per step):

- a header: model, cache policy and τ, the step and the block;
- the canvas of the row's generated positions, wrapped at the console's width: a masked position is a
  dim ``░``, a committed token its text (a newline shown as ``↵``, a tab as ``→``), an end token a dim
  ``·``, a token without text of its own (a special token, part of a character) a dim ``⋄``; the
  tokens this step committed are highlighted, the current block is underlined. A canvas taller than
  the terminal shows the lines around the current block;
- a line of the run's refresh decisions so far (``█`` refresh, ``·`` partial; the latest steps);
- the status lines of the latest steps, one per step (:func:`status_line`): step, block, refresh or
  partial with what the forward computed (positions × layers and its share of a full forward), the
  signal that decided the step (the entropy of the previous step's commits, as ``ecache trace-drift``
  records it) against τ as a small bar, and the tokens per second so far (decoding time alone).

The header and each status line break between their `` · `` fields onto as many rows as the
console's width needs (``terminal.fold_fields``), never cut with ``…``.
The answer text and the stats come after the view, as the command writes them without ``--watch``.
:func:`watch_available` says whether the console is a terminal (else one warning line and no view).
"""

from __future__ import annotations

import math
import time
from typing import Iterator

from rich.cells import cell_len
from rich.console import Group
from rich.text import Text

from ..contract.state import SIGNALS
from ..terminal import fold_fields
from .final_text import final_lengths

MASK, END, EMPTY = "░", "·", "⋄"  # a masked position, an end token, a token without text of its own
#: Status lines of earlier steps kept under the canvas (the latest step's is last).
HISTORY = 4
#: Cells of the signal bar; τ sits at its middle, a full bar is 2 τ or more.
BAR = 8
STYLES = {"mask": "grey50", "end": "grey50", "new": "bold black on green3", "block": "underline",
          "refresh": "bold red", "partial": "green", "over": "red", "under": "green"}


def watch_available(console) -> bool:
    """Whether ``console`` can show the live view (a terminal)."""
    return bool(console.is_terminal)


def visible(text: str) -> str:
    """``text`` as the canvas shows it on one line: newline ``↵``, tab ``→``, other control characters ``�``."""
    return "".join("↵" if c == "\n" else "→" if c == "\t" else "\ufffd" if ord(c) < 32 or c == "\x7f" else c
                   for c in text)


def signal_bar(value: float | None, tau: float | None) -> Text:
    """``value`` against ``tau`` as a bar of :data:`BAR` cells (τ at the middle mark, 2 τ fills it), red
    above τ, green at or below; no bar when there is no τ (a policy without one) or no value."""
    if value is None or tau is None or math.isnan(value):
        return Text("")
    ratio = (min(value / tau, 2.0) if tau > 0 else (2.0 if value > 0 else 0.0)) / 2
    eighths = round(ratio * BAR * 8)
    full, part = divmod(eighths, 8)
    cells = "█" * full + ("▏▎▍▌▋▊▉"[part - 1] if part else "")
    cells = cells.ljust(BAR)
    mid = BAR // 2
    style = STYLES["over"] if value > tau else STYLES["under"]
    out = Text("▕")
    out.append(cells[:mid], style=style)
    out.append("│" if cells[mid] == " " else cells[mid], style=style if cells[mid] != " " else "bold")
    out.append(cells[mid + 1:], style=style)
    out.append("▏")
    return out


def status_line(step: int, steps: int | None, block: int, blocks: int, refresh: bool, computed: float, n_layers: int,
                total: int, signal: float | None, tau: float | None, tokens_per_s: float | None) -> Text:
    """One step's status line (module docstring): ``step 12/32 · blk 2/4 · partial 9×2 = 19% · E 0.0012
    ▕██│  ▏ · 80 tok/s``. ``step``, ``block``: 0-based; ``steps``: the run's steps (None: not fixed,
    threshold decoding). ``computed``: positions the step's forward computed (layer-averaged), ``total``:
    a full forward's positions (the canvas), ``signal`` the value that decided the step (None: none)."""
    line = Text(f"step {step + 1:>{len(str(steps))}}/{steps}" if steps else f"step {step + 1}")
    line.append(f" · blk {block + 1}/{blocks} · ")
    share = computed / max(total, 1)
    pos = f"{computed:.0f}" if abs(computed - round(computed)) < 0.05 else f"{computed:.1f}"
    if refresh:
        line.append("REFRESH", style=STYLES["refresh"])
    else:
        line.append("partial", style=STYLES["partial"])
    line.append(f" {pos}×{n_layers} = {100 * share:.0f}%")
    if signal is not None and math.isfinite(signal):
        line.append(f" · E {signal:.3g} ")
        line.append_text(signal_bar(signal, tau))
    else:
        line.append(" · E –")
    if tokens_per_s is not None:
        line.append(f" · {tokens_per_s:.0f} tok/s")
    return line


class WatchView:
    """The live view of run row ``row`` of ``run`` on ``console`` (a terminal); see the module docstring.

    ``title``: the header's start (e.g. ``tiny · cache entropy``). ``delay``: seconds to wait after each
    frame (``--watch-delay``, for demos; not counted in tokens/s). Iterate :meth:`follow` in place of the
    run: it yields every StepRecord after drawing it. ``frames`` keeps the frames drawn when
    ``keep_frames`` (the README picture's script).
    """

    def __init__(self, console, run, row: int = 0, title: str = "", delay: float = 0.0, keep_frames: bool = False):
        self.console, self.run, self.row, self.title, self.delay = console, run, row, title, delay
        engine = run.engine
        self.tok, self.spec = engine.tokenizer, engine.spec
        self.end_ids = set(engine.end_ids.tolist())
        self.tau = getattr(run.policy, "tau", None)
        kind = getattr(run.policy, "signal", None)
        self.kind = kind if kind in SIGNALS else "max-entropy"  # the policy's own signal, else the paper's
        # block diffusion: a row whose prompt ends inside a block decodes one block more (engine/canvas.py)
        offset = run.state.block_offset
        self.blocks = run.blocks.num_blocks + (0 if offset is None else int(offset[0] > 0))
        spb = run.blocks.steps_per_block
        self.steps = spb * self.blocks if spb else None  # None: threshold decoding, as many as the blocks need
        self.busy = 0.0  # seconds spent in the engine's steps
        self.committed = 0  # tokens the row committed so far
        self.prev_signal: float | None = None  # the signal of the previous step's commits
        self.lines: list[Text] = []  # status lines, one per step of the row
        self.refreshes: list[bool] = []
        self.prefix_ids: list[int] = []  # the final prefix (no mask before it) and its pieces, read once each
        self.prefix_pieces: list[str] = []
        self.prefix_text = ""
        self.pieces: dict[int, str] = {}
        self.keep_frames, self.frames = keep_frames, []
        self.last = None  # the latest frame

    def follow(self) -> Iterator:
        """Iterate the run, drawing one frame per step of the watched row; yields every StepRecord."""
        from rich.live import Live

        it = iter(self.run)
        # stdout stays the answers' alone (not redirected through the view)
        with Live(console=self.console, auto_refresh=False, transient=False, vertical_overflow="crop",
                  redirect_stdout=False) as live:
            while True:
                t0 = time.perf_counter()
                try:
                    rec = next(it)
                except StopIteration:
                    break
                self.busy += time.perf_counter() - t0
                frame = self.observe(rec)
                if frame is not None:
                    live.update(frame, refresh=True)
                    if self.delay > 0:
                        time.sleep(self.delay)
                yield rec

    def observe(self, rec):
        """Read step ``rec`` of the watched row (the run's state right after it) and return the frame to
        draw, or None when the row is no longer in the batch."""
        rows = rec.rows.tolist()
        if self.row not in rows:
            return None
        b = rows.index(self.row)
        st, P = self.run.state, self.run.P
        tokens, masked = st.tokens[b, P:].tolist(), st.masked[b, P:]
        new = {int(t) - P for t in rec.targets[b][rec.committed[b]].tolist()}
        refresh = bool(rec.refresh[b])
        self.committed += len(new)
        self.refreshes.append(refresh)
        tps = self.committed / self.busy if self.busy > 0 else None
        self.lines.append(status_line(int(st.row_step[b]), self.steps,
                                      int(rec.block[b]), self.blocks, refresh, float(rec.computed[b]),
                                      self.spec.n_layers, P + self.run.G, self.prev_signal, self.tau, tps))
        sig = float(rec.signal(self.kind)[b])
        self.prev_signal = sig if math.isfinite(sig) else None
        block = int(rec.block[b])
        bl = self.run.cfg.block_length
        frame = self.frame(tokens, masked, new, range(block * bl, (block + 1) * bl), block)
        self.last = frame
        if self.keep_frames:
            self.frames.append(frame)
        return frame

    def frame(self, tokens: list[int], masked, new: set[int], block: range, block_index: int) -> Group:
        """The frame of one step: header, canvas, refresh map, status lines (module docstring)."""
        width, height = self.console.size
        width = max(width, 20)
        n_final = final_lengths(masked[None])[0]
        pieces = self._pieces(tokens, masked.tolist(), n_final)
        styled = []
        for i, piece in enumerate(pieces):
            kind = "mask" if piece == MASK else "end" if piece in (END, EMPTY) else None
            style = STYLES["new"] if i in new else STYLES[kind] if kind else ""
            if i in block:
                style = f"{style} {STYLES['block']}".strip()
            styled.append((piece, style))
        lines, block_line = _wrap(styled, width, block.start)
        step = len(self.refreshes)
        steps = f"step {step}/{self.steps}" if self.steps else f"step {step}"
        tau = f" τ {self.tau:g}" if self.tau is not None else ""
        head = fold_fields(Text(f"ecache watch · {self.title}{tau} · {steps} · block {block_index + 1}/{self.blocks}",
                                style="bold"), width)  # whole fields on as many rows as they need
        status = []
        history = self.lines[-HISTORY:]
        for i, line in enumerate(history):
            line = line.copy()
            if i < len(history) - 1:
                line.stylize("grey50")
            status += fold_fields(line, width)
        room = max(3, height - 2 - len(head) - len(status))
        shown = _window(lines, block_line, room)
        rule = Text("─" * width, style="grey50")
        strip = "".join("█" if r else "·" for r in self.refreshes)[-(width - 9):]
        refresh_map = Text("refresh  ", style="grey50")
        refresh_map.append(strip)
        return Group(*head, *shown, rule, refresh_map, *status)

    def _pieces(self, tokens: list[int], masked: list[bool], n_final: int) -> list[str]:
        """The text of every generated position: the final prefix read as the answer reads (pieces of its
        decoded text), the rest token by token; masks and end tokens as their marks."""
        self._extend_prefix(tokens[:n_final])
        out = []
        ended = False
        for i, (t, m) in enumerate(zip(tokens, masked)):
            if m:
                out.append(MASK)
            elif t in self.end_ids or (ended and i < n_final):
                ended = ended or i < n_final
                out.append(END)
            elif i < n_final:
                out.append(self.prefix_pieces[i])
            else:
                out.append(self._piece(t))
        return out

    def _extend_prefix(self, ids: list[int]) -> None:
        """Grow the final prefix's pieces to ``ids`` (a prefix only ever grows): piece i is what token i
        adds to the decoded text of tokens 0..i, so the pieces join to the answer's text."""
        for i in range(len(self.prefix_ids), len(ids)):
            t = ids[i]
            self.prefix_ids.append(t)
            if t in self.end_ids:
                self.prefix_pieces.append(END)
                continue
            text = self.tok.decode(self.prefix_ids, skip_special_tokens=True).rstrip("\ufffd")
            piece = text[len(self.prefix_text):] if text.startswith(self.prefix_text) else self._piece(t)
            self.prefix_text = text if text.startswith(self.prefix_text) else self.prefix_text + piece
            self.prefix_pieces.append(visible(piece) or EMPTY)

    def _piece(self, t: int) -> str:
        """The text of token ``t`` decoded alone (cached): its mark for an end token, ``⋄`` for no text."""
        if t not in self.pieces:
            if t in self.end_ids:
                self.pieces[t] = END
            else:
                self.pieces[t] = visible(self.tok.decode([t], skip_special_tokens=True)) or EMPTY
        return self.pieces[t]


def _wrap(styled: list[tuple[str, str]], width: int, block_start: int) -> tuple[list[Text], int]:
    """Lay the pieces out in lines of at most ``width`` cells (a piece wider than a line is cut); return
    the lines and the index of the line holding position ``block_start``."""
    lines, line, used, block_line = [], Text(no_wrap=True, overflow="crop"), 0, 0
    for i, (piece, style) in enumerate(styled):
        w = cell_len(piece)
        if used + w > width and used > 0:
            lines.append(line)
            line, used = Text(no_wrap=True, overflow="crop"), 0
        if i == block_start:
            block_line = len(lines)
        line.append(piece[:width] if w > width else piece, style=style or None)
        used += min(w, width)
    lines.append(line)
    return lines, block_line


def _window(lines: list[Text], around: int, room: int) -> list[Text]:
    """At most ``room`` of ``lines``, the ones around line ``around`` when they do not all fit (a dim
    ``⋮`` line says how many are left out above)."""
    if len(lines) <= room:
        return lines
    room -= 1  # the "⋮" line
    start = max(0, min(around - room // 3, len(lines) - room))
    note = Text(f"⋮ {start} line(s) above, {len(lines) - start - room} below", style="grey50")
    return [note, *lines[start:start + room]]


def stats_line(stats: dict, width: int | None = None) -> str:
    """One line (under 80 columns) of a finished answer's stats (``GenerationResult.stats``): NFE, the
    refreshes among them and their share, answer tokens, tokens per second, and the work share (positions
    × layers computed over a full forward every step, ``token_layer_share``). With ``width`` (columns) the
    line is broken between its ``·`` fields where it would be wider, as a console printing it wraps it."""
    nfe = stats.get("nfe", 0)
    full = stats.get("full_forwards", 0)
    parts = [f"NFE {nfe}", f"refresh {full} ({full / nfe if nfe else 0.0:.0%})",
             f"{stats.get('generated_tokens', 0)} tokens"]
    if stats.get("tokens_per_s") is not None:
        parts.append(f"{stats['tokens_per_s']:.1f} tok/s")
    if stats.get("token_layer_share") is not None:
        parts.append(f"work {stats['token_layer_share']:.0%} of no cache")
    lines = [parts[0]]
    for part in parts[1:]:
        if width is not None and len(lines[-1]) + 3 + len(part) > width:
            lines.append(part)
        else:
            lines[-1] += " · " + part
    return "\n".join(lines)
