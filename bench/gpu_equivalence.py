"""Equivalence checks on an accelerator in its working dtype (default: CUDA, bfloat16).

The CPU test suite proves, in float32, that every policy forced to refresh at every step reproduces
``none`` token for token (``tests/test_policies.py``). This script runs the same check on the device
and dtype given, for random LLaDA- and Dream-shaped checkpoints (Dream with grouped-query attention),
with the step schedule and with threshold decoding, one prompt and a batch of three. It also reports,
without failing on them, the largest logit difference between a partial forward over every position
and a full forward (different kernel shapes round differently in bfloat16), and the token agreement of
each policy's default (approximate) settings with ``none``.

The forced-refresh parameters come from ``tests/test_policies.py`` (FORCED_REFRESH), read from the file
so the two lists cannot drift apart. Exit status 1 when any forced-refresh run differs from ``none``.

    python bench/gpu_equivalence.py --device cuda --dtype bfloat16 --out runs_out/gpu/equivalence.json
    python bench/gpu_equivalence.py --device cpu --dtype float32     # the same checks on CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

PROMPTS = ["Sort: 9 3 7 1", "abc", "Reverse the list 4 5 6 7 8"]


def forced_refresh_params() -> dict:
    """Each policy's declared setting under which every step is a full forward (``CachePolicy.forced_refresh``)."""
    from ecache_cli.cache import POLICIES

    return {n: c.forced_refresh for n, c in POLICIES.items() if c.forced_refresh is not None}


def decode(lm, prompts, cfg, policy, **params):
    from ecache_cli.cache import make_policy
    from ecache_cli.engine import Engine

    eng = Engine.from_loaded(lm)
    run = eng.start(eng.encode(prompts, chat=False), cfg, make_policy(policy, **params))
    for _ in run:
        pass
    return run.results()


def partial_vs_full(lm) -> float:
    """Max |logit difference| between a partial forward over all positions and a full forward."""
    m = lm.model
    ids = torch.randint(10, 90, (2, 48), device=lm.device)
    keys = torch.ones_like(ids, dtype=torch.bool)
    allpos = torch.arange(48, device=lm.device).expand(2, 48)
    with torch.inference_mode():
        full = m(ids, m.new_store(keys)).float()
        part = m(ids, m.new_store(keys), query_pos=allpos).float()
    return float((full - part).abs().max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    from ecache_cli.cache import POLICIES
    from ecache_cli.engine import DecodeConfig
    from ecache_cli.models.loader import load_model
    from ecache_cli.models.synthetic import write_random_checkpoint

    forced = forced_refresh_params()
    rules = {"schedule": {"steps": 32}, "threshold": {"threshold": 0.7}}
    failures, report = [], {"device": args.device, "dtype": args.dtype, "families": {}}
    tmp = Path(tempfile.mkdtemp(prefix="ecache-gpu-eq-"))
    for family, extra in (("llada", {}), ("dream", {"n_kv_heads": 2}), ("llada-moe", {"n_kv_heads": 4})):
        d = write_random_checkpoint(tmp / family, family, seed=0, scale=4.0, d_model=256, n_layers=4, n_heads=8,
                                    mlp_hidden=512, **extra)
        lm = load_model(d, device=args.device, dtype=args.dtype)
        fam = report["families"][family] = {"partial_vs_full_max_abs_logit_diff": partial_vs_full(lm), "forced": {},
                                            "default_token_agreement": {}}
        for rule_name, rule in rules.items():
            cfg = DecodeConfig(gen_length=32, block_length=8, **rule)
            for batch in (1, 3):
                ref = decode(lm, PROMPTS[:batch], cfg, "none")
                for policy in POLICIES:
                    if policy not in forced:
                        failures.append(f"{family}: {policy} has no FORCED_REFRESH entry in tests/test_policies.py")
                        continue
                    got = decode(lm, PROMPTS[:batch], cfg, policy, **forced[policy])
                    same = [g.token_ids == r.token_ids for g, r in zip(got, ref)]
                    fam["forced"][f"{policy}/{rule_name}/b{batch}"] = all(same)
                    if not all(same):
                        failures.append(f"{family} {policy} {rule_name} batch {batch}: "
                                        "forced refresh differs from none")
                    if batch == 3 and rule_name == "schedule":
                        approx = decode(lm, PROMPTS[:batch], cfg, policy)
                        n = sum(len(r.token_ids) for r in ref)
                        agree = sum(a == b for g, r in zip(approx, ref) for a, b in zip(g.token_ids, r.token_ids))
                        fam["default_token_agreement"][policy] = agree / n
        print(f"{family}: partial-vs-full max |dlogit| {fam['partial_vs_full_max_abs_logit_diff']:.3g}; "
              f"forced refresh == none in {sum(fam['forced'].values())}/{len(fam['forced'])} runs; "
              "default-setting token agreement "
              f"{json.dumps({k: round(v, 3) for k, v in fam['default_token_agreement'].items()})}")
    report["failures"] = failures
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    for f in failures:
        print("FAIL " + f)
    print("equivalence: " + ("OK" if not failures else f"{len(failures)} failures"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
