"""The settings of one denoising run."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import asdict, dataclass
from typing import ClassVar

from ..contract.fields import Range, count


@dataclass(frozen=True)
class DecodeConfig:
    """Settings of one denoising run (LLaDA generate.py names where they exist).

    gen_length: generated canvas positions (tokens). block_length: semi-AR block size (tokens).
    steps: total denoising steps over all blocks (None = gen_length; threshold/factor decoding runs a
    block until it has no masks, and steps only sets the quota of Dream's threshold rule, None = one
    step per block). temperature: 0 = greedy, > 0 = Gumbel-max in float64. remasking: low_confidence
    | random | topk_margin | entropy | maskgit_plus | origin (Dream's: each mask revealed with
    probability 1 − t[i+1]/t[i]; dream schedule only). threshold / factor: Fast-dLLM
    parallel decoding. ban_eos: EOS/EOT never committed (LLaDA ``logits_eos_inf``, extended to EOT).
    low_eos_confidence: EOS/EOT committed only when the quota exceeds other candidates (LLaDA
    ``confidence_eos_eot_inf``). early_exit: a row whose answer has ended (an EOS/EOT with no mask
    before it) is filled with EOS and stops costing forwards.
    schedule: per-step commit counts, "llada" (linear split) | "dream" (Dream's timesteps; also selects
    the quota rule for threshold decoding); None = the model family's. compat: None | "fastdllm"
    (Fast-dLLM's Dream block sampler). eps: Dream's last timestep (None = the checkpoint's
    generation_config.json eps, else 1e-3). alg_temp: Dream's (None or 0 = the top-scoring positions;
    > 0 = positions drawn from softmax(confidence / alg_temp); dream schedule, fixed steps only). The
    rules: decoding/commit.py. edit_threshold: LLaDA2.1's token editing (block-diffusion models; None = off):
    a committed token of the current block is rewritten when the new argmax differs with probability
    above it; max_post_steps: mask-free editing steps a block may take (decoding/editing.py).
    """

    gen_length: int = 256
    block_length: int = 32
    steps: int | None = None
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    remasking: str = "low_confidence"
    threshold: float | None = None
    factor: float | None = None
    ban_eos: bool = False
    low_eos_confidence: bool = False
    early_exit: bool = True
    schedule: str | None = None
    compat: str | None = None
    eps: float | None = None
    alg_temp: float | None = None
    edit_threshold: float | None = None
    max_post_steps: int = 16

    #: the range of each numeric setting (LLaDA's and Dream's generate code; Fast-dLLM's threshold rules)
    ranges: ClassVar[dict[str, Range]] = {
        "gen_length": count(1, "256"), "block_length": count(1, "32"), "steps": count(1, "256"),
        "temperature": Range(0, example="0.7", why="0 = greedy"),
        "top_k": count(1, "50", "leave it unset to keep every token"),
        "top_p": Range(0, 1, lo_open=True, example="0.95", why="a probability mass"),
        "threshold": Range(0, 1, lo_open=True, example="0.9", why="a confidence"),
        "factor": Range(0, lo_open=True, example="1.0"),
        "eps": Range(0, 1, hi_open=True, example="1e-3", why="Dream's last timestep"),
        "alg_temp": Range(0, example="0.5", why="0 = the top-scoring positions"),
        "edit_threshold": Range(0, 1, lo_open=True, example="0.9", why="a confidence"),
        "max_post_steps": count(0, "16", "mask-free editing steps per block"),
    }

    def __post_init__(self) -> None:
        """Every numeric setting in its range, as the command line checks it (``ranges``; the same Range
        gives ``--threshold 2`` its message): UsageError ``DecodeConfig threshold=2 must be in (0, 1]
        (a confidence; e.g. 0.9)``; then the names and the pair the command line refuses before any model
        (:meth:`_check_names`)."""
        from ..contract.fields import check_value, fitted_kind, fitting_example, text_number
        from ..errors import UsageError

        given = {k: getattr(self, k) for k in ("gen_length", "block_length", "steps")}  # examples fit them
        for name, rng in self.ranges.items():
            value = getattr(self, name)
            rng = dataclasses.replace(rng, example=fitting_example(name, given, rng.example))
            try:
                if isinstance(value, int if rng.integer else (int, float)) and not isinstance(value, bool):
                    rng.check(value)  # a number: its range alone, as the flag's check (NaN: not finite)
                else:
                    number = text_number(value)  # "5", "0.5": a number as text, checked as the number first
                    typed = check_value(fitted_kind(name, _kinds()[name], given), value if number is None else number)
                    if number is not None:
                        raise UsageError(f"DecodeConfig {name}={value!r} must be a number, not a string (e.g. "
                                         f"{name}={typed!r})")
            except ValueError as e:
                raise UsageError(f"DecodeConfig {name}={value!r} {e}") from None
        self._check_names()

    def _check_names(self) -> None:
        """The checks of the command line that need no model: the remasking, schedule and compat names, and
        --threshold with --factor (the same functions as ``StepDecoder.build``), their messages in this
        class's keys as its numbers' are (:func:`_as_keys`: ``DecodeConfig remasking='foo' is not a remasking
        rule; …, or origin with schedule='dream'``)."""
        from ..errors import UsageError
        from .commit import validate_compat
        from .remasking import validate_remasking
        from .schedule import validate_schedule

        try:
            validate_remasking(self.remasking)
            if self.schedule is not None:
                validate_schedule(self.schedule)
            validate_compat(self.compat)
            if self.threshold is not None and self.factor is not None:
                raise UsageError("--threshold and --factor are two parallel-decoding rules; pass only one")
        except UsageError as e:
            raise UsageError(f"DecodeConfig {_as_keys(str(e))}") from None

    @property
    def parallel(self) -> bool:
        """True when a step may commit several tokens: Fast-dLLM's threshold or factor rule is set."""
        return self.threshold is not None or self.factor is not None

    def as_dict(self) -> dict:
        return asdict(self)


def _as_keys(message: str) -> str:
    """A command-line check's message with each flag of a DecodeConfig field named as the field: ``--remasking
    'foo'`` → ``remasking='foo'``, ``--schedule dream`` → ``schedule='dream'``, a bare ``--threshold`` →
    ``threshold``; other flags stay."""
    import re

    from .commit import COMPAT
    from .remasking import REMASKING
    from .schedule import SCHEDULES

    fields = {f.name for f in dataclasses.fields(DecodeConfig)}
    names = "|".join(sorted(map(re.escape, {*REMASKING, *SCHEDULES, *COMPAT}), key=len, reverse=True))

    def one(m: re.Match) -> str:
        key, value = m.group(1).replace("-", "_"), m.group(2)
        if key not in fields:
            return m.group(0)
        if value is None:
            return key
        return f"{key}={value}" if value.startswith("'") else f"{key}={value!r}"

    return re.sub(rf"--([a-z][a-z-]*)(?: ('[^']*'|(?:{names})(?![\w])))?", one, message)


@functools.cache
def _kinds() -> dict:
    """DecodeConfig's field types with their declared ranges (``contract.fields.field_types``), read once."""
    from ..contract.fields import field_types

    return field_types(DecodeConfig)
