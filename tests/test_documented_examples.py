"""Every command example of the README and every worked example of the model card, run and checked.

The README's ``bash`` blocks are read from the file itself: each command line (continuations joined,
trailing comments dropped) must be either in ``CHECKS`` (run here, in a fresh folder, through bash
exactly as written, with its answer asserted) or in ``NOT_RUN`` with the reason it cannot run on a
CPU machine without downloads (an official 8B checkpoint, a dataset outside the repository, several
GPUs) or the test that covers it elsewhere. A new example without a check fails
``test_every_readme_command_is_checked``. The model card's ``Q`` → ``A`` examples of the ``list``
domain are decoded with the default settings and compared.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from cli_helpers import table_rows

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CARD = REPO / "ecache_cli" / "data" / "tiny" / "README.md"


def readme_commands(text: str) -> list[str]:
    """The command lines of the ``bash`` blocks of ``text``: ``\\`` continuations joined, comment lines
    and trailing ``  # ...`` comments dropped, whitespace collapsed."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for cmd in re.sub(r"\\\n\s*", " ", block).splitlines():
            cmd = re.sub(r"\s{2,}#.*$", "", cmd).strip()
            if cmd and not cmd.startswith("#"):
                out.append(" ".join(cmd.split()))
    return out


def run(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    """``cmd`` through bash in ``cwd``, with this venv's ``ecache`` first on PATH, one torch thread and
    the user's config folder redirected into ``cwd`` (no profile of the developer's leaks in)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1", "XDG_CONFIG_HOME": str(cwd / ".config"), "COLUMNS": "250"}
    env.pop("ECACHE_PROFILES", None)
    return subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


# --- the checks: each gets the finished process and its folder ------------------------------------

def _prints(answer: str):
    def check(res, cwd):
        assert res.stdout.strip() == answer, res.stdout
    return check


def _reverse_jsonl(res, cwd):
    (rec,) = [json.loads(line) for line in res.stdout.splitlines()]
    assert rec["prompt"] == "Reverse: 4 5 6" and rec["text"] == "6 5 4" and rec["ended"] is True


def _profile_list(res, cwd):
    rows = table_rows(res.stdout)
    policies = ("none", "prefix", "dual", "entropy", "dllm-cache", "dkv", "d2cache", "elastic", "es-dllm")
    assert set(policies) <= set(rows), sorted(rows)
    for p in policies:  # the last column is the task score (0-1) on the 4 list problems
        assert float(rows[p][-1]) >= 0.75, (p, rows[p])


def _profile_speedup(res, cwd):
    out = res.stdout.strip()
    speedup = float(out) if out[:1] != "{" else json.loads(out)["policies"]["entropy"]["speedup_vs_none"]
    assert speedup > 0  # the printed speedup (wall clock: its size is bench/'s business)
    doc = json.loads(run('ecache profile --policies none,entropy --json - "Sort: 9 3 7 1" | tail -1', cwd).stdout)
    assert [r["text"] for r in doc["requests"]] == ["1 3 7 9", "1 3 7 9"]
    assert doc["policies"]["entropy"]["work_share_vs_none"] < 0.5  # the cache served most positions


def _speed_check_rejected(res, profile: Path) -> bool:
    """True when a calibrate example ended because its speed check timed every qualifying setting
    slower than ``none`` (exit 1): an outcome of the machine's load, not of the code, which then must
    have written no profile and named each timed setting's speedups; the check itself is tested in
    tests/test_speed_guard.py."""
    if res.returncode != 1:
        return False
    assert "speed check: rejected" in res.stderr and "no profile written" in res.stderr, res.stderr[-2000:]
    assert not profile.exists()
    return True


def _calibrate_list(res, cwd):
    if _speed_check_rejected(res, cwd / "profiles" / "tiny" / "list.yaml"):
        return
    prof = yaml.safe_load((cwd / "profiles" / "tiny" / "list.yaml").read_text())
    assert prof["task"] == "list" and prof["decode"]["gen_length"] == 64 and prof["cache"]["policy"] == "entropy"
    assert prof["measured"]["n"] == 20 and prof["measured"]["score"] >= 0.9, prof["measured"]
    assert prof["measured"]["score_none"] - prof["measured"]["score"] <= 0.01 + 1e-9
    assert (cwd / "runs_out" / "list.png").stat().st_size > 0
    assert "chosen τ=" in res.stdout


def _calibrate_code_fidelity(res, cwd):
    if _speed_check_rejected(res, cwd / "runs_out" / "code-fidelity.yaml"):
        return
    prof = yaml.safe_load((cwd / "runs_out" / "code-fidelity.yaml").read_text())
    assert prof["task"] == "code" and prof["measured"]["metric"] == "fidelity"
    assert prof["measured"]["fidelity"] >= 0.99 and prof["measured"]["speedup"] > 1.0, prof["measured"]
    assert not (cwd / "profiles" / "tiny" / "code.yaml").exists()  # --out: the task's profile is left alone


def _trace_drift_picture(res, cwd):
    summary = json.loads((cwd / "runs_out" / "summary.json").read_text())
    assert (cwd / "runs_out" / "trace-drift.png").stat().st_size > 0
    assert (cwd / "runs_out" / "steps.jsonl").read_text().count("\n") >= 4 * 16
    assert any((cwd / "runs_out" / "drift").rglob("events.out.tfevents.*"))
    assert summary["prompts"] == 4, summary.keys()
    # the caption's facts: the shipped arith profile refreshes at each prompt's first forward and almost
    # never after, and no committed token differs from a fresh full forward's choice
    full = summary["refresh_steps"]
    assert 4 <= full <= 8 and summary["partial_steps"] == summary["records"] - full
    assert summary["fidelity"]["mismatched"] == 0 and summary["fidelity"]["committed"] == summary["records"]


def _trace_drift_sort(res, cwd):
    assert (cwd / "runs_out" / "drift.png").stat().st_size > 0
    assert "Pearson r" in res.stderr and "wrote plot runs_out/drift.png" in res.stderr


def _questions_written(res, cwd):  # (checks run after the whole chain: a third line was appended since)
    assert [json.loads(line)["id"] for line in (cwd / "questions.jsonl").read_text().splitlines()[:2]] == [1, 2]


def _answers_file(res, cwd):
    recs = [json.loads(line) for line in (cwd / "answers.jsonl").read_text().splitlines()]
    assert [(r["id"], r["text"]) for r in recs] == [(1, "1 3 7 9"), (2, "3 2 1")] and res.stdout == ""


def _answers_resumed(res, cwd):
    _answers_file(res, cwd)
    assert "resuming answers.jsonl: 2 record(s) kept, 0 to decode" in res.stderr, res.stderr


def _bad_line_added(res, cwd):
    assert (cwd / "questions.jsonl").read_text().count("\n") == 3


def _skip_invalid(res, cwd):
    recs = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r.get("text") for r in recs] == ["1 3 7 9", "3 2 1", None]
    assert recs[2]["line"] == 3 and "a record needs a string 'prompt'" in recs[2]["error"]


def _models_list(res, cwd):
    from ecache_cli.models.registry import ALIASES

    firsts = {line.split()[0] for line in res.stdout.splitlines() if line.strip()}
    assert {"tiny", *ALIASES} <= firsts, sorted(firsts)


def _models_show(res, cwd):
    assert "apple/DiffuCoder-7B-Instruct" in res.stdout and "7.6B" in res.stdout
    assert "profiles/diffucoder-7b/default.yaml (shipped with ecache)" in res.stdout


def _watch_without_terminal(res, cwd):
    assert res.stdout.strip() == "9 7 5 4 2 1"  # no terminal on stderr here: the normal output, and one line
    assert "warning: --watch needs a terminal (stderr is not one); decoding without the live view" in res.stderr


def _chat_piped(res, cwd):
    answers = res.stdout.splitlines()
    assert len(answers) == 2 and answers[0] == "1 3 7 9", res.stdout
    assert "τ 0.5 · cache entropy" in res.stderr, res.stderr


#: README command → check. The commands share one folder, and the ``generate --task list`` after
#: ``calibrate --task list`` runs after it (``CHAINS``), so it reads the profile that calibration wrote.
CHECKS = {
    'ecache generate "Sort: 9 3 7 1"': _prints("1 3 7 9"),
    'echo "Reverse: 4 5 6" | ecache generate --jsonl': _reverse_jsonl,
    'ecache generate --cache dual --threshold 0.9 "Sort descending: 2 8 5 1"': _prints("8 5 2 1"),
    'ecache profile --task list --limit 4': _profile_list,
    'ecache profile --policies none,entropy --json - "Sort: 9 3 7 1" | tail -1 | jq .policies.entropy.speedup_vs_none':
        _profile_speedup,
    'ecache calibrate --task list --limit 20 --gen-length 64 --plot runs_out/list.png': _calibrate_list,
    'ecache generate --task list "Sort: 9 3 7 1"': _prints("1 3 7 9"),
    'ecache calibrate --task code --metric fidelity --limit 10 --out runs_out/code-fidelity.yaml':
        _calibrate_code_fidelity,
    'ecache trace-drift --task arith --limit 4 --shots 0 --gen-length 128 --block-length 32 -b 4 '
    '--jsonl runs_out/steps.jsonl --tensorboard runs_out/drift --plot runs_out/trace-drift.png '
    '--json runs_out/summary.json': _trace_drift_picture,
    'ecache trace-drift "Sort: 9 3 7 1" --cache dual --plot runs_out/drift.png': _trace_drift_sort,
    """printf '{"id": 1, "prompt": "Sort: 9 3 7 1"}\\n{"id": 2, "prompt": "Reverse: 1 2 3"}\\n' > questions.jsonl""":
        _questions_written,
    "ecache generate --input questions.jsonl --output answers.jsonl": _answers_file,
    "ecache generate --input questions.jsonl --output answers.jsonl --resume": _answers_resumed,
    """echo '{"question": "no prompt field"}' >> questions.jsonl""": _bad_line_added,
    "ecache generate --input questions.jsonl --skip-invalid --jsonl": _skip_invalid,
    'ecache generate --print0 "Sort: 3 1 2" "Reverse: 4 5 6" | xargs -0 -n1 echo': _prints("1 2 3\n6 5 4"),
    "ecache models": _models_list,
    'ecache generate "Sort descending: 4 9 2 7 5 1" --gen-length 32 --block-length 8 --tau 0.001 --watch':
        _watch_without_terminal,
    """printf 'Sort: 9 3 7 1\\n/tau 0.5\\nReverse: 1 2 3\\n' | ecache chat --gen-length 32""": _chat_piped,
    "ecache models show diffucoder-7b": _models_show,
}

OFFICIAL = "needs an official 8B checkpoint (no download on these machines)"
#: README command (prefix) → why it is not run here.
NOT_RUN = {
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && ecache generate":
        "the install is .ci/run's and the fresh-venv check's; its generate line is the first check above",
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
    "pip install -e \".[test,eval,serve,quant]\"":
        "the test command itself (.ci/run runs it)",
    "ecache generate --model llada-8b": OFFICIAL,
    "ecache profile --task gsm8k --data ../shared/data/gsm8k/test.jsonl": "a dataset outside the repository",
    "ecache calibrate --model llada-8b": OFFICIAL,
    "ecache calibrate --task mbpp --data mbpp.jsonl": "the user's MBPP file (no download)",
    "ecache calibrate --task list --limit 50 --joint":
        "eight τ searches at gen length 256 (long on a CPU); tests/test_calibrate_joint.py runs --joint and "
        "--recent-k lists on a tiny checkpoint",
    "ecache calibrate --task arith,code,list --limit 50 --shots 0,4 --joint":
        "six domain groups × eight τ searches (hours on a CPU); tests/test_calibrate_joint.py runs --task a,b "
        "and checks the default profile it writes",
    "ecache trace-drift --task gsm8k --data ../shared/data/gsm8k/test.jsonl": "a dataset outside the repository",
    "tensorboard --logdir runs_out/drift": "a viewer; the event files are checked after the picture's command",
    "lm_eval --model ecache --model_args model=llada-8b": OFFICIAL,
    "lm_eval --model ecache --model_args model=tiny --tasks ecache_list,ecache_list_mc":
        "tests/test_lm_eval.py::test_lm_eval_command_line_runs_the_ecache_model runs it and checks the scores",
    "accelerate launch --num_processes 8": "8 GPUs",
    "torchrun --nproc_per_node 8": "8 GPUs",
    "torchrun --nproc_per_node 2 -m ecache_cli calibrate --task list --limit 8":
        "tests/test_distributed.py (slow, in .ci/run) runs it against one process",
    'pip install -e ".[serve]"': "the install is .ci/run's (it installs the serve extra)",
    'pip install -e ".[ray]"': "the install is .ci/run's (it installs the ray extra)",
    "ray start --head": "starts a Ray cluster that outlives the command; tests/test_ray.py starts a local instance",
    "ecache generate --input questions.jsonl --output answers.jsonl --ray":
        "needs the ray extra and starts Ray (~1 min on two cores); tests/test_ray.py (slow, in .ci/run) checks its "
        "records against plain generate --input and its --resume",
    "ecache serve": "a server runs until stopped; tests/test_serve.py starts it and drives it with the openai client",
    "curl ": "needs a running server; tests/test_serve.py sends these requests through the openai client and httpx",
    "ecache models pull llada-moe": "a 14 GB download; tests/test_models_cmd.py runs pull offline, cached and against "
                                    "a stand-in for the hub",
}


def test_every_readme_command_is_checked():
    cmds = readme_commands(README.read_text())
    unchecked = [c for c in cmds if c not in CHECKS and not any(c.startswith(p) for p in NOT_RUN)]
    assert not unchecked, f"README examples without a check: {unchecked}"
    assert not [c for c in CHECKS if c not in cmds], "a check of a command no longer in the README"


def test_readme_python_examples_print_what_the_readme_says(tmp_path):
    """Each ``python`` block of the README runs as a script in a fresh folder and prints exactly the
    ``text`` block that follows it."""
    text = README.read_text()
    pairs = re.findall(r"```python\n(.*?)```\s*\n[^`]*?```text\n(.*?)```", text, flags=re.S)
    assert pairs, "the README has no python example followed by its output"
    for code, shown in pairs:
        script = tmp_path / "example.py"
        script.write_text(code)
        res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout == shown, (res.stdout, shown)


#: Commands that read what an earlier one wrote run after it, in one chain; chains run side by side.
CHAINS = ("calibrate --task list", "generate --task list", "questions.jsonl")


@pytest.mark.slow  # about 20 commands, calibrations among them: .ci/run's slow step
def test_readme_examples_print_the_right_answers(tmp_path):
    order = [c for c in readme_commands(README.read_text()) if c in CHECKS]
    assert sorted(order) == sorted(CHECKS)  # each checked command once
    chained = [c for c in order if any(k in c for k in CHAINS)]
    groups = [chained] + [[c] for c in order if c not in chained]

    def run_group(cmds):
        out = []
        for cmd in cmds:
            line = cmd
            if "| jq " in cmd and shutil.which("jq") is None:
                line = cmd[:cmd.index("| jq ")].rstrip()  # no jq here: the check parses the JSON itself
            out.append((cmd, run(line, tmp_path)))
        return out

    with ThreadPoolExecutor(max_workers=2) as pool:  # two cores: the commands run one torch thread each
        results = [r for group in pool.map(run_group, groups) for r in group]
    for cmd, res in results:
        timed = cmd.startswith("ecache calibrate ")  # the speed check may reject on a loaded machine (exit 1)
        assert res.returncode in ((0, 1) if timed else (0,)), (cmd, res.stderr[-2000:])
        CHECKS[cmd](res, tmp_path)


def test_the_shipped_list_profile_answers_the_readme_prompt(tmp_path):
    """``ecache generate --task list`` where no calibration has run: the shipped profile's τ."""
    res = run('ecache generate --task list "Sort: 9 3 7 1"', tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "1 3 7 9"


def card_examples(text: str) -> list[tuple[str, str]]:
    """The model card's ``list`` examples written as `` `Op: xs` → `answer` ``."""
    return re.findall(r"`((?:[A-Z][a-z]+(?: [a-z]+)?(?: \d+)?): [\d ]+)` → `([\d ]+)`", text)


def test_model_card_examples_are_the_models_answers(tmp_path):
    """What the card says the model prints for a prompt is what ``ecache generate`` prints."""
    examples = card_examples(CARD.read_text())
    assert ("Sort: 9 3 7 1", "1 3 7 9") in examples
    res = run("ecache generate " + " ".join(shlex.quote(q) for q, _ in examples), tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [a for _, a in examples]


def test_the_readme_counts_the_tests_it_says(default_run_size):
    """README's "Tests" section names the size of the default run: within 5% of what pytest collects
    (this run's own count when it is the whole default run, else a separate collection)."""
    text = (REPO / "README.md").read_text()
    said = int(re.search(r"CPU: (\d+) tests in", text).group(1))
    run = default_run_size
    if run is None:
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                             cwd=REPO, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "ECACHE_GIT_CLEAN_CHECK": "0"}).stdout
        run = int(re.search(r"(\d+)(?:/\d+)? tests? collected", out).group(1))  # "A/B": A selected of B
    assert abs(run - said) <= 0.05 * run, f"README says {said} tests; the default run has {run}: update it"
