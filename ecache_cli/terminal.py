"""What the command line draws on a terminal: tables that fit its width and one line of progress redrawn
in place. Every subcommand uses these two, so a table or a progress display behaves the same in each.

- :func:`fit` wraps a rich Table so that, printed at any width, it is no wider than that width: at its
  natural widths when they fit; else each column shrinks towards its widest word (headers and text
  wrap at words, a number is never cut and never gets ``…``); when even that is too wide, the table
  drops its vertical borders and its cell padding (columns then stand two, then one space apart).
- :class:`ProgressLine` is a single line on stderr redrawn in place (rich ``Live``, no refresh thread:
  it redraws when the command reports, at most every :data:`MIN_INTERVAL` seconds) and removed at the
  end; it is never wider than the terminal (the least important fields drop first, the bar shrinks),
  so it stays one line. Off the terminal (a pipe, a log file) it prints one plain line every
  ``$ECACHE_PROGRESS_INTERVAL`` seconds (default 30) instead; under ``-q`` nothing.
  A record written to stdout while it is shown on the same terminal goes above it (:meth:`ProgressLine.stdout`).
"""

from __future__ import annotations

import os
import time

#: Seconds between two redraws of a progress line (a denoising step can be far shorter).
MIN_INTERVAL = 0.1
#: The narrowest and the widest a progress bar is drawn.
BAR_MIN, BAR_MAX = 10, 40


# --- tables ------------------------------------------------------------------------------------------------


def fit(table):
    """``table`` (a rich Table) as a renderable that lays it out within the width it is printed at
    (:class:`Fitted`)."""
    return Fitted(table)


class Fitted:
    """A rich Table laid out within the printing width (module docstring): natural widths, else columns
    shrunk towards their widest word, else the same without vertical borders and cell padding. A table
    whose widest words do not fit even then is left to rich (only at widths far below 60 columns)."""

    def __init__(self, table):
        self.table = table
        self.style = _style(table)
        self.columns = [(c.width, c.no_wrap, c.overflow) for c in table.columns]

    def __rich_measure__(self, console, options):
        from rich.measure import Measurement

        if not self._layout(console, options) and len(self.table.columns) > 2:  # stacked parts: the whole width
            return Measurement(options.max_width, options.max_width)
        return Measurement.get(console, options, self.table)

    def __rich_console__(self, console, options):
        if self._layout(console, options) or len(self.table.columns) <= 2:
            yield self.table
            return
        from rich.text import Text

        parts = self._split(console, options)
        for i, part in enumerate(parts):
            if i:
                yield Text("")
            yield Fitted(part)

    def _layout(self, console, options, styles=None) -> bool:
        """Set the table's style and column widths for ``options.max_width``; False when it does not fit
        in any of ``styles`` (default: its own, then compact, then tight)."""
        width = options.max_width
        self._restore(self.style)
        for style in styles or (self.style, _COMPACT, _TIGHT):
            self._restore(style)
            lows, highs = self._content(console, options)
            chrome = self._chrome(console, options, lows)
            if sum(highs) + chrome <= width:
                return True
            if sum(lows) + chrome <= width:
                self._shrink(lows, highs, width - chrome)
                return True
        self._restore(self.style)
        return False

    def _natural_fit(self, console, options) -> bool:
        """Whether the table fits ``options.max_width`` in its own style at its natural widths (no cell
        wraps)."""
        lows, highs = self._content(console, options)
        return sum(highs) + self._chrome(console, options, lows) <= options.max_width

    def _split(self, console, options) -> list:
        """The table as stacked tables of the same rows, each with the first column (the rows' names)
        and as many of the next columns as fit the width in the table's own style, no cell wrapped (at
        least one; a part that still does not fit is laid out as any table, :meth:`_layout`): the
        title above the first, the caption below the last. For a table too wide even without borders
        (``--wide``'s every column), so that no border is cut and no number loses digits."""
        n = len(self.table.columns)
        groups: list[list[int]] = []
        group = [0]
        for j in range(1, n):
            if len(group) > 1 and not Fitted(self._part([*group, j]))._natural_fit(console, options):
                groups.append(group)
                group = [0]
            group.append(j)
        groups.append(group)
        title, caption = self.table.title, self.table.caption
        return [self._part(g, title if i == 0 else None, caption if i == len(groups) - 1 else None)
                for i, g in enumerate(groups)]

    def _part(self, columns: list[int], title=None, caption=None):
        """A copy of the table with only ``columns`` (indexes), its rows' cells and ``title``/``caption``."""
        import copy
        import dataclasses

        part = copy.copy(self.table)
        part.columns = [dataclasses.replace(self.table.columns[i], _index=k) for k, i in enumerate(columns)]
        for k, i in enumerate(columns):
            part.columns[k]._cells = list(self.table.columns[i]._cells)
        part.title, part.caption = title, caption
        return part

    def _restore(self, style: dict) -> None:
        for key, value in style.items():
            setattr(self.table, key, value)
        for c, (w, no_wrap, overflow) in zip(self.table.columns, self.columns):
            c.width, c.no_wrap, c.overflow = w, no_wrap, overflow

    def _content(self, console, options) -> tuple[list[int], list[int]]:
        """Each column's (widest word, widest line) over its header and cells, padding excluded."""
        from rich.measure import measure_renderables

        lows, highs = [], []
        opts = options.update_width(10**4)
        for c in self.table.columns:
            if c.width is not None:  # a width the table's author fixed stays
                lows.append(c.width)
                highs.append(c.width)
                continue
            m = measure_renderables(console, opts, [c.header, *c.cells])
            low = max(m.minimum, c.min_width or 0)
            lows.append(low)
            highs.append(max(m.maximum, low))
        return lows, highs

    def _chrome(self, console, options, widths: list[int]) -> int:
        """The table's width beyond its columns' content: borders and padding."""
        from rich.measure import Measurement

        saved = [c.width for c in self.table.columns]
        for c, w in zip(self.table.columns, widths):
            c.width = w
        total = Measurement.get(console, options.update_width(10**4), self.table).maximum
        for c, w in zip(self.table.columns, saved):
            c.width = w
        return total - sum(widths)

    def _shrink(self, lows: list[int], highs: list[int], room: int) -> None:
        """Column widths summing to ``room``: from the widest lines, one character at a time the widest
        column still above its widest word gives one up (a long text column narrows before a header
        wraps)."""
        widths = list(highs)
        excess = sum(widths) - room
        while excess > 0:
            i = max((j for j in range(len(widths)) if widths[j] > lows[j]), key=lambda j: widths[j])
            widths[i] -= 1
            excess -= 1
        for c, w in zip(self.table.columns, widths):
            c.width, c.no_wrap, c.overflow = w, False, "fold"


