"""Dream's own samplers, token for token: Dream's schedule (generation_utils.py ``diffusion_generate``), Fast-dLLM's
Dream threshold quota (dream/model/generation_utils.py 'confidence_threshold') and Fast-dLLM's Dream block sampler
(dream/model/generation_utils_block.py, ``--compat fastdllm``), each against a plain reference loop written here
from the description in docs/MODELS.md §5.2 / §6.5; tiny random checkpoints in the official format, CPU, float32.

The reference loops mirror ecache's deliberate differences only: the mask id and ids ≥ the tokenizer size are
never chosen (maskgit_plus / topk_margin are scored on the distribution without them, the entropy on the
whole one, as Dream's), scores are float64, and a row whose block is done stops (Fast-dLLM may run forwards
that commit nothing).
"""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS as RAGGED_PROMPTS

from ecache_cli.cache import make_policy
from ecache_cli.decoding.remasking import select_sampled
from ecache_cli.decoding.sampling import sample
from ecache_cli.decoding.schedule import dream_num_transfer_tokens
from ecache_cli.decoding.streams import row_generator
from ecache_cli.engine import DecodeConfig, Engine
from ecache_cli.errors import UsageError

PROMPTS = RAGGED_PROMPTS[:3]  # three of the shared prompts of different lengths
NEG = float("-inf")


def ids_of(lm, prompts):
    return Engine.from_loaded(lm).encode(prompts, chat=False)


def ecache(lm, prompts, cfg, cache="none"):
    """ecache's generated ids per prompt, and the step records."""
    eng = Engine.from_loaded(lm)
    run = eng.start(eng.encode(prompts, chat=False), cfg, make_policy(cache))
    records = list(run)
    return [r.token_ids for r in run.results()], records


# --- the reference loops


def block_timesteps(gen_length, block_length, steps, eps):
    """Steps per block and Dream's per-block timesteps linspace(1, eps, steps_per_block + 1)."""
    spb = steps // (gen_length // block_length)
    return spb, torch.linspace(1, eps, spb + 1)


