"""The run file of ``ecache calibrate``: every evaluated (setting, example) as one JSONL line, written
and flushed the moment it exists, so an interrupted calibration loses nothing and ``--resume``
continues from it.

Layout: line 1 is a header ``{"kind": "header", "format": 1, "key": {...}}``; every later line is an
example record ``{"kind": "example", "tau": <float or null for none>, "index": i, ...}``; in a joint
search a record of a setting whose recent_k / block_refresh / recent_steps differ from the run's own
also holds ``"arm": [recent_k, block_refresh]`` (``recent_steps`` third when on; ``block_tau`` and
``refresh_prompt`` after it when set, :meth:`Arm.as_record`).
The key holds
everything that changes what a record would contain (model fingerprint, task, prompts hash, decode
settings, signal, recent_k, ...); resuming with a different key is a one-line error naming the first
differing setting as the option that sets it (:func:`mismatch_message`). A last line cut short by a
crash (no trailing newline, or not JSON) is dropped and cut from the file before appending.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from ..errors import DataError, UsageError
from .streams import write_jsonl

FORMAT = 1


#: an arm's ``block_tau`` before the search knows the signal: the high τ of ``none``'s signal on the
#: sample (``tau_search.high_tau``), resolved by :meth:`Arm.resolved`
HIGH_BLOCK_TAU = "high"


class Arm(NamedTuple):
    """One setting of EntropyCache's other knobs that a joint search sweeps τ under: ``recent_k`` (the
    k latest commits recomputed), ``block_refresh`` (a full forward at each block start),
    ``recent_steps`` (commits younger than that many steps also recomputed; 0 = off), ``block_tau``
    (a block start refreshes after a block whose signal exceeded it; None = off; ``HIGH_BLOCK_TAU``
    until resolved) and ``refresh_prompt`` (False: triggered refreshes recompute the generated canvas
    only). The knobs' meaning: ``cache/entropy.py``."""

    recent_k: int
    block_refresh: bool
    recent_steps: int = 0
    block_tau: float | str | None = None
    refresh_prompt: bool = True

    def as_record(self) -> list:
        """The run file's form: ``[recent_k, block_refresh]``, plus ``recent_steps`` when it is on, plus
        ``block_tau, refresh_prompt`` when either is not the default."""
        extra = self.block_tau is not None or not self.refresh_prompt
        head = [self.recent_k, self.block_refresh, *([self.recent_steps] if self.recent_steps or extra else [])]
        return head + ([self.block_tau, self.refresh_prompt] if extra else [])

    def params(self) -> dict:
        """The EntropyCache parameters of this arm, every knob given (0 included), so none of the run's
        own settings (e.g. a base profile's recent_steps) leaks into it."""
        return {"recent_k": self.recent_k, "block_refresh": self.block_refresh, "recent_steps": self.recent_steps,
                "block_tau": self.block_tau, "refresh_prompt": self.refresh_prompt}

    def describe(self) -> str:
        """``recent_k=16, block_refresh=off`` (``, recent_steps=4``, ``, block_tau=0.5``,
        ``, refresh_prompt=off`` when set): the progress line's heading."""
        out = f"recent_k={self.recent_k}, block_refresh={'on' if self.block_refresh else 'off'}"
        out += f", recent_steps={self.recent_steps}" if self.recent_steps else ""
        out += f", block_tau={self.block_tau:g}" if isinstance(self.block_tau, float) else ""
        out += f", block_tau={self.block_tau}" if isinstance(self.block_tau, str) else ""
        return out + ("" if self.refresh_prompt else ", refresh_prompt=off")

    def resolved(self, high: float) -> "Arm":
        """This arm with a ``HIGH_BLOCK_TAU`` block_tau replaced by ``high`` (nats)."""
        return self._replace(block_tau=high) if self.block_tau == HIGH_BLOCK_TAU else self