def _style(table) -> dict:
    return {"box": table.box, "show_edge": table.show_edge, "pad_edge": table.pad_edge,
            "padding": table.padding, "collapse_padding": table.collapse_padding}


def _compact(pad: int) -> dict:
    from rich import box

    return {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False, "padding": (0, pad),
            "collapse_padding": True}


_COMPACT = _compact(1)
_TIGHT = _compact(0)


# --- prose and status lines ------------------------------------------------------------------------------


def prose(console, *objects, **kwargs) -> None:
    """Print prose (a legend, a note under a table) wrapped at words within the terminal's width, also on
    a ``--wide`` table console (``options.table_console``: its ``prose_width``), where only the tables
    may be wider than the terminal."""
    console.print(*objects, soft_wrap=False, width=getattr(console, "prose_width", None), **kwargs)


def fold_fields(text, width: int, sep: str = " · ") -> list:
    """A status line of fields joined by ``sep`` (a rich Text) laid out on as many rows as it needs within
    ``width`` cells, breaking only between fields (a field wider than a row is folded), so nothing is
    cut and no row ends in ``…``; returns the rows (rich Texts)."""
    from rich.text import Text

    fields = text.split(sep, allow_blank=True) if sep in text.plain else [text]
    rows: list = []
    row = None
    for f in fields:
        if row is not None and row.cell_len + len(sep) + f.cell_len <= width:
            row.append(sep)
            row.append_text(f)
            continue
        if row is not None:
            rows.append(row)
        row = f.copy()
        while row.cell_len > width:  # a field wider than a row: cut at the width, the rest on the next
            head, row = row.divide([width])
            rows.append(head)
    if row is not None:
        rows.append(row)
    for r in rows:
        r.no_wrap, r.overflow, r.end = True, "crop", "\n"
    return rows or [Text("")]


# --- progress ----------------------------------------------------------------------------------------------


#: Environment variable: seconds between two progress lines when stderr is not a terminal.
INTERVAL_ENV = "ECACHE_PROGRESS_INTERVAL"
DEFAULT_INTERVAL = 30.0


def interval(console=None) -> float:
    """``$ECACHE_PROGRESS_INTERVAL`` in seconds (default 30; a value that is not a number ≥ 0 falls back to
    it, with a warning on ``console``, stderr's, when given)."""
    raw = os.environ.get(INTERVAL_ENV)
    if raw is None:
        return DEFAULT_INTERVAL
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if v >= 0:
        return v
    if console is not None:  # console.warn's form; this module imports no other of ecache's
        console.print(f"warning: {INTERVAL_ENV}={raw!r} is not a number of seconds ≥ 0; progress lines every "
                      f"{DEFAULT_INTERVAL:g} s (e.g. {INTERVAL_ENV}=60)", style="yellow", markup=False, highlight=False)
    return DEFAULT_INTERVAL