class Canvas:
    """A left-padded batch canvas and the model calls of a reference loop (full or windowed forwards)."""

    def __init__(self, lm, prompt_ids, gen_length):
        self.lm, self.spec, self.model = lm, lm.spec, lm.model
        B, self.P = len(prompt_ids), max(len(p) for p in prompt_ids)
        T = self.P + gen_length
        self.x = torch.full((B, T), self.spec.pad_id)
        key_mask = torch.zeros(B, T, dtype=torch.bool)
        for b, p in enumerate(prompt_ids):
            self.x[b, self.P - len(p):self.P] = torch.tensor(p)
            key_mask[b, self.P - len(p):] = True
        self.x[:, self.P:] = self.spec.mask_id
        self.store = self.model.new_store(key_mask)
        self.banned = [self.spec.mask_id] + list(range(len(lm.tokenizer), self.spec.vocab_size))

    def blocks(self, block_length):
        """(start, end) absolute positions of each block of the generated region, in decoding order."""
        G = self.x.shape[1] - self.P
        return [(self.P + i * block_length, self.P + (i + 1) * block_length) for i in range(G // block_length)]

    def masked(self):
        return self.x == self.spec.mask_id  # (B, T)

    def logits(self, windows=None):
        """float64 (B, T, V) logits aligned with the token they predict (Dream: from position i−1).
        windows: None = full forward; else per row the list of positions to compute (the rest is served
        from the store). Rows of positions not computed are NaN."""
        B, T = self.x.shape
        with torch.no_grad():
            if windows is None:
                out = self.model(self.x, self.store).double()  # (B, T, V)
            else:
                S = max(len(w) for w in windows)
                q = torch.tensor([sorted(w) + [min(w)] * (S - len(w)) for w in windows])  # (B, S) pad = repeats
                part = self.model(self.x, self.store, query_pos=q).double()  # (B, S, V)
                out = torch.full((B, T, part.shape[-1]), float("nan"), dtype=torch.float64)
                out.scatter_(1, q[..., None].expand_as(part), part)
        if self.spec.logit_shift:
            out = torch.cat([out[:, :1], out[:, :-1]], dim=1)
        return out

    def scores(self, logits, alg):
        """x0 (B, T) and Dream's confidence of alg (B, T) at temperature 0 (sample_tokens)."""
        entropy_probs = torch.softmax(logits, dim=-1)  # Dream: probs = softmax(logits), nothing banned
        logits = logits.clone()
        logits[..., self.banned] = NEG
        probs = torch.softmax(logits, dim=-1)
        confidence, x0 = probs.max(dim=-1)  # maskgit_plus: max probability
        if alg == "topk_margin":
            top = probs.sort(dim=-1, descending=True).values
            confidence = top[..., 0] - top[..., 1]
        elif alg == "entropy":
            confidence = (entropy_probs * torch.log(entropy_probs + 1e-10)).sum(-1)  # negative entropy
        return x0, confidence

    def window(self, cache, start, end, b):
        """Positions row b computes at a cached step: Fast-dLLM's window, plus the sources of its masks
        (Dream: p − 1, so the position before the block while the block's first position is masked)."""
        if cache == "none":
            return None
        win = set(range(start, self.x.shape[1] if cache == "prefix" else end))
        m = self.masked()[b, start:end].nonzero().squeeze(1) + start
        return win | set((m - self.spec.logit_shift).tolist())

    def forward(self, cache, start, end, refresh):
        if cache == "none" or refresh:
            return self.logits()
        return self.logits([sorted(self.window(cache, start, end, b)) for b in range(self.x.shape[0])])


def dream_reference(lm, prompt_ids, gen_length, block_length, steps, alg, cache="none", eps=1e-3):
    """Dream diffusion_generate (alg maskgit_plus / topk_margin / entropy, alg_temp 0, temperature 0), per block:
    timesteps linspace(1, eps, steps + 1); at step i num_mask = block masks / B (float32) and
    k = int(num_mask · (1 − t[i+1]/t[i])), all at the last step; topk of the confidence over the block's masks.
    With a cache: a full forward at each block's first step, the window otherwise."""
    cv = Canvas(lm, prompt_ids, gen_length)
    B, P = cv.x.shape[0], cv.P
    spb, timesteps = block_timesteps(gen_length, block_length, steps, eps)
    for start, end in cv.blocks(block_length):
        for i in range(spb):
            x0, confidence = cv.scores(cv.forward(cache, start, end, refresh=i == 0), alg)
            block_mask = torch.zeros_like(cv.x, dtype=torch.bool)
            block_mask[:, start:end] = cv.masked()[:, start:end]
            t, s = timesteps[i], timesteps[i + 1]
            num_mask_token = block_mask.sum() / B
            k = int(num_mask_token * (1 - s / t)) if i < spb - 1 else int(num_mask_token)
            full_confidence = torch.where(block_mask, confidence, torch.tensor(NEG, dtype=torch.float64))
            if k > 0:
                idx = torch.topk(full_confidence, k).indices  # (B, k)
                cv.x.scatter_(1, idx, x0.gather(1, idx))
    return cv.x[:, P:].tolist()


def quota_reference(lm, prompt_ids, gen_length, block_length, steps, threshold, cache="none", stats=None):
    """Fast-dLLM dream/model/generation_utils.py, alg 'confidence_threshold' (batch 1 there: here per row),
    per block: number_transfer_tokens = block masks // steps; each step takes the top
    (number_transfer_tokens + left_tokens_last_step) candidates, commits the first, defers those below the
    threshold; a deferral at the last step adds a step and drops the new quota to 0."""
    cv = Canvas(lm, prompt_ids, gen_length)
    B, P = cv.x.shape[0], cv.P
    spb = steps // (gen_length // block_length)  # steps per block
    for start, end in cv.blocks(block_length):
        ntt = [block_length // spb] * B
        left, row_steps, i = [0] * B, [spb] * B, 0
        while cv.masked()[:, start:end].any():
            x0, confidence = cv.scores(cv.forward(cache, start, end, refresh=i == 0), "maskgit_plus")
            block_mask = torch.zeros_like(cv.x, dtype=torch.bool)
            block_mask[:, start:end] = cv.masked()[:, start:end]
            for b in range(B):
                if not block_mask[b].any():
                    continue  # Fast-dLLM would run on, committing nothing
                full_confidence = torch.where(block_mask[b], confidence[b], torch.tensor(NEG, dtype=torch.float64))
                current = ntt[b] + left[b]
                left[b] = 0
                selected, index = torch.topk(full_confidence, current)
                transfer = [int(index[0])]
                for k in range(1, current):
                    if selected[k] < threshold:
                        if i < row_steps[b] - 1:
                            left[b] += 1
                        else:
                            ntt[b] = 0
                            row_steps[b] += 1
                            left[b] += 1
                    else:
                        transfer.append(int(index[k]))
                cv.x[b, transfer] = x0[b, transfer]
                if stats is not None:
                    stats["deferred"] = stats.get("deferred", 0) + left[b]
                    stats["extended"] = stats.get("extended", 0) + int(i >= spb)
                    stats["parallel"] = stats.get("parallel", 0) + int(len(transfer) > 1)
            i += 1
    return cv.x[:, P:].tolist()


def block_sampler_reference(lm, prompt_ids, gen_length, block_length, steps, cache, threshold=None, eps=1e-3):
    """Fast-dLLM dream/model/generation_utils_block.py: per block a full forward that commits the block's first
    position unconditionally (x[:, s] = x0[:, s]); then cached steps over the window ([s, T) prefix, [s, e)
    dual). 'confidence_threshold': top-1 of the block's masks plus every other ≥ threshold. Otherwise steps
    i = 1 .. steps_per_block − 1 on timesteps linspace(1, eps, steps_per_block + 1), confidence = negative
    entropy, k = int(num_mask · (1 − t[i+1]/t[i])), all at the last step."""
    cv = Canvas(lm, prompt_ids, gen_length)
    B, P = cv.x.shape[0], cv.P
    spb, timesteps = block_timesteps(gen_length, block_length, steps, eps)
    for start, end in cv.blocks(block_length):
        x0, _ = cv.scores(cv.logits(), "maskgit_plus")
        cv.x[:, start] = x0[:, start]
        i = 1
        while True:
            if threshold is None and i == spb:
                break  # Fast-dLLM runs one more forward first; it changes no token
            x0, confidence = cv.scores(cv.forward(cache, start, end, refresh=False),
                                       "maskgit_plus" if threshold is not None else "entropy")
            block_mask = torch.zeros_like(cv.x, dtype=torch.bool)
            block_mask[:, start:end] = cv.masked()[:, start:end]
            full_confidence = torch.where(block_mask, confidence, torch.tensor(NEG, dtype=torch.float64))
            if threshold is not None:
                for b in range(B):
                    current = int(block_mask[b].sum())
                    if current == 0:
                        continue
                    selected, index = torch.topk(full_confidence[b], current)
                    transfer = [int(index[0])] + [int(index[k]) for k in range(1, current) if selected[k] >= threshold]
                    cv.x[b, transfer] = x0[b, transfer]
            else:
                t, s = timesteps[i], timesteps[i + 1]
                num_mask_token = block_mask.sum() / B
                k = int(num_mask_token * (1 - s / t)) if i < spb - 1 else int(num_mask_token)
                if k > 0:
                    idx = torch.topk(full_confidence, k).indices
                    cv.x.scatter_(1, idx, x0.gather(1, idx))
                i += 1
            if not cv.masked()[:, start:end].any():
                break
    return cv.x[:, P:].tolist()


def varied(tokens):
    """The outputs are not degenerate (one token repeated), so the comparison can fail."""
    return all(len(set(row)) > 2 for row in tokens)


# --- (1) Dream's schedule: the default for Dream


def test_dream_schedule_counts_match_dream_arithmetic():
    # Dream's float32 arithmetic, hand-checked quirks (docs/MODELS.md §5.2): steps == masks gives 0 first, 2 last
    assert dream_num_transfer_tokens(torch.tensor([16]), 16, 1e-3).tolist() == [[0] + [1] * 14 + [2]]
    c = dream_num_transfer_tokens(torch.tensor([512, 512]), 128, 1e-3)
    assert c[0, :3].tolist() == [3, 4, 4] and c[0, -1].item() == 5 and c.sum(1).tolist() == [512, 512]
    assert dream_num_transfer_tokens(torch.tensor([31]), 4, 1e-3, first=1).tolist() == [[0, 10, 10, 11]]


@pytest.mark.parametrize("alg", ["entropy", "maskgit_plus", "topk_margin"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("block_length,steps,cache", [(16, 16, "none"), (16, 8, "none"), (8, 16, "dual"),
                                                      (8, 8, "prefix")])
def test_dream_schedule_matches_diffusion_generate(dream_lm, alg, batch, block_length, steps, cache):
    prompts = PROMPTS[:batch]
    cfg = DecodeConfig(gen_length=16, block_length=block_length, steps=steps, remasking=alg, early_exit=False)
    got, records = ecache(dream_lm, prompts, cfg, cache)
    want = dream_reference(dream_lm, ids_of(dream_lm, prompts), 16, block_length, steps, alg, cache)
    assert got == want
    assert varied(got)
    assert len(records) == steps  # a fixed step count, steps that commit 0 included
    assert any(int(r.n_committed.max()) == 0 for r in records) or steps < 16  # Dream's first step commits 0


def test_dream_schedule_selectable_on_llada_and_llada_schedule_on_dream(llada_lm, dream_lm):
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=16, remasking="maskgit_plus", early_exit=False,
                       schedule="dream")
    got, _ = ecache(llada_lm, PROMPTS, cfg)
    assert got == dream_reference(llada_lm, ids_of(llada_lm, PROMPTS), 16, 8, 16, "maskgit_plus") and varied(got)
    # the LLaDA schedule on Dream differs from Dream's (here: per step counts [1] * 8 vs [0, 1, ..., 2])
    _, recs = ecache(dream_lm, PROMPTS[:1], DecodeConfig(gen_length=16, block_length=8, steps=16, early_exit=False,
                                                          schedule="llada"))
    assert [int(r.n_committed[0]) for r in recs] == [1] * 16


# --- (2) Fast-dLLM's Dream threshold quota (no cache): the default for Dream threshold decoding


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("block_length,steps,cache", [(16, 4, "none"), (8, 4, "none"), (8, 4, "dual")])
def test_dream_threshold_quota_matches_fastdllm(dream_lm, batch, block_length, steps, cache):
    prompts = PROMPTS[:batch]
    cfg = DecodeConfig(gen_length=16, block_length=block_length, steps=steps, threshold=0.7, early_exit=False)
    got, records = ecache(dream_lm, prompts, cfg, cache)
    stats = {}
    want = quota_reference(dream_lm, ids_of(dream_lm, prompts), 16, block_length, steps, 0.7, cache, stats)
    assert got == want and varied(got)
    # tokens were deferred, steps added at the end, and some steps committed several tokens
    assert stats["deferred"] > 0 and stats["extended"] > 0 and stats["parallel"] > 0, stats
    assert len(records) == max(r.step for r in records) + 1 > steps


def test_dream_threshold_extends_steps_until_done(dream_lm):
    cfg = DecodeConfig(gen_length=16, block_length=16, steps=4, threshold=0.99, early_exit=False)
    got, records = ecache(dream_lm, PROMPTS[:1], cfg)
    stats = {}
    assert got == quota_reference(dream_lm, ids_of(dream_lm, PROMPTS[:1]), 16, 16, 4, 0.99, "none", stats)
    assert stats["extended"] > 0 and len(records) > 4  # steps added at the end
    assert dream_lm.spec.mask_id not in got[0]


def test_llada_threshold_rule_unchanged_and_dream_without_steps_is_uncapped(llada_lm, dream_lm):
    uncapped = {}
    for name, lm in (("llada", llada_lm), ("dream", dream_lm)):  # one step per block: a quota of the whole block
        cfg = DecodeConfig(gen_length=16, block_length=8, threshold=0.3, early_exit=False)
        got, _ = ecache(lm, PROMPTS, cfg)
        uncapped[name], _ = ecache(lm, PROMPTS, DecodeConfig(gen_length=16, block_length=8, threshold=0.3,
                                                             early_exit=False, schedule="llada"))
        assert got == uncapped[name] and varied(got)
    # LLaDA's default stays uncapped with steps; Dream's is capped by the quota then
    for name, lm in (("llada", llada_lm), ("dream", dream_lm)):
        got, _ = ecache(lm, PROMPTS, DecodeConfig(gen_length=16, block_length=8, steps=8, threshold=0.3,
                                                  early_exit=False))
        assert (got == uncapped[name]) == (name == "llada")


# --- (3) Fast-dLLM's Dream block sampler: --compat fastdllm


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("threshold", [None, 0.3])
def test_compat_fastdllm_matches_block_sampler(dream_lm, batch, cache, threshold):
    prompts = PROMPTS[:batch]
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=8, threshold=threshold, remasking="entropy"
                       if threshold is None else "low_confidence", compat="fastdllm", early_exit=False)
    got, records = ecache(dream_lm, prompts, cfg, cache)
    want = block_sampler_reference(dream_lm, ids_of(dream_lm, prompts), 16, 8, 8, cache, threshold)
    assert got == want and varied(got)
    firsts = 0
    for r in records:  # each row's block's first step commits its first position, whatever its confidence
        for b in (r.step_in_block == 0).nonzero().flatten().tolist():
            firsts += 1
            assert r.targets[b][r.committed[b]].tolist() == [int(r.targets[b, 0])]
    assert firsts == 2 * batch
    # without compat the first step follows the rule (Dream's schedule: 0 tokens here), so outputs differ
    plain, _ = ecache(dream_lm, prompts, DecodeConfig(gen_length=16, block_length=8, steps=8, threshold=threshold,
                                                      early_exit=False), cache)
    assert plain != got


def test_compat_and_schedule_errors(llada_lm, dream_lm):
    def start(lm, **kw):
        eng = Engine.from_loaded(lm)
        eng.start(eng.encode(["abc"], chat=False), DecodeConfig(gen_length=16, block_length=8, **kw),
                  make_policy("none"))

    cases = [
        (llada_lm, dict(compat="fastdllm"), "Dream block sampler"),
        (dream_lm, dict(compat="fastdllm", schedule="llada"), "drop --schedule llada"),
        (dream_lm, dict(compat="fastdllm", steps=2), "≥ 2 steps per block"),
        (dream_lm, dict(threshold=0.9, steps=6), "not a multiple of the 3 steps per block"),
        (dream_lm, dict(schedule="cosine"), "llada"),
        (dream_lm, dict(compat="fast-dllm"), "fastdllm"),
        (dream_lm, dict(eps=1.0), "[0, 1)"),
    ]
    for lm, kw, needle in cases:
        with pytest.raises(UsageError, match=None) as e:
            start(lm, **kw)
        assert needle in str(e.value) and "\n" not in str(e.value), (kw, str(e.value))


def test_eps_comes_from_generation_config(dream_dir, tmp_path):
    import json
    import shutil

    from ecache_cli.errors import ModelLoadError
    from ecache_cli.models.loader import load_model

    ckpt = tmp_path / "dream-eps"
    shutil.copytree(dream_dir, ckpt)  # the shared fixture stays untouched
    (ckpt / "generation_config.json").write_text(json.dumps({"eps": 0.2, "steps": 512, "alg": "origin"}))
    lm = load_model(ckpt, device="cpu", dtype="float32")
    assert lm.spec.eps == 0.2
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=16, remasking="entropy", early_exit=False)
    got, records = ecache(lm, PROMPTS[:1], cfg)
    assert got == dream_reference(lm, ids_of(lm, PROMPTS[:1]), 16, 8, 16, "entropy", eps=0.2)
    assert [int(r.n_committed[0]) for r in records[:8]] == [0, 0, 1, 0, 1, 1, 1, 4]  # eps 0.2's counts
    explicit, _ = ecache(lm, PROMPTS[:1], DecodeConfig(gen_length=16, block_length=8, steps=16, remasking="entropy",
                                                        early_exit=False, eps=1e-3))
    assert explicit == dream_reference(lm, ids_of(lm, PROMPTS[:1]), 16, 8, 16, "entropy") != got
    (ckpt / "generation_config.json").write_text(json.dumps({"eps": 2}))
    with pytest.raises(ModelLoadError, match=r"eps 2 must be a number in \[0, 1\)"):
        load_model(ckpt, device="cpu", dtype="float32")


# --- (4) Dream's sampled decoding: its confidences at temperature > 0, alg_temp, alg 'origin'
# Dream draws from torch's global RNG (dists.Categorical, torch.rand, torch.multinomial), so its random stream
# cannot be reproduced; the reference loops below take the engine's draws instead (row b: row_generator(seed, b),
# per step U (n, V) for the tokens when temperature > 0, then U (n,) for origin's reveals or alg_temp's keys, n =
# the row's masks in the block in ascending order) and everything else from Dream's description: what is chosen
# given the draws is compared exactly.


def dream_filter(z, top_p, top_k):
    """Dream top_p_logits then top_k_logits on (temperature-scaled) logits z (n, V): −inf outside."""
    if top_p is not None and top_p < 1:
        sorted_z, order = z.sort(dim=-1, descending=True)
        remove = torch.softmax(sorted_z, dim=-1).cumsum(-1) > top_p
        remove[..., 1:] = remove[..., :-1].clone()  # keep the first token above the threshold
        remove[..., 0] = False
        z = z.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), NEG)
    if top_k is not None:
        z = z.masked_fill(z < z.topk(min(top_k, z.shape[-1]), dim=-1).values[..., -1:], NEG)
    return z