JOINT_RECENT_KS = [16, 32, 64]  # --joint: recent_k searched with τ (64: the paper's medium setting)
JOINT_BLOCK_REFRESHES = [False, True]  # --joint: the paper's rule (off) and a refresh at each block start
# --joint: the recent_steps variant (commits recomputed while younger than 4 or 8 steps, no fixed k),
# which carries entropy's speed-fidelity frontier under plain decoding on the embedded model (BENCHMARKS.md),
# and its 4-step arm with a refresh at each block start (frontier points under threshold decoding);
# the previous step's commits alone with a block start refreshed only after a block whose signal passed
# the sample's high τ, with and without the prompt in triggered refreshes (the frontier under threshold
# decoding at 4 shots, where the prompt is longer than the canvas)
JOINT_STEP_ARMS = [Arm(0, False, 4), Arm(0, False, 8), Arm(0, True, 4),
                   Arm(0, False, 1, HIGH_BLOCK_TAU), Arm(0, False, 1, HIGH_BLOCK_TAU, False)]


def as_arm(arm) -> Arm | None:
    """``arm`` (an Arm, or a sequence of 2 to 5 values as the run file stores it) as an Arm; None stays None."""
    if arm is None:
        return None
    bt = arm[3] if len(arm) > 3 else None
    return Arm(int(arm[0]), bool(arm[1]), int(arm[2]) if len(arm) > 2 else 0,
               bt if bt is None or bt == HIGH_BLOCK_TAU else float(bt), bool(arm[4]) if len(arm) > 4 else True)


def arm_of(rec: dict) -> Arm | None:
    """A record's arm when it names one, else None (the run's own settings)."""
    return as_arm(rec.get("arm"))


def check_new_run_file(path: Path, resume: bool, dry_run: bool) -> bool:
    """Whether the run file at ``path`` holds records (an empty one is the output lock's); UsageError when it
    does and neither ``resume`` nor ``dry_run`` is set: nothing is overwritten. Checked before the model
    loads (``commands/calibrate.py``) and again when the file is opened."""
    path = Path(path)
    exists = path.is_file() and path.stat().st_size > 0
    if exists and not resume and not dry_run:
        raise UsageError(f"run file {path} already exists; pass --resume to continue it, "
                         "or delete it (or pass another --run-file) to start over")
    return exists


