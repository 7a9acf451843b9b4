"""The ``ecache`` model of lm-evaluation-harness: our engine and cache policies behind lm-eval's LM API.

    lm_eval --model ecache --model_args model=llada-8b,cache=entropy,tau=0.8,gen_length=256 --tasks gsm8k

``model_args`` (comma-separated ``key=value``; lm-eval reads numbers, true/false and none):

- model (alias ``pretrained``), device, dtype, force: as ``ecache generate --model/--device/--dtype/--force``
  (``force=true`` loads weights that need more than the device's free memory);
- every decoding setting of ``ecache generate``: gen_length, block_length, steps, temperature, top_k,
  top_p, remasking, threshold, factor, ban_eos, low_eos_confidence, early_exit;
- every cache setting: cache (policy name; ``cache=none`` is the no-cache baseline), tau, recent_k,
  signal, block_refresh, refresh_every and the peers' profile keys (kp, kr, rho, current_k, ...);
- profile (a calibrated YAML or ``<model>/<task>`` name) or task (``profiles/<model>/<task>.yaml``);
  precedence defaults < profile < model_args, as ``ecache generate``;
- chat (default: when the checkpoint has a chat template, as ``ecache generate``; ignored for prompts
  lm-eval already rendered with ``--apply_chat_template``), seed, batch_size (lm-eval's ``--batch_size``);
- loglikelihood: mc_num (128), mc_batch_size (the largest divisor of mc_num up to 32), mc_seed (1234),
  greedy_check (false);
- stats_out: where to write the speed JSON (default: beside lm-eval's ``--output_path``).

``generate_until``: requests with the same generation kwargs are decoded in batches of batch_size by
the engine (``Engine.start``, the loop every ``ecache`` command uses). The canvas is the ``gen_length``
model_arg (or profile) when given, else the request's ``max_gen_toks`` (lm-eval's default 256) rounded up
to a whole block; a row stops as soon as its decoded prefix (every position before its first mask)
contains one of the request's ``until`` strings, or at its end marker, and the text is cut before the
first ``until`` string and to ``max_gen_toks`` tokens, as lm-eval's HF model does. Greedy (temperature
0) unless the request or model_args set a temperature.

``loglikelihood``: the Monte Carlo ELBO estimate of LLaDA's evaluation (``likelihood.py``); is_greedy is
computed only with ``greedy_check=true`` (a ``none``-policy decode of the continuation, one token per
step by confidence, as LLaDA's ``suffix_greedy_prediction``), else False (LLaDA recommends off).
``loglikelihood_rolling`` is not supported (as in LLaDA's evaluation).

Speed: per request type, generated tokens, wall seconds, NFE, full/partial forwards and the refresh
rate (full forwards / NFE) are summed on each rank and gathered after every call; across ranks
tokens/s = total tokens over the slowest rank's wall time (``distributed.aggregate_speed``). They appear
in lm-eval's results under ``config.ecache`` and in the speed JSON.

Data parallel (``torchrun``/``accelerate launch``): lm-eval shards the documents by ``rank`` and
``world_size`` and gathers the metrics on rank 0 through ``all_gather``/``gather_object``/``barrier``,
which this class implements over ``torch.distributed`` (``ecache_cli.distributed``).
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from datetime import datetime
from pathlib import Path
from typing import Annotated

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from .. import distributed
from ..config import CACHE_KEYS, DECODE_KEYS, check_value, load_profile, option_ranges, value_kinds
from ..contract.fields import fitted_kind
from ..decoding.config import DecodeConfig
from ..engine.core import Engine
from ..errors import UsageError
from ..outputs import check_dir, check_file
from ..tasks import TASKS
from .likelihood import check_mc, default_mc_batch, mc_loglikelihood

_UNSET = object()
SPEED_KEYS = ("requests", "generated_tokens", "wall_s", "nfe", "full_forwards", "partial_forwards", "forwards")


def cache_keys() -> set[str]:
    """Cache model_args: the generic keys and every registered policy's parameters."""
    from ..cache import POLICIES, policy_params

    return set(CACHE_KEYS).union(*(policy_params(n) for n in POLICIES)) - {"policy"}