def dream_sample_tokens(logits, banned, alg, temperature, top_p=None, top_k=None, uniform=None, tempered=True):
    """Dream sample_tokens for n positions: logits float64 (n, V) -> x0 (n,), confidence (n,) float64.
    q = softmax(top_k(top_p(logits / T))) (T = 1 at temperature 0, banned ids removed: never chosen); x0 ~ q, with
    the given draws argmax(log q − log(−log U)), argmax at temperature 0; maskgit_plus: q(x0); topk_margin: top-1
    − top-2 of q; entropy: Σ q′·log(q′ + 1e-10) for q′ Dream's whole distribution (banned ids kept), filtered
    the same.
    tempered=False scores at temperature 1 from the raw logits instead (ecache's scores before this rule, and the
    LLaDA rules' low_confidence: softmax of the un-tempered logits)."""
    t = temperature if temperature > 0 else 1.0
    z = logits.clone()
    z[:, banned] = NEG
    logq = torch.log_softmax(dream_filter(z / t, top_p, top_k), dim=-1)
    x0 = (logq - torch.log(-torch.log(uniform))).argmax(-1) if temperature > 0 else logq.argmax(-1)
    q = torch.softmax(logq if tempered else z, dim=-1)
    if alg in ("maskgit_plus", "low_confidence"):
        return x0, q.gather(-1, x0[:, None]).squeeze(-1)
    if alg == "topk_margin":
        top = q.sort(dim=-1, descending=True).values
        return x0, top[:, 0] - top[:, 1]
    whole = torch.softmax(dream_filter(logits / t, top_p, top_k) if tempered else logits, dim=-1)
    return x0, (whole * torch.log(whole + 1e-10)).sum(-1)