class RunFile:
    """Records of one calibration, keyed by (τ or None, example index, arm: None or an :class:`Arm`).

    ``resume``: load an existing file (its key must equal ``key``). Without it an existing file is an
    error (nothing is ever overwritten). ``dry_run``: never write (an existing file is read only when
    resuming). ``loaded`` counts the records read back.
    """

    def __init__(self, path: Path, key: dict, resume: bool = False, dry_run: bool = False):
        self.path, self.dry_run = Path(path), dry_run
        self.key = json.loads(json.dumps(key))  # as it reads back (tuples -> lists)
        self.records: dict[tuple[float | None, int, Arm | None], dict] = {}
        self.loaded = 0
        self.dropped_partial = False
        self._fh = None
        exists = check_new_run_file(self.path, resume, dry_run)
        if exists and resume:
            self._load()
        if not dry_run:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not self.path.is_file() or self.path.stat().st_size == 0
            self._fh = open(self.path, "a", encoding="utf-8")
            if fresh:
                write_jsonl(self._fh, {"kind": "header", "format": FORMAT, "key": self.key})

    def _load(self) -> None:
        raw = self.path.read_bytes()
        text = raw.decode("utf-8", errors="replace")
        lines = text.split("\n")
        tail = lines.pop()  # "" when the file ends in a newline, else a line cut short
        if tail.strip():
            self.dropped_partial = True
        good: list[str] = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines):  # the last complete-looking line may still be a torn write
                    self.dropped_partial = True
                    break
                raise DataError(f"{self.path}:{n}: not valid JSON; the run file is damaged "
                                "(delete it to start over)") from None
            if not good:
                self._check_header(rec)
            elif rec.get("kind") == "example":
                self.records[(rec["tau"], rec["index"], arm_of(rec))] = rec
            good.append(line)
        if not good:
            raise DataError(f"{self.path}: no header line; the run file is damaged (delete it to start over)")
        self.loaded = len(self.records)
        if self.dropped_partial and not self.dry_run:  # cut the torn tail so appends start on a clean line
            self.path.write_text("".join(g + "\n" for g in good), encoding="utf-8")

    def _check_header(self, rec: dict) -> None:
        if not isinstance(rec, dict) or rec.get("kind") != "header":
            raise DataError(f"{self.path}: first line is not a calibrate run header (delete the file to start over)")
        if rec.get("format") != FORMAT:
            raise UsageError(f"{self.path}: run file format {rec.get('format')} is not {FORMAT}; "
                             "delete it to start over")
        diff = first_difference(rec.get("key") or {}, self.key)
        if diff is not None:
            raise UsageError(mismatch_message(self.path, *diff))

    def get(self, tau: float | None, index: int, arm=None) -> dict | None:
        """The record of (τ, example index, arm), or None (``arm``: anything :func:`as_arm` reads)."""
        return self.records.get((tau, index, as_arm(arm)))

    def add(self, rec: dict) -> None:
        """Keep ``rec`` (which has ``tau``, ``index`` and maybe ``arm``) and append it to the file at once."""
        self.records[(rec["tau"], rec["index"], arm_of(rec))] = rec
        if self._fh is not None:
            write_jsonl(self._fh, {"kind": "example", **rec})

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def first_difference(old: dict, new: dict, prefix: str = "") -> tuple[str, object, object] | None:
    """The first (dotted name, old value, new value) where two nested dicts differ, in ``new``'s key
    order (then keys only ``old`` has), or None."""
    for k in [*new, *(k for k in old if k not in new)]:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            d = first_difference(a, b, f"{prefix}{k}.")
            if d is not None:
                return d
        elif a != b:
            return (f"{prefix}{k}", a, b)
    return None


#: Run-key fields set by a flag of ``ecache calibrate`` whose value is shown as given (``--limit 8``).
_FLAGS = {"model": "--model", "task": "--task", "limit": "--limit", "seed": "--seed", "shots": "--shots",
          "signal": "--signal", "recent_k": "--recent-k", "recent_steps": "--recent-steps",
          "batch_size": "--batch-size", "dtype": "--dtype",
          "device": "--device"}
#: Boolean run-key fields: (flag when true, flag when false).
_SWITCHES = {"chat": ("--chat", "--no-chat"), "block_refresh": ("--block-refresh", "--no-block-refresh"),
             "decode.ban_eos": ("--ban-eos", "--allow-eos"),
             "decode.low_eos_confidence": ("--low-eos-confidence", "--no-low-eos-confidence"),
             "decode.early_exit": ("--early-exit", "--no-early-exit")}
#: Run-key fields no flag sets: (what differs, what to continue with).
_FINGERPRINTS = {"data_sha256": ("the --data file's contents", "the data file it was made with"),
                 "config_sha256": ("the model's config.json", "the model it was made with"),
                 "weights": ("the model's weights", "the model it was made with"),
                 "prompts_sha256": ("the prompts' token ids (tokenizer, chat template or task data)",
                                    "the model and data it was made with"),
                 "block_tau": ("the profile's entropy block_tau", "the profile it was made with"),
                 "refresh_prompt": ("the profile's entropy refresh_prompt", "the profile it was made with")}
#: Run-key fields left out at their default: how to show the default in a mismatch.
_UNSET = {"block_tau": "unset", "refresh_prompt": "true"}
_DECODE_FLAGS = {"gen_length", "block_length", "steps", "temperature", "top_k", "top_p", "remasking",
                 "threshold", "factor", "schedule", "compat", "alg_temp"}


