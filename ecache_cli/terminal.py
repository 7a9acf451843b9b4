"""What the command line draws on a terminal: tables that fit its width and one line of progress redrawn
in place. Every subcommand uses these two, so a table or a progress display behaves the same in each.

- :func:`fit` wraps a rich Table so that, printed at any width, it is no wider than that width: at its
  natural widths when they fit; else each column shrinks towards its widest word (headers and text
  wrap at words, a number is never cut and never gets ``…``); when even that is too wide, the table
  drops its vertical borders and its cell padding (columns then stand two, then one space apart).
- :class:`ProgressLine` is a single line on stderr redrawn in place (rich ``Live``, no refresh thread:
  it redraws when the command reports, at most every :data:`MIN_INTERVAL` seconds) and removed at the
  end; it is never wider than the terminal (the least important fields drop first, the bar shrinks),
  so it stays one line. Off the terminal (a pipe, a log file) and under ``-q`` it draws nothing.
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

        self._layout(console, options)
        return Measurement.get(console, options, self.table)

    def __rich_console__(self, console, options):
        self._layout(console, options)
        yield self.table

    def _layout(self, console, options) -> None:
        """Set the table's style and column widths for ``options.max_width``."""
        width = options.max_width
        self._restore(self.style)
        for style in (self.style, _COMPACT, _TIGHT):
            self._restore(style)
            lows, highs = self._content(console, options)
            chrome = self._chrome(console, options, lows)
            if sum(highs) + chrome <= width:
                return
            if sum(lows) + chrome <= width:
                self._shrink(lows, highs, width - chrome)
                return

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


# --- progress ----------------------------------------------------------------------------------------------


class ProgressLine:
    """One line of progress on ``console`` (stderr's), redrawn in place on a terminal, never wider than
    it; nothing when ``quiet`` or when ``console`` is not a terminal. A context manager:
    ``with ProgressLine(err, quiet) as line: line.show("generate 3/8", "ETA 0:12", done=3, total=8)``."""

    def __init__(self, console, quiet: bool = False):
        self.console = console
        self.on = not quiet and console is not None and console.is_terminal
        self.live = None
        self.last = 0.0

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
             force: bool = False) -> None:
        """Redraw the line: ``head`` (always shown), a bar of ``done`` / ``total`` when a total is known,
        then ``fields`` most important first (those that do not fit are left out). Redraws at most every
        :data:`MIN_INTERVAL` seconds unless ``force``."""
        if self.live is None:
            return
        now = time.monotonic()
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