def sampled_reference(lm, prompt_ids, gen_length, block_length, steps, alg, temperature=0.0, top_p=None, top_k=None,
                      alg_temp=None, cache="none", schedule="dream", tempered=True, seed=0, eps=1e-3, compat=None):
    """Dream diffusion_generate (generation_utils.py _sample) with temperature, top_p / top_k, alg_temp and alg
    'origin', per block on timesteps t = linspace(1, eps, steps_per_block + 1), per row with the engine's draws.
    origin: each mask revealed iff its U < 1 − t[i+1]/t[i] (every mask at the last step), its token drawn.
    Otherwise k = int(n · (1 − t[i+1]/t[i])) (all at the last step), or with schedule="llada" LLaDA's split
    (n // steps, the first n % steps steps one more); the top-k of the confidence, or with alg_temp > 0 k draws
    without replacement from softmax(confidence / alg_temp), as the top-k of confidence / alg_temp + Gumbel(U).
    A block ends when it has no masks (Dream's later steps commit nothing). compat="fastdllm": Fast-dLLM's block
    sampler (generation_utils_block.py): step 0 commits the block's first position (the step's draws are still
    taken), the later steps count from i = 1 on the same timesteps."""
    cv = Canvas(lm, prompt_ids, gen_length)
    B, P = cv.x.shape[0], cv.P
    gens = [row_generator(seed, b) for b in range(B)]
    spb, timesteps = block_timesteps(gen_length, block_length, steps, eps)
    for start, end in cv.blocks(block_length):
        n0 = cv.masked()[:, start:end].sum(1).tolist()  # masks per row at the block start (LLaDA's split)
        for i in range(spb):
            if not cv.masked()[:, start:end].any():
                break
            logits = cv.forward(cache, start, end, refresh=i == 0)
            t, s = timesteps[i], timesteps[i + 1]
            for b in range(B):
                pos = cv.masked()[b, start:end].nonzero().squeeze(1) + start  # (n,) ascending
                n = len(pos)
                if n == 0:
                    continue
                u_tok = (torch.rand((n, logits.shape[-1]), dtype=torch.float64, generator=gens[b])
                         if temperature > 0 else None)
                x0, conf = dream_sample_tokens(logits[b, pos], cv.banned, alg, temperature, top_p, top_k, u_tok,
                                               tempered)
                if compat == "fastdllm" and i == 0:
                    if alg_temp:
                        torch.rand(n, dtype=torch.float64, generator=gens[b])  # the engine draws, unused
                    pick = (pos == start).nonzero().squeeze(1)  # x[:, s] = x0[:, s]
                elif alg == "origin":
                    u = torch.rand(n, dtype=torch.float64, generator=gens[b])
                    pick = (u < (1 - s / t if i < spb - 1 else 1)).nonzero().squeeze(1)
                else:
                    if schedule == "llada":
                        k = n0[b] // spb + int(i < n0[b] % spb)
                    else:
                        k = int(torch.tensor(n, dtype=torch.float32) * (1 - s / t)) if i < spb - 1 else n
                    if alg_temp:
                        u = torch.rand(n, dtype=torch.float64, generator=gens[b])
                        conf = conf / alg_temp - torch.log(-torch.log(u))
                    pick = torch.topk(conf, min(k, n)).indices
                cv.x[b, pos[pick]] = x0[pick]
    return cv.x[:, P:].tolist()


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
@pytest.mark.parametrize("temperature,top_p,top_k", [(0.7, None, None), (1.6, 0.9, None), (0.5, None, 6),
                                                     (0.0, 0.8, 5), (0.0, None, None)])