def _as_option(name: str, value) -> tuple[str, str] | None:
    """``value`` of run-key field ``name`` as the command-line option that gives it (``--recent-k 16``,
    ``--no-chat``, ``--shots 0,4``) and as what to rerun with (``--recent-k 16``, ``without --steps``),
    or None when no flag sets the field."""
    if name in _SWITCHES:
        flag = _SWITCHES[name][0 if value else 1]
        return flag, f"with {flag}"
    if name == "arms":  # a joint search's arms (Arm.as_record); None: one arm, no joint search
        if not isinstance(value, list):
            return "one --recent-k value and no --joint", "with one --recent-k value and no --joint"
        text = _arms_flags([as_arm(a) for a in value])
        return None if text is None else (text, f"with {text}")
    field = name.removeprefix("decode.")
    flag = _FLAGS.get(name) or ("--" + field.replace("_", "-") if name.startswith("decode.")
                                and field in _DECODE_FLAGS else None)
    if flag is None:
        return None
    if value is None:
        return f"no {flag}", f"without {flag}"
    text = f"{flag} {','.join(map(str, value)) if isinstance(value, list) else value}"
    return text, f"with {text}"


def _arms_flags(arms: list[Arm]) -> str | None:
    """The ``ecache calibrate`` flags whose search has exactly ``arms`` (``runs.calibrate.arms``'s order):
    ``--joint`` for its default arms, else ``--recent-k``, ``--recent-steps`` (when not 0 alone) and
    ``--joint`` (block refresh off and on) for a product of their values; None when no flags give them
    (e.g. a ``--joint`` run file of an earlier version, whose arms differ from this version's)."""
    paper = [Arm(k, b) for b in JOINT_BLOCK_REFRESHES for k in JOINT_RECENT_KS]
    if arms == paper + [a for a in JOINT_STEP_ARMS if a not in paper]:
        return "--joint"
    ks, brs, rss = ([*dict.fromkeys(getattr(a, f) for a in arms)]
                    for f in ("recent_k", "block_refresh", "recent_steps"))
    bt, rp = (arms[0].block_tau, arms[0].refresh_prompt) if arms else (None, True)
    if not arms or arms != [Arm(k, b, r, bt, rp) for r in rss for b in brs for k in ks]:
        return None
    text = f"--recent-k {','.join(map(str, ks))}" + (f" --recent-steps {','.join(map(str, rss))}" if rss != [0] else "")
    return text + (" --joint" if len(brs) > 1 else "")


def mismatch_message(path: Path, name: str, old, new) -> str:
    """The one-line error of ``--resume`` with a run file made under other settings: the first differing
    run-key field ``name`` (dotted, e.g. ``decode.gen_length``; see :func:`first_difference`) as the option
    that sets it with both values, and the fixes (continue with the earlier value; start over with
    another --run-file or without the file)."""
    start_over = f"to start over, drop --resume and pass another --run-file (or delete {path})"
    was, now = _as_option(name, old), _as_option(name, new)
    if was is not None and now is not None:
        return (f"run file {path} was made with {was[0]}, this run has {now[0]}; to continue it, rerun {was[1]}; "
                f"{start_over}")
    if name == "arms" and was is None:  # arms no flags of this version search together
        return (f"run file {path} was made with joint-search arms that no flags of this ecache version search "
                f"(a --joint run file of an earlier version), so it cannot be continued; {start_over}")
    if name == "arms":
        return (f"run file {path} was made with {was[0]}, this run searches other arms; to continue it, rerun "
                f"{was[1]}; {start_over}")
    field = name.removeprefix("decode.")
    what, keep = _FINGERPRINTS.get(name) or (f"the profile's decode setting {field}",
                                             f"decode: {{{field}: {'null' if old is None else old}}} in the profile")
    if name in _UNSET:  # the run key leaves these out at their defaults: name the default, as YAML writes it
        old, new = (_UNSET[name] if v is None else str(v).lower() if isinstance(v, bool) else v for v in (old, new))
    return (f"run file {path} does not match this run: {what} changed ({old} in the file, {new} now); to continue "
            f"it, rerun with {keep}; {start_over}")