def clock(seconds: float) -> str:
    """``M:SS`` or ``H:MM:SS``."""
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class ProgressLine:
    """Progress on ``console`` (stderr's), one rule for every command: on a terminal one line redrawn in
    place, never wider than it; off a terminal (a pipe, a batch job's log) one plain line every
    ``$ECACHE_PROGRESS_INTERVAL`` seconds (default 30), so a log shows the run is alive; nothing when
    ``quiet``. A context manager:
    ``with ProgressLine(err, quiet) as line: line.show("generate 3/8", "ETA 0:12", done=3, total=8)``.
    ``active``: whether it shows anything (callers skip their progress bookkeeping otherwise)."""

    def __init__(self, console, quiet: bool = False):
        self.console = console
        self.mode = "off" if quiet or console is None else ("live" if console.is_terminal else "lines")
        self.on = self.mode == "live"
        self.live = None
        self.last = 0.0
        self.t0 = self.last_line = time.monotonic()
        self.every = interval(console) if self.mode == "lines" else DEFAULT_INTERVAL

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def __enter__(self):
        if self.on:
            from rich.live import Live

            self.live = Live(console=self.console, auto_refresh=False, transient=True, redirect_stdout=False,
                             redirect_stderr=False)
            self.live.start()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.stop()
            self.live = None
        return False

    def show(self, head: str, *fields: str, done: int | None = None, total: int | None = None,
             force: bool = False, plain=None) -> None:
        """Report progress. On a terminal: redraw the line: ``head`` (always shown), a bar of ``done`` /
        ``total`` when a total is known, then ``fields`` most important first (those that do not fit are
        left out), at most every :data:`MIN_INTERVAL` seconds unless ``force``. Off a terminal: print
        ``plain()`` (a callable giving the line; default ``head (done/total %), fields…, elapsed M:SS``)
        when :func:`interval` seconds have passed since the last line (``force`` does not shorten it)."""
        now = time.monotonic()
        if self.mode == "lines":
            if now - self.last_line < self.every:
                return
            self.last_line = now
            if plain is not None:
                text = plain()
            else:
                pct = f" ({100 * min(done, total) / total:.0f}%)" if total and done is not None else ""
                kept = [f for f in fields if f]
                if not any(f.startswith("elapsed ") for f in kept):
                    kept.append(f"elapsed {clock(now - self.t0)}")
                text = ", ".join([head + pct, *kept])
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)
            return
        if self.live is None:
            return
        if not force and now - self.last < MIN_INTERVAL:
            return
        self.last = now
        self.live.update(_Line(head, fields, done, total), refresh=True)

    def stdout(self, out):
        """``out`` (stdout) for the records written while the line is shown: when stdout is the same
        terminal as the line's, a writer that prints each whole line above the progress line (rich
        draws the line again below it); else ``out`` itself."""
        if self.live is None or not _same_terminal(out, self.console.file):
            return out
        return _Above(self.console, out)


def rate_text(done: int, elapsed: float, unit: str = "records") -> str:
    """``done`` ``unit`` over ``elapsed`` seconds per second, per minute or per hour, whichever reads as a
    number ≥ 1 (``2.5 records/s``, ``3.0 runs/min``); ``rate unknown`` before the first one."""
    if done <= 0 or elapsed <= 0:
        return "rate unknown"
    r = done / elapsed
    for per, f in (("s", 1), ("min", 60), ("h", 3600)):
        if r * f >= 1 or per == "h":
            return f"{r * f:.1f} {unit}/{per}"
    return "rate unknown"