def test_dream_confidence_is_that_of_the_tempered_filtered_distribution(alg, temperature, top_p, top_k):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 40, generator=g) * 2.5
    banned = torch.tensor([7, 38, 39])
    uniform = torch.rand(2, 5, 40, dtype=torch.float64, generator=g)
    out = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=None, banned_ids=banned,
                 uniform=uniform.clone() if temperature > 0 else None, dream_alg=alg)
    x0, want = dream_sample_tokens(logits.double().reshape(10, 40), banned, alg, temperature, top_p, top_k,
                                   uniform.reshape(10, 40))
    assert out.x0.reshape(-1).tolist() == x0.tolist()
    torch.testing.assert_close(out.dream_conf.reshape(-1), want, rtol=1e-12, atol=1e-12)
    # the temperature-1 scores the LLaDA rules keep: Dream's differ with a temperature (and, for the entropy, a
    # filter); without either they are the same score
    llada = {"maskgit_plus": out.prob, "topk_margin": out.margin, "entropy": out.neg_entropy}[alg]
    if temperature > 0 or (alg == "entropy" and (top_p or top_k)):
        assert (out.dream_conf - llada).abs().max() > 1e-3
    elif alg == "entropy":  # only Dream's epsilon: Σ q·log(q + 1e-10) vs Σ q·log q
        torch.testing.assert_close(out.dream_conf, llada, rtol=0, atol=1e-7)
    else:
        assert torch.equal(out.dream_conf, llada)
    assert sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=None, banned_ids=banned,
                  uniform=uniform.clone() if temperature > 0 else None).dream_conf is None


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("temperature,top_p,top_k,cache", [(0.8, None, None, "none"), (1.5, 0.9, None, "none"),
                                                           (0.6, None, 8, "dual")])
