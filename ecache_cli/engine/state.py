"""Decoding configuration, the per-request decode state, and the per-step record the engine yields."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .store import append_rows_to, rows_of

SIGNALS = ("max-entropy", "sum-entropy", "max-confidence")


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
    rules: decoding/commit.py.
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

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class DecodeState:
    """What a cache policy may look at before a forward (all tensors batch-first, on the model device).

    tokens: (B, T) long canvas. masked: (B, T) bool, True where the canvas still holds the mask token.
    commit_order: (B, T) long, the rank at which each generated position was committed within its row
    (0, 1, 2, ...; -1 = prompt, padding or still masked); ``n_committed`` (B,) long is the count.
    commit_step: (B, T) long, the row's own step (``row_step``) at which each position was committed
    (-1 = never).
    block_start / block_end: absolute canvas positions of the current block [start, end).
    step: global step index of the batch; step_in_block: index within the current block (0 = first step).
    row_step: (B,) long, each row's own step index (0 = its first step): the steps that row has taken.
    It differs from ``step`` under threshold decoding, where a row that has finished its block is parked
    (takes no step) until the others finish it. Per-row rules (refresh periods, first step, "committed
    at the previous step") count in these; ``own_steps()`` reads it (``step`` for every row when unset).
    rows: (B,) long original batch indices of the rows still decoding (finished rows are dropped).
    value_probe: (fresh, cached), each (B, T, H_kv*D): layer-0 value vectors of the current canvas and
    those in the KV store; filled by the engine before ``plan`` only for policies with ``needs_values``.
    """

    tokens: torch.Tensor
    key_mask: torch.Tensor
    masked: torch.Tensor
    commit_order: torch.Tensor
    commit_step: torch.Tensor
    n_committed: torch.Tensor
    rows: torch.Tensor
    prompt_len: int
    gen_length: int
    block_length: int
    logit_shift: int
    n_layers: int
    block: int = 0
    block_start: int = 0
    block_end: int = 0
    step: int = 0
    step_in_block: int = 0
    value_probe: tuple[torch.Tensor, torch.Tensor] | None = None
    row_step: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    def block_masked(self) -> torch.Tensor:
        """(B, T) bool: masked positions of the current block (the positions that can be committed)."""
        m = torch.zeros_like(self.masked)
        m[:, self.block_start:self.block_end] = self.masked[:, self.block_start:self.block_end]
        return m

    def sources(self, targets: torch.Tensor) -> torch.Tensor:
        """(B, T) bool of the hidden-state positions whose logits predict ``targets`` (B, T) bool.

        LLaDA: the same positions. Dream (logit shift 1): position i-1 predicts token i
        (spec/models.md A2.5), so the set moves one to the left.
        """
        if self.logit_shift == 0:
            return targets
        out = torch.zeros_like(targets)
        out[:, :-self.logit_shift] = targets[:, self.logit_shift:]
        return out

    ROW_FIELDS = ("tokens", "key_mask", "masked", "commit_order", "commit_step", "n_committed", "rows", "row_step")

    def own_steps(self) -> torch.Tensor:
        """(B,) long: each row's own step index (``row_step``; ``step`` for every row when it is unset)."""
        if self.row_step is not None:
            return self.row_step
        return torch.full((self.batch,), self.step, dtype=torch.long, device=self.tokens.device)

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only rows ``keep`` (K,) long (indices into the current batch)."""
        for name in self.ROW_FIELDS:
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[keep])

    def take_rows(self, rows: torch.Tensor) -> dict:
        """The per-row fields (``ROW_FIELDS`` that are set) of rows ``rows`` (K,) long, copied, for
        :meth:`append_rows` later (:func:`~ecache_cli.engine.store.rows_of`)."""
        return rows_of({name: v for name in self.ROW_FIELDS if (v := getattr(self, name)) is not None}, rows)

    def append_rows(self, taken: dict) -> None:
        """Append rows taken by :meth:`take_rows` after the current rows (one ``torch.cat`` per field)."""
        append_rows_to(self, taken)


@dataclass
class StepRecord:
    """One denoising step, as the engine yields it (rows = the rows active at this step).

    refresh: (B,) bool, rows that ran a full forward. computed: (B,) long, positions the step's forwards
    computed per row, padding included (a row in a forward of query width S costs S; a refreshing row of
    a mixed step costs T plus its share of the partial forward; layer-averaged for layer-selective
    forwards). planned: (B,) long, the plan's own positions (T for a refreshing row, its ``compute``
    otherwise), or None. query_width: the partial forward's width (T when every row refreshed). targets: (B, R) long positions whose logits were produced (padded with repeats; ``valid``
    (B, R) bool marks real ones). committed: (B, R) bool, targets committed this step; x0 (B, R) long
    chosen tokens; prob (B, R) float64 probability of x0; entropy (B, R) float64 nats of softmax(raw
    logits). Times in seconds: forward_s (model), decision_s (policy plan + observe), sampling_s
    (sampling, remasking, commit); on CUDA they are read from events at the end of the block (0.0
    until then) unless ``Run.step_timing``. full: True when every row refreshed (one full forward).
    attention: (pos (B, A) long, [per layer (B, A, T) float32]) head-averaged attention rows of the
    positions the plan's ``attn_rows`` marked (padded like ``targets``: repeats of the row's first), or
    None; only for policies with ``needs_attention``.
    """

    step: int
    block: int
    step_in_block: int
    rows: torch.Tensor
    refresh: torch.Tensor
    computed: torch.Tensor
    query_width: int
    targets: torch.Tensor
    valid: torch.Tensor
    committed: torch.Tensor
    x0: torch.Tensor
    prob: torch.Tensor
    entropy: torch.Tensor
    forward_s: float = 0.0
    decision_s: float = 0.0
    sampling_s: float = 0.0
    finished: torch.Tensor | None = None  # (B,) bool rows that ended at this step
    attention: tuple[torch.Tensor, list[torch.Tensor]] | None = None
    extra: dict = field(default_factory=dict)
    planned: torch.Tensor | None = None

    @property
    def full(self) -> bool:
        return bool(self.refresh.all())

    @property
    def n_committed(self) -> torch.Tensor:
        """(B,) long tokens committed per row at this step."""
        return self.committed.sum(1)

    def signal(self, kind: str = "max-entropy") -> torch.Tensor:
        """(B,) float64 EntropyCache signal of the tokens committed at this step (spec/method.md §2).

        max-entropy: max entropy (nats); sum-entropy: their sum; max-confidence: 1 - min probability.
        Rows that committed nothing get -inf (max variants) or 0 (sum).
        """
        if kind == "max-entropy":
            return self.entropy.masked_fill(~self.committed, float("-inf")).amax(1)
        if kind == "sum-entropy":
            return self.entropy.masked_fill(~self.committed, 0.0).sum(1)
        if kind == "max-confidence":
            return (1.0 - self.prob).masked_fill(~self.committed, float("-inf")).amax(1)
        raise ValueError(f"unknown signal {kind!r}; use one of {', '.join(SIGNALS)}")