@register_model("ecache")
class EcacheLM(LM):
    """lm-eval model over the ecache engine (module docstring: model_args, rules, speed JSON).

    Raises UsageError (one line naming the key and the fix) for an unknown or bad model_arg,
    ModelLoadError for a model that cannot be loaded.
    """

    def __init__(self, **kwargs):
        super().__init__()
        from ..console import rewriting
        from ..errors import EcacheError

        try:
            with rewriting(model_args_message):  # the warnings of the checks name model_args keys too
                self._setup(**kwargs)
        except EcacheError as e:  # every refusal of the setup names what it refuses as model_args (one prefix),
            message = model_args_message(str(e))  # but lm-eval's own --output_path, checked here too
            own = message.startswith(("model_args", "--output_path"))
            raise type(e)(message if own else f"model_args: {message}") from None

    def _setup(self, model: str = "tiny", device: str | None = "auto", dtype: str = "auto",
               profile: str | None = None, task: str | None = None, chat: bool | None = None, batch_size=1,
               max_batch_size=None, seed: int = 0,
               cache=_UNSET, mc_num: int = 128, mc_batch_size: int | None = None, mc_seed: int = 1234,
               greedy_check: bool = False, stats_out: str | None = None, pretrained: str | None = None,
               force: bool = False, **kwargs):
        """The constructor's work (:class:`EcacheLM`'s model_args); its errors name command-line flags,
        which ``__init__`` renames to model_args keys (:func:`model_args_message`)."""
        from ..models.loader import load_model
        from ..runs.settings import not_used_by, resolve_settings, warn_model_rules, warn_unused_cache_flags

        model = pretrained if pretrained is not None else model
        decode = {k: kwargs.pop(k) for k in list(kwargs) if k in DECODE_KEYS}
        ckeys = cache_keys()
        extra_cache = {k: kwargs.pop(k) for k in list(kwargs) if k in ckeys}
        if kwargs:
            bad = sorted(kwargs)[0]
            raise UsageError(f"model_args: {bad}={kwargs[bad]!r} is not an ecache setting; use the decode keys "
                             f"({', '.join(sorted(DECODE_KEYS))}), cache keys (cache, {', '.join(sorted(ckeys))}), "
                             "model, device, dtype, force, profile, task, chat, seed, mc_num, mc_batch_size, mc_seed, "
                             "greedy_check, stats_out")
        policy = None if cache is _UNSET else ("none" if cache is None else str(cache))  # lm-eval reads "none" as None
        kinds = value_kinds()
        # each range's example fits the other keys given (`steps=0 … (e.g. 32)` beside gen_length=32)
        decode = {k: _arg(k, v, fitted_kind(k, kinds["decode"].get(k), decode)) for k, v in decode.items()}
        extra_cache = {k: _arg(k, v, kinds["cache"].get(k)) for k, v in extra_cache.items()}
        seeded = Annotated[int, option_ranges()["seed"]]  # the --seed flag's range and words
        mc_num = _arg("mc_num", mc_num, int)
        mc_seed, seed = _arg("mc_seed", mc_seed, seeded), _arg("seed", seed, seeded)
        greedy_check, chat = _arg("greedy_check", greedy_check, bool), _arg("chat", chat, bool | None)
        force = _arg("force", force, bool)
        self.batch_size = _batch_size(batch_size)
        if mc_batch_size is None:
            mc_batch_size = default_mc_batch(mc_num) if mc_num >= 1 else 1
        check_mc(mc_num, _arg("mc_batch_size", mc_batch_size, int))
        if task is not None and str(task) not in TASKS:
            raise UsageError(f"model_args: task={task!r} is not a task; use one of {', '.join(TASKS)}")
        if stats_out is not None:
            check_file(stats_out, "model_args stats_out=")  # before any decoding, not after the evaluation
        elif (beside := _beside_output_path()) is not None:  # the speed JSON goes beside lm-eval's results:
            check_dir(Path(beside).parent, "--output_path")  # a file there fails now, not after the evaluation
        self.mc_num, self.mc_batch_size, self.mc_seed = mc_num, int(mc_batch_size), mc_seed
        self.greedy_check, self.seed, self.stats_out = greedy_check, seed, stats_out
        self.settings = resolve_settings(str(model), decode, {"policy": policy, **extra_cache},
                                         profile=profile, task=task)
        # a cache key the run's policy does not take: warned and ignored, as generate's cache flags are
        warn_unused_cache_flags([self.settings.cache], extra_cache, not_used_by(self.settings))
        prof = load_profile(self.settings.profile) if self.settings.profile else {}
        # the canvas follows max_gen_toks unless the user (or the profile) fixed it
        self.fixed_gen_length = "gen_length" in decode or "gen_length" in (prof.get("decode") or {})
        self.dist = distributed.setup()
        dev = device
        if self.dist.active and isinstance(dev, str) and dev.startswith("cuda:"):
            dev = "cuda"  # lm-eval's --device cuda:0 under a launcher: each rank takes its own GPU
        self.lm = load_model(str(model), self.dist.device(dev), dtype, force=force)
        warn_model_rules(self.settings, self.lm.spec.sampler)  # as every command, once the model is known
        import warnings

        from ..errors import IgnoredSetting

        warnings.simplefilter("ignore", IgnoredSetting)  # warned just above, in model_args' names
        self.engine = Engine.from_loaded(self.lm)
        self.tokenizer = self.lm.tokenizer
        self.chat = self.lm.chat if chat is None else (bool(chat) and self.lm.chat)
        self._lm_eval_templates = False  # set when lm-eval renders prompts itself (--apply_chat_template)
        self._rank, self._world_size = self.dist.rank, self.dist.world_size
        self._device = self.lm.device
        self.speed: dict[str, dict] = {}  # request type -> this rank's sums (SPEED_KEYS)
        self.speed_all: dict[str, dict] = {}  # request type -> every rank's, aggregated (filled after each call)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "EcacheLM":
        """lm-eval's constructor hook. ``additional_config`` (its ``--batch_size``, ``--device``, ...) fills
        only what ``model_args`` leave out; its default ``--device cuda:0`` means auto on a machine
        without CUDA (lm-eval sets it whether or not the user did)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        if str(extra.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
            extra["device"] = "auto"
        typed = _model_args_argv()  # lm-eval's own command line parsed them already: their texts from it
        return cls(**(_typed_numbers(dict(arg_dict), typed) if typed else arg_dict), **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "EcacheLM":
        """``key=value,...`` model_args (lm-eval's parser), then :meth:`create_from_arg_obj`."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(_typed_numbers(simple_parse_args_string(arg_string), arg_string),
                                       additional_config)

    # --- lm-eval's distributed primitives ------------------------------------------------------------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenation over ranks of a 0-d or 1-d tensor (lm-eval gathers request counts with it)."""
        parts = self.dist.all_gather_object(tensor.detach().cpu().reshape(-1), "request counts")
        return torch.cat(parts).to(tensor.device)

    def gather_object(self, obj, dst: int = 0):
        """Every rank's ``obj`` as a list on rank ``dst``; None elsewhere."""
        parts = self.dist.all_gather_object(obj, "metrics")
        return parts if self._rank == dst else None

    def barrier(self) -> None:
        self.dist.barrier()

    # --- chat templates ------------------------------------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return str(self.lm.path).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render lm-eval's chat history with the checkpoint's template (prompts are then not templated again)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UsageError(f"--apply_chat_template: model {self.lm.name} has no chat template; drop the flag")
        self._lm_eval_templates = True
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _encode_context(self, context: str) -> list[int]:
        """Prompt ids exactly as ``ecache generate`` encodes a prompt (``Engine.encode``)."""
        return self.engine.encode([context], self.chat and not self._lm_eval_templates)[0]

    # --- generate_until ------------------------------------------------------------------------------

    def decode_config(self, gen_kwargs: dict) -> tuple[DecodeConfig, list[str], int | None]:
        """(decode config, until strings, max_gen_toks) of one request's generation kwargs.

        Raises UsageError for a bad ``until`` or ``max_gen_toks``.
        """
        from dataclasses import replace

        gk = dict(gen_kwargs or {})
        until = gk.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        if not all(isinstance(u, str) and u for u in until):
            raise UsageError(f"gen_kwargs until={gen_kwargs.get('until')!r}: give non-empty strings")
        max_toks = gk.get("max_gen_toks")
        if max_toks is not None and int(max_toks) < 1:
            raise UsageError(f"gen_kwargs max_gen_toks={max_toks} must be ≥ 1")
        cfg = self.settings.decode
        if max_toks is not None and not self.fixed_gen_length:
            bl = cfg.block_length
            gen = -(-int(max_toks) // bl) * bl  # whole blocks
            cfg = replace(cfg, gen_length=gen, steps=None if cfg.steps is None else cfg.steps * gen // cfg.gen_length)
        if gk.get("do_sample") and gk.get("temperature"):
            cfg = replace(cfg, temperature=float(gk["temperature"]))
        for key in ("top_k", "top_p"):
            if gk.get("do_sample") and gk.get(key) is not None:
                cfg = replace(cfg, **{key: gk[key]})
        return cfg, until, None if max_toks is None else int(max_toks)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """One string per request: the engine's answer cut at the first ``until`` string (module docstring)."""
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        sums = self.speed.setdefault("generate_until", dict.fromkeys(SPEED_KEYS, 0))
        for idx in groups.values():
            cfg, until, max_toks = self.decode_config(requests[idx[0]].args[1])
            for s in range(0, len(idx), self.batch_size):
                chunk = idx[s:s + self.batch_size]
                contexts = [requests[i].args[0] for i in chunk]
                run = self.engine.start([self._encode_context(c) for c in contexts], cfg, self.settings.policy(),
                                        seed=self.seed, row_ids=[_request_id(c) for c in contexts])
                stop = StopStrings(run, until, self.tokenizer) if until else None
                for rec in run:
                    if stop is not None:
                        stop.check(rec)
                for i, res in zip(chunk, run.results()):
                    ids = res.answer_ids if max_toks is None else res.answer_ids[:max_toks]
                    text = cut_at(self.tokenizer.decode(ids, skip_special_tokens=True), until)
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    st = res.stats
                    for k in ("generated_tokens", "nfe", "full_forwards", "partial_forwards"):
                        sums[k] += st[k]
                    sums["forwards"] += st["nfe"]  # a denoising step is one model forward
                    sums["requests"] += 1
                sums["wall_s"] += run.wall_s
        self._gather_speed("generate_until")
        return out

    # --- loglikelihood -------------------------------------------------------------------------------

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(prefix ids, continuation ids). With chat: the templated context (as ``generate``) + the
        continuation's own ids. Without: LLaDA eval's ``_encode_pair`` (trailing spaces of the context move
        to the continuation; the continuation is what tokenizing context + continuation adds)."""
        tok = self.tokenizer
        if self.chat and not self._lm_eval_templates:
            return self._encode_context(context), tok(continuation, add_special_tokens=False)["input_ids"]
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole = tok(context + continuation)["input_ids"]
        prefix = tok(context)["input_ids"] if context else []
        if not prefix and self.lm.spec.logit_shift:  # Dream predicts token i from i-1: give it a start token
            start = self.lm.spec.bos_id if self.lm.spec.bos_id is not None else self.lm.spec.eos_id
            return [start], whole
        return list(prefix), list(whole[len(prefix):])

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(Monte Carlo log-likelihood in nats, is_greedy) per request (module docstring)."""
        out = []
        sums = self.speed.setdefault("loglikelihood", dict.fromkeys(SPEED_KEYS, 0))
        for req in requests:
            context, continuation = req.args
            prefix, target = self.encode_pair(context, continuation)
            gen = torch.Generator().manual_seed(self.mc_seed * 1_000_003 + _request_id(context + "\x00" + continuation))
            t0 = time.perf_counter()
            ll = mc_loglikelihood(self.lm.model, self.lm.spec, prefix, target, self.mc_num, self.mc_batch_size, gen)
            greedy = self._is_greedy(prefix, target) if self.greedy_check else False
            if self.lm.device.type == "cuda":
                torch.cuda.synchronize(self.lm.device)
            sums["wall_s"] += time.perf_counter() - t0
            sums["forwards"] += self.mc_num // self.mc_batch_size
            sums["requests"] += 1
            out.append((ll, greedy))
            self.cache_hook.add_partial("loglikelihood", req.args, (ll, greedy))
        self._gather_speed("loglikelihood")
        return out

    def _is_greedy(self, prefix: list[int], target: list[int]) -> bool:
        """Whether greedy decoding of len(target) masks after ``prefix`` (cache ``none``, one token per
        step by confidence: LLaDA's ``suffix_greedy_prediction``) gives ``target``."""
        from ..cache import make_policy

        L = len(target)
        cfg = DecodeConfig(gen_length=L, block_length=L, steps=L, early_exit=False)
        run = self.engine.start([prefix or [self.lm.spec.eos_id]], cfg, make_policy("none"), seed=0)
        for _ in run:
            pass
        return run.results()[0].token_ids == list(target)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise UsageError("loglikelihood_rolling (perplexity tasks) is not supported by the ecache model; "
                         "use generate_until or loglikelihood tasks")

    # --- speed report --------------------------------------------------------------------------------

    def _gather_speed(self, kind: str) -> None:
        """Aggregate ``kind``'s per-rank sums over the ranks (every rank calls this after each request batch)."""
        per_rank = self.dist.all_gather_object(self.speed.get(kind, dict.fromkeys(SPEED_KEYS, 0)), "speed figures")
        agg = distributed.aggregate_speed(per_rank)
        nfe, full, n = (sum(r[k] for r in per_rank) for k in ("nfe", "full_forwards", "requests"))
        agg.update(requests=n, nfe=nfe, full_forwards=full,
                   partial_forwards=sum(r["partial_forwards"] for r in per_rank),
                   forwards=sum(r["forwards"] for r in per_rank),  # generation: NFE; loglikelihood: MC forwards
                   refresh_rate=full / nfe if nfe else None, nfe_per_request=nfe / n if n and nfe else None)
        self.speed_all[kind] = agg

    def speed_report(self) -> dict:
        """Settings and aggregated speed of everything evaluated so far (JSON-ready)."""
        from ..runs.manifest import manifest

        return {"command": "lm_eval", "speed": self.speed_all, "world_size": self._world_size,
                "manifest": manifest(self.lm, self.settings, self.seed,
                                     {"mc_num": self.mc_num, "mc_batch_size": self.mc_batch_size, "chat": self.chat,
                                      "batch_size": self.batch_size})}

    def get_model_info(self) -> dict:
        """lm-eval puts this in its results' ``config`` (rank 0, after the evaluation); the speed JSON is
        written here too (``stats_out``, else beside ``--output_path``, else not at all)."""
        report = self.speed_report()
        path = self.stats_out or _beside_output_path()
        if path is not None:
            p = Path(path)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(report, indent=2, default=str) + "\n")
            report["speed_json"] = str(p)
        return {"ecache": report}


class StopStrings:
    """Finishes rows whose decoded prefix contains a stop string, through the engine's record contract:
    ``rec.finished`` is read by the engine after the consumer saw the record (``Run._finish_rows``)."""

    def __init__(self, run, until: list[str], tokenizer):
        self.run, self.until, self.tok = run, until, tokenizer
        self.seen = [0] * run.B  # per original row: prefix length already checked
        self.end_ids = set(run.engine.end_ids.tolist())

    def check(self, rec) -> None:
        """Mark in ``rec.finished`` every active row whose prefix (positions before its first mask) now
        holds a stop string."""
        st, P, G = self.run.state, self.run.P, self.run.G
        gm = st.masked[:, P:]  # (B, G)
        first = torch.where(gm.any(1), gm.int().argmax(1), G).tolist()  # (B,) prefix lengths
        stop = torch.zeros_like(rec.finished)
        rows = rec.rows.tolist()
        for j, (r, n) in enumerate(zip(rows, first)):
            if n <= self.seen[r]:
                continue
            self.seen[r] = n
            ids = st.tokens[j, P:P + n].tolist()
            end = next((k for k, t in enumerate(ids) if t in self.end_ids), None)
            text = self.tok.decode(ids if end is None else ids[:end], skip_special_tokens=True)
            if any(u in text for u in self.until):
                stop[j] = True
        if bool(stop.any()):
            rec.finished = rec.finished | stop


def cut_at(text: str, until: list[str]) -> str:
    """``text`` up to (excluding) the earliest occurrence of any ``until`` string."""
    cut = min((text.find(u) for u in until if u in text), default=len(text))
    return text[:cut]


def _request_id(text: str) -> int:
    """A stable non-negative id of a request's text (its random stream must not depend on rank or order)."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


#: model_args keys that are not decode or cache settings; those that take true/false.
OTHER_KEYS = {"model", "device", "dtype", "force", "profile", "task", "chat", "seed", "mc_num", "mc_batch_size",
              "mc_seed", "greedy_check", "stats_out", "cache"}
BOOL_KEYS = {"force", "chat", "greedy_check"}
_FLAG = None


def model_args_message(message: str) -> str:
    """``message`` (an error or warning of a check the adapter shares with the command line) with each
    flag that has a model_args key named as that key: ``--gen-length 16`` → ``gen_length=16``,
    ``--cache 'foo'`` → ``cache='foo'``, ``--steps ≥ 8`` → ``steps ≥ 8``, ``--no-chat`` → ``chat=false``,
    ``--force`` → ``force=true``, "pass the flag" → "set it in model_args". Flags with no model_args key
    (``--threads``) and lm-eval's own (``--batch_size``) stay as they are."""
    import re

    global _FLAG
    kinds = value_kinds()
    keys = DECODE_KEYS | cache_keys() | OTHER_KEYS
    bools = BOOL_KEYS | {k for kind in kinds.values() for k, t in kind.items() if "bool" in str(t)}
    if _FLAG is None:
        from ..cache import POLICIES
        from ..decoding.remasking import REMASKING

        words = {*POLICIES, *REMASKING, "llada", "dream", "fastdllm", "auto", "cpu", "cuda", "float32", "bfloat16",
                 "float16", "true", "false", "none"}
        value = r"'[^']*'|\"[^\"]*\"|[-+]?(?:\d[\w.+:-]*|inf|nan)|cuda:\d+|" + "|".join(sorted(map(re.escape, words),
                                                                                             key=len, reverse=True))
        _FLAG = re.compile(rf"--(no-)?([a-z][a-z0-9-]*)(?![\w])(?: ({value})(?![\w]))?")

    def one(m):
        neg, key, val = m.group(1), m.group(2).replace("-", "_"), m.group(3)
        key = "cache" if key == "cache" else key
        if key not in keys:
            return m.group(0)
        if key in bools and val is None:
            return f"{key}={'false' if neg else 'true'}"
        if neg:
            return m.group(0)
        return f"{key}={val}" if val is not None else key

    return _FLAG.sub(one, message).replace("pass the flag to override", "set it in model_args to override")


def _typed_numbers(args: dict, arg_string: str) -> dict:
    """lm-eval's parsed model_args (``args``) with each float kept as typed in ``arg_string``
    (``contract.fields.GivenFloat``, as the command line keeps its float flags: lm-eval reads ``tau=-1`` as
    -1.0 and ``tau=1e400`` as inf), so that its error names ``tau=-1`` and ``tau=1e400`` as the command line's
    ``--tau -1`` and ``--tau 1e400`` do."""
    from ..contract.fields import GivenFloat

    for part in arg_string.split(","):
        key, sep, text = part.partition("=")
        key, text = key.strip(), text.strip()
        value = args.get(key)
        if sep and isinstance(value, float):
            try:
                args[key] = GivenFloat(text)
            except ValueError:  # lm-eval read it otherwise; keep its value
                pass
    return args


def _arg(key: str, value, kind):
    """A model_arg as its setting's type wants it (:func:`ecache_cli.config.check_value`; lm-eval's
    parser already made ``3``, ``0.5``, ``true`` numbers and booleans, but ``-1`` a float, as it reads
    only digit strings as integers), else a one-line UsageError naming the value as given."""
    import re

    from ..contract.fields import GivenFloat

    try:
        typed = check_value(kind, value)
    except ValueError as e:
        # "-1" -> -1.0 (lm-eval reads only digit strings as integers): a whole number as the command line takes
        # one ("-1"), not "8.0" or "1e3", which --seed and --gen-length refuse
        written = value.text if isinstance(value, GivenFloat) else None
        if isinstance(value, float) and value.is_integer() and "whole number" in str(e) and (
                written is None or re.fullmatch(r"\s*[-+]?\d+\s*", written)):
            return _arg(key, int(value), kind)  # the range check then names -1 and the range
        raise UsageError(f"model_args: {key}={value!r} {e}") from None
    # a float as typed stays so (``tau=-1``, not -1.0) until the range check names it
    return value if isinstance(value, GivenFloat) and isinstance(typed, float) and typed == value else typed


def _batch_size(value) -> int:
    """lm-eval's ``--batch_size``: an integer ≥ 1 ('auto' means 1: the engine has no memory probe)."""
    if isinstance(value, str) and value.startswith("auto"):
        return 1
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"batch_size={value!r} must be an integer ≥ 1 (e.g. --batch_size 8)") from None
    if n < 1:
        raise UsageError(f"batch_size={n} must be ≥ 1 (e.g. --batch_size 8)")
    return n


def _model_args_argv() -> str | None:
    """The ``--model_args`` text on lm-eval's command line (``sys.argv``), or None: lm-eval's CLI hands the
    model a dict whose numbers it has already read (``tau=-1`` as -1.0)."""
    argv = sys.argv
    for i, a in enumerate(argv):
        if a == "--model_args" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--model_args="):
            return a.partition("=")[2]
    return None


def _beside_output_path() -> str | None:
    """``<dir>/ecache_speed_<time>.json`` for lm-eval's ``--output_path``/``-o`` (a folder, or a .json file's
    folder) when it is on the command line; None otherwise."""
    argv = sys.argv
    value = None
    for i, a in enumerate(argv):
        if a in ("--output_path", "-o") and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith("--output_path="):
            value = a.split("=", 1)[1]
    if value is None:
        return None
    folder = Path(value).parent if value.endswith(".json") else Path(value)
    return str(folder / f"ecache_speed_{datetime.now().strftime('%Y-%m-%dT%H-%M-%S')}.json")