def test_dream_sampled_decoding_scores_as_diffusion_generate(dream_lm, alg, batch, temperature, top_p, top_k, cache):
    prompts = PROMPTS[:batch]
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=8, temperature=temperature, top_p=top_p, top_k=top_k,
                       remasking=alg, early_exit=False)
    got, _ = ecache(dream_lm, prompts, cfg, cache)
    want = sampled_reference(dream_lm, ids_of(dream_lm, prompts), 16, 8, 8, alg, temperature, top_p, top_k,
                             cache=cache)
    assert got == want and varied(got)


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
def test_sampled_comparison_can_fail_and_llada_keeps_untempered_scores(dream_lm, llada_lm, alg):
    # Dream's rules: the engine agrees with the tempered reference, not with temperature-1 scores
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=8, temperature=0.5, remasking=alg, early_exit=False)
    ids = ids_of(dream_lm, PROMPTS)
    got, _ = ecache(dream_lm, PROMPTS, cfg)
    assert got == sampled_reference(dream_lm, ids, 16, 8, 8, alg, 0.5)
    assert got != sampled_reference(dream_lm, ids, 16, 8, 8, alg, 0.5, tempered=False)
    # LLaDA's default (llada schedule): scores at temperature 1 from the un-tempered logits (LLaDA generate.py)
    ids = ids_of(llada_lm, PROMPTS)
    got, _ = ecache(llada_lm, PROMPTS, cfg)
    assert got == sampled_reference(llada_lm, ids, 16, 8, 8, alg, 0.5, schedule="llada", tempered=False)
    assert got != sampled_reference(llada_lm, ids, 16, 8, 8, alg, 0.5, schedule="llada")
    # ... and Dream's once the dream schedule is chosen
    got, _ = ecache(llada_lm, PROMPTS, DecodeConfig(gen_length=16, block_length=8, steps=8, temperature=0.5,
                                                    remasking=alg, early_exit=False, schedule="dream"))
    assert got == sampled_reference(llada_lm, ids, 16, 8, 8, alg, 0.5) and varied(got)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("alg,alg_temp,temperature,cache", [("entropy", 0.5, 0.0, "none"),
                                                            ("maskgit_plus", 0.05, 0.0, "dual"),
                                                            ("topk_margin", 0.2, 0.9, "none"),
                                                            ("origin", None, 0.0, "none"),
                                                            ("origin", None, 0.8, "dual")])