class Counter:
    """Progress of a count on a :class:`ProgressLine`: the one progress format of every command (generate's
    records, profile's runs, trace-drift's prompts, calibrate's examples of each setting).

    On a terminal, one line redrawn in place: ``{what} {done}/{total}``, a bar, then as far as the width
    allows the ETA, the ``detail`` fields, the rate and the elapsed time. Off a terminal, every
    ``$ECACHE_PROGRESS_INTERVAL`` seconds: ``{what}: {done}/{total} {unit} (pct%), {rate}, elapsed M:SS,
    ETA M:SS, now {detail}``. Without a total (a stream): no bar, no percentage and no ETA. The rate is
    the count over the time since the start (or :meth:`restart`); the ETA is what is left at that rate.
    A report with ``done == total`` is always drawn, so the last frame reads N/N."""

    def __init__(self, line: ProgressLine, what: str, total: int | None, unit: str):
        self.line, self.what, self.total, self.unit = line, what, total, unit
        self.done, self.detail = 0, ()
        self.t0 = time.monotonic()

    @property
    def active(self) -> bool:
        return self.line.active

    def restart(self, what: str, total: int | None = None) -> None:
        """Count anew from 0 (calibrate's next setting): ``what`` and ``total`` replace the current ones."""
        self.what, self.done, self.detail, self.t0 = what, 0, (), time.monotonic()
        self.total = self.total if total is None else total

    def update(self, done: int, *detail: str, total: int | None = None, force: bool = False) -> None:
        """``done`` of the total so far (``total``: a total known only now, e.g. once the prompts are
        read); ``detail``: what runs now (``measure none``, ``step 3``), shown after the ETA on a
        terminal and after ``now`` in a plain line."""
        self.done, self.detail = done, tuple(d for d in detail if d)
        self.total = self.total if total is None else total
        if not self.line.active:
            return
        el = time.monotonic() - self.t0
        head = f"{self.what} {self.done}" + (f"/{self.total}" if self.total else "")
        fields = [self._eta(el), *self.detail, rate_text(self.done, el, self.unit), f"elapsed {clock(el)}"]
        self.line.show(head, *[f for f in fields if f], done=self.done, total=self.total,
                       force=force or (self.total is not None and self.done >= self.total),
                       plain=lambda: self.plain(el))

    def _eta(self, el: float) -> str:
        """``ETA 1:02`` from the rate so far; "" before the first one or without a total."""
        if not (self.total and self.done):
            return ""
        return f"ETA {clock(max(0, self.total - self.done) * el / self.done)}"

    def plain(self, el: float) -> str:
        """The plain progress line (stderr not a terminal) ``el`` seconds after the start."""
        if self.total:
            pct = 100 * min(self.done, self.total) / self.total
            head = f"{self.what}: {self.done}/{self.total} {self.unit} ({pct:.0f}%)"
        else:
            head = f"{self.what}: {self.done} {self.unit}"
        parts = [head, rate_text(self.done, el, self.unit), f"elapsed {clock(el)}"]
        if self.total:
            parts.append(self._eta(el) or "ETA unknown")
        if self.detail:
            parts.append("now " + " · ".join(self.detail))
        return ", ".join(parts)


class _Line:
    """The renderable of :meth:`ProgressLine.show`, laid out at the width it is drawn at."""

    def __init__(self, head: str, fields, done, total):
        self.head, self.fields, self.done, self.total = head, list(fields), done, total

    def __rich_console__(self, console, options):
        from rich.text import Text

        yield Text.assemble(*self.pieces(options.max_width), no_wrap=True, overflow="crop", end="")

    def pieces(self, width: int) -> list:
        """The line's pieces (text, or (text, style)) within ``width`` cells."""
        from rich.cells import cell_len

        def size(bar: int, kept: list[str]) -> int:
            return cell_len(self.head) + (1 + bar if bar else 0) + (1 + cell_len(" · ".join(kept)) if kept else 0)

        bar = BAR_MIN if self.total and self.done is not None and size(BAR_MIN, []) <= width else 0
        kept: list[str] = []
        for f in self.fields:
            if size(bar, [*kept, f]) > width:
                break
            kept.append(f)
        out = [self.head]
        if bar:
            n = min(BAR_MAX, bar + width - size(bar, kept))
            full = round(n * min(self.done, self.total) / self.total)
            out += [" ", ("━" * full, "bar.complete"), ("━" * (n - full), "bar.back")]
        if kept:
            out += [" ", " · ".join(kept)]
        return out


class _Above:
    """A text stream for stdout's records while a progress line is shown on the same terminal: each whole
    line is printed through the line's console (above the progress line)."""

    def __init__(self, console, out):
        self.console, self.out, self.buf = console, out, ""

    def write(self, text: str) -> int:
        from rich.text import Text

        self.buf += text
        if "\n" in self.buf:
            whole, self.buf = self.buf.rsplit("\n", 1)
            self.console.print(Text(whole), soft_wrap=True, markup=False, highlight=False)
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def __getattr__(self, name):
        return getattr(self.out, name)


def _same_terminal(a, b) -> bool:
    """True when the file objects ``a`` and ``b`` are the same terminal device."""
    try:
        fa, fb = a.fileno(), b.fileno()
        return os.isatty(fa) and os.isatty(fb) and os.path.samestat(os.fstat(fa), os.fstat(fb))
    except (AttributeError, OSError, ValueError):
        return False