def test_dream_alg_temp_and_origin_match_diffusion_generate(dream_lm, batch, alg, alg_temp, temperature, cache):
    prompts = PROMPTS[:batch]
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=8, temperature=temperature, remasking=alg,
                       alg_temp=alg_temp, early_exit=False)
    got, records = ecache(dream_lm, prompts, cfg, cache)
    want = sampled_reference(dream_lm, ids_of(dream_lm, prompts), 16, 8, 8, alg, temperature, alg_temp=alg_temp,
                             cache=cache)
    assert got == want and varied(got)
    # the comparison can fail: the top-scoring positions (alg_temp 0), or maskgit_plus for origin, decode otherwise
    other = DecodeConfig(gen_length=16, block_length=8, steps=8, temperature=temperature, early_exit=False,
                         remasking="maskgit_plus" if alg == "origin" else alg)
    assert ecache(dream_lm, prompts, other, cache)[0] != got
    counts = [[int(r.n_committed[r.rows.tolist().index(b)]) for r in records
               if b in r.rows and int(r.block[r.rows.tolist().index(b)]) == blk]
              for blk in (0, 1) for b in range(batch)]  # a row leaves the batch once fully decoded
    assert all(sum(c) == 8 and len(c) <= 4 for c in counts)  # 4 steps per block, every mask committed
    if alg == "origin":  # reveals at random: not the fixed counts of Dream's schedule
        assert any(c != dream_num_transfer_tokens(torch.tensor([8]), 4, 1e-3)[0].tolist() for c in counts), counts


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_compat_fastdllm_with_alg_temp_matches_block_sampler(dream_lm, batch, cache):
    # Fast-dLLM's block sampler samples its positions with alg_temp > 0 too (generation_utils_block.py)
    prompts = PROMPTS[:batch]
    cfg = DecodeConfig(gen_length=16, block_length=8, steps=8, remasking="entropy", compat="fastdllm", alg_temp=0.3,
                       early_exit=False)
    got, _ = ecache(dream_lm, prompts, cfg, cache)
    ids = ids_of(dream_lm, prompts)
    assert got == sampled_reference(dream_lm, ids, 16, 8, 8, "entropy", alg_temp=0.3, cache=cache, compat="fastdllm")
    top_k = block_sampler_reference(dream_lm, ids, 16, 8, 8, cache)  # alg_temp 0: the top-scoring positions
    assert varied(got) and got != top_k
    # the two reference loops agree without alg_temp
    assert sampled_reference(dream_lm, ids, 16, 8, 8, "entropy", cache=cache, compat="fastdllm") == top_k


def test_alg_temp_draws_positions_as_multinomial_without_replacement():
    # Dream: torch.multinomial(softmax(confidence / alg_temp), k); the engine: top-k of conf / alg_temp + Gumbel
    conf = torch.tensor([[0.9, 0.5, NEG, 0.7, 0.2]], dtype=torch.float64)
    alg_temp, N = 0.25, 40000
    u = torch.rand(N, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    picks = select_sampled(conf.expand(N, 5), torch.full((N,), 2), alg_temp, u)  # (N, 5)
    assert (picks.sum(1) == 2).all() and not picks[:, 2].any()
    p = torch.softmax(conf / alg_temp, dim=-1)[0]
    mult = torch.multinomial(p.expand(N, 5), 2, replacement=False, generator=torch.Generator().manual_seed(6))
    for i, j in [(0, 1), (0, 3), (0, 4), (1, 3), (1, 4), (3, 4)]:
        exact = float(p[i] * p[j] / (1 - p[i]) + p[j] * p[i] / (1 - p[j]))  # successive sampling, P({i, j})
        ours = float((picks[:, i] & picks[:, j]).double().mean())
        theirs = float(((mult == i).any(1) & (mult == j).any(1)).double().mean())
        assert abs(ours - exact) < 0.01 and abs(theirs - exact) < 0.01, (i, j, ours, theirs, exact)
    assert float(picks[:, 0].double().mean()) > 0.8  # the most confident is drawn most often, not always
    assert float(picks[:, 4].double().mean()) > 0.02
    # never more than the candidates; a tiny alg_temp does not underflow (softmax would be all 0 but one)
    one = torch.rand(1, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    assert select_sampled(conf, torch.tensor([9]), alg_temp, one).tolist() == [[True, True, False, True, True]]
    assert select_sampled(conf, torch.tensor([2]), 1e-6, one).tolist() == [[True, False, False, True, False]]


def test_alg_temp_and_origin_errors(llada_lm, dream_lm):
    def start(lm, **kw):
        eng = Engine.from_loaded(lm)
        eng.start(eng.encode(["abc"], chat=False), DecodeConfig(gen_length=16, block_length=8, **kw),
                  make_policy("none"))

    cases = [
        (llada_lm, dict(steps=16, remasking="entropy", alg_temp=0.5), "use it with --schedule dream"),
        (dream_lm, dict(steps=16, remasking="entropy", alg_temp=0.5, schedule="llada"), "use it with --schedule dream"),
        (dream_lm, dict(threshold=0.9, alg_temp=0.5), "--threshold / --factor"),
        (dream_lm, dict(steps=16, remasking="random", alg_temp=0.5), "--remasking random has none"),
        (dream_lm, dict(steps=16, alg_temp=-1.0), "alg_temp=-1.0 must be ≥ 0"),  # DecodeConfig, as --alg-temp
        (dream_lm, dict(steps=16, alg_temp=float("nan")), "must be a finite number ≥ 0"),
        (llada_lm, dict(steps=16, remasking="origin"), "use it with --schedule dream"),
        (dream_lm, dict(steps=16, remasking="origin", compat="fastdllm"), "use --remasking entropy"),
        (dream_lm, dict(steps=16, remasking="origin", low_eos_confidence=True), "drop one"),
        (dream_lm, dict(threshold=0.9, remasking="origin"), "use --remasking low_confidence"),
    ]
    for lm, kw, needle in cases:
        with pytest.raises(UsageError) as e:
            start(lm, **kw)
        assert needle in str(e.value) and "\n" not in str(e.value), (kw, str(e.value))
    # alg_temp 0 is Dream's default, the top-scoring positions: accepted everywhere, a no-op
    cfg = dict(gen_length=16, block_length=8, steps=16, early_exit=False)
    for lm in (llada_lm, dream_lm):
        assert ecache(lm, PROMPTS, DecodeConfig(alg_temp=0.0, **cfg))[0] == ecache(lm, PROMPTS, DecodeConfig(**cfg))[0]


def test_alg_temp_flag_and_profile_key(dream_lm, dream_dir, tmp_path):
    import json

    import yaml
    from typer.testing import CliRunner

    from ecache_cli.cli import app

    runner = CliRunner()
    small = ["--model", str(dream_dir), "--gen-length", "16", "--block-length", "8", "--steps", "8", "--no-chat",
             "--cache", "none", "-q"]
    res = runner.invoke(app, ["generate", "abc", *small, "--alg-temp", "-0.5"])
    assert res.exit_code == 2 and "--alg-temp -0.5 must be ≥ 0" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    res = runner.invoke(app, ["generate", "abc", *small, "--alg-temp", "0.5", "--threshold", "0.9"])
    assert res.exit_code == 2 and "--threshold / --factor" in res.stderr
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({"decode": {"alg_temp": 0.3, "remasking": "entropy"}}))
    res = runner.invoke(app, ["generate", "abc", *small, "--profile", str(prof), "--jsonl"])
    assert res.exit_code == 0, res.stderr
    cfg = dict(gen_length=16, block_length=8, steps=8, remasking="entropy")
    eng = Engine.from_loaded(dream_lm)
    run = eng.start(eng.encode(["abc"], chat=False), DecodeConfig(alg_temp=0.3, **cfg), make_policy("none"))
    list(run)
    want = run.results()[0].answer_ids
    assert json.loads(res.stdout)["token_ids"] == want
    res = runner.invoke(app, ["generate", "abc", *small, "--profile", str(prof), "--alg-temp", "0", "--jsonl"])
    assert json.loads(res.stdout)["token_ids"] != want  # the flag overrides the profile: top-k positions
