"""Tasks: registry, synthetic generators (determinism, disjoint splits, self-consistent scoring), prompt
formats, and the real-benchmark loaders and scorers on hand-made and real items."""

import gzip
import json
import re
from pathlib import Path

import pytest

from ecache_cli.errors import DataError, UsageError
from ecache_cli.tasks import TASKS, get_task
from ecache_cli.tasks.answers import (
    extract_final_number,
    last_boxed,
    math_equal,
    numbers_equal,
)
from ecache_cli.tasks.base import Example
from ecache_cli.tasks.codefn import FAMILIES

SHARED = Path(__file__).resolve().parents[1].parent / "shared/data"
GSM8K_FILE = SHARED / "gsm8k/test.jsonl"
HUMANEVAL_FILE = SHARED / "humaneval/HumanEval.jsonl.gz"
SYNTHETIC = ("arith", "code", "list")
N = 2000


@pytest.fixture(scope="module")
def generated():
    """2000 train and 2000 test examples per synthetic domain (seed 0)."""
    return {name: {split: get_task(name).examples(split, N, 0) for split in ("train", "test")}
            for name in SYNTHETIC}


# --- registry ---------------------------------------------------------------------------------------


def test_registry_and_unknown_name():
    assert set(TASKS) == {"arith", "code", "list", "gsm8k", "math500", "humaneval", "mbpp"}
    for name, cls in TASKS.items():
        task = get_task(name)
        assert isinstance(task, cls) and task.name == name and task.kind in ("math", "code", "list")
    with pytest.raises(UsageError, match="--task 'nope' is not a task.*arith.*gsm8k.*mbpp") as e:
        get_task("nope")
    assert e.value.exit_code == 2


def test_synthetic_tasks_take_no_data_and_only_known_splits():
    with pytest.raises(UsageError, match="synthetic"):
        get_task("arith", data="x.jsonl")
    with pytest.raises(UsageError, match="split 'validation' is not a split; use one of"):
        get_task("list").examples("validation", 3, 0)


# --- synthetic generators ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", SYNTHETIC)
def test_generators_are_deterministic(name, generated):
    task = get_task(name)
    again = task.examples("test", 50, 0)
    assert again == generated[name]["test"][:50]
    other = task.examples("test", 50, 1)
    assert [e.question for e in other] != [e.question for e in again]
    assert len({e.id for e in generated[name]["train"]}) == N


@pytest.mark.parametrize("name", SYNTHETIC)
def test_train_and_test_never_share_a_problem(name, generated):
    train, test = generated[name]["train"], generated[name]["test"]
    assert {e.meta["key"] for e in train}.isdisjoint(e.meta["key"] for e in test)
    assert {e.question for e in train}.isdisjoint(e.question for e in test)
    task = get_task(name)
    assert all(task.split_for(e.meta["key"]) == "train" for e in train)
    assert all(task.split_for(e.meta["key"]) == "test" for e in test)
    assert len({e.meta["key"] for e in test}) > 100  # the test split is not a handful of problems


@pytest.mark.parametrize("name", ["arith", "list"])
def test_references_score_one_and_corruptions_zero(name, generated):
    task = get_task(name)
    for ex in generated[name]["train"] + generated[name]["test"]:
        assert task.score(ex, task.target(ex)) == 1.0, ex
        assert task.score(ex, ex.answer + "\n\nSort: 1 2\n9 9") == 1.0  # a new few-shot block is ignored
        if name == "arith":
            wrong = re.sub(r"#### (\d+)$", lambda m: f"#### {int(m.group(1)) + 1}", ex.answer)
        else:
            wrong = ex.answer + " 0"
        assert task.score(ex, wrong) == 0.0, ex


def test_arith_answers_are_gsm8k_style(generated):
    templates = set()
    for ex in generated["arith"]["test"]:
        lines = ex.answer.split("\n")
        assert 2 <= len(lines) - 1 <= 3 and lines[-1] == f"#### {ex.meta['result']}"
        for line in lines[:-1]:  # each step states its calculation and its result
            a, op, b, res = re.search(r"(\d+) ([-+*/]) (\d+) = \$?(\d+)", line).groups()
            assert eval(f"{a} {op} {b}") == int(res), line
        templates.add(ex.meta["template"])
    assert len(templates) >= 8


def test_list_prompt_forms(generated):
    task = get_task("list")
    ex = Example("hand", "Sort: 9 3 7 1", "1 3 7 9", {"key": "list:Sort:9,3,7,1"})
    assert task.prompt(ex) == "Sort: 9 3 7 1"
    assert task.score(ex, " 1  3 7\n9 ") == 1.0 and task.score(ex, "1 3 9 7") == 0.0
    assert any(re.fullmatch(r"Sort: \d( \d)+", e.question) for e in generated["list"]["test"])
    ops = {e.meta["op"] for e in generated["list"]["test"]}
    assert {"Sort", "Reverse", "Unique", "Even", "Greater than", "First"} <= ops


def test_code_reference_solutions_pass_their_tests(generated):
    # our own reference code is trusted: check all of it in-process, then a sample through the sandbox
    for ex in generated["code"]["train"] + generated["code"]["test"]:
        env: dict = {}
        exec(ex.answer + "\n" + "\n".join(ex.meta["tests"]), env)
        assert "\n\n" not in ex.answer and len(ex.meta["tests"]) == 3
    assert {e.meta["family"] for e in generated["code"]["test"]} == set(FAMILIES)
    task = get_task("code", allow_code_execution=True)
    one_per_family = {e.meta["family"]: e for e in generated["code"]["test"]}
    for ex in one_per_family.values():
        assert task.score(ex, task.target(ex)) == 1.0, ex
    for ex in list(one_per_family.values())[:4]:
        entry = ex.meta["entry_point"]
        assert task.score(ex, f"def {entry}(x):\n    return None") == 0.0
        assert task.score(ex, f"```python\n{ex.answer}\n```") == 1.0


def test_code_scoring_needs_consent(generated):
    ex = generated["code"]["test"][0]
    with pytest.raises(UsageError, match="--allow-code-execution"):
        get_task("code").score(ex, ex.answer)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_few_shot_prompts(name, generated):
    task = get_task(name)
    ex = generated[name]["test"][0]
    prompt = task.prompt(ex, shots=8, seed=3)
    blocks = prompt.split("\n\n")
    assert len(blocks) == 9 and blocks[-1] == ex.question
    shots = task.shot_examples(ex, 8, 3)
    assert len({s.meta["key"] for s in shots}) == 8
    assert all(task.split_for(s.meta["key"]) == "train" for s in shots)
    assert blocks[0] == f"{shots[0].question}\n{shots[0].answer}"
    assert task.prompt(ex, shots=8, seed=3) == prompt and task.prompt(ex, shots=8, seed=4) != prompt
    train_ex = generated[name]["train"][0]
    assert train_ex.meta["key"] not in {s.meta["key"] for s in task.shot_examples(train_ex, 8, 0)}


# --- answers ----------------------------------------------------------------------------------------


def test_gsm8k_number_extraction():
    assert extract_final_number("so 1000 + 234 = 1,234 pens.\n#### 1,234") == "1,234"
    assert numbers_equal(extract_final_number("#### 1,234"), "1234")
    assert numbers_equal(extract_final_number("She makes 9 * 2 = $18 a day."), "18")
    assert numbers_equal(extract_final_number("#### $18.00\nThen 5 more"), "18")
    assert numbers_equal(extract_final_number("It is -3."), "-3")
    assert not numbers_equal(extract_final_number("#### 17"), "18")
    assert extract_final_number("no number here") is None


def test_math_answers():
    assert last_boxed(r"so \boxed{1} and finally \boxed{\frac{1}{\sqrt{2}}}.") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed(r"\boxed 5") == "5" and last_boxed(r"\boxed{1") is None and last_boxed("7") is None
    assert math_equal(r"\frac{1}{2}", "0.5") and math_equal(".5", r"\dfrac12")
    assert math_equal(r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})")
    assert math_equal(r"10^\circ", "10") and math_equal(r"5\text{ cm}", "5") and math_equal("x = 4", "4")
    assert math_equal(r"\$1,000", "1000") and math_equal(r"\text{(C)}", "(C)")
    assert not math_equal(r"\frac{1}{3}", "0.5") and not math_equal(None, "1")


def test_math500_task(tmp_path):
    path = tmp_path / "test.jsonl"
    rows = [{"problem": "What is 1/2 as a decimal?", "answer": "0.5", "unique_id": "a"},
            {"problem": "Compute $2+2$.", "answer": "4", "solution": "Clearly $\\boxed{4}$."}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = get_task("math500", data=str(path))
    a, b = task.examples("test", None, 0)
    assert task.prompt(a).startswith("What is 1/2") and r"\boxed{}" in task.prompt(a)
    assert task.score(a, r"So it is \boxed{\frac{1}{2}}.") == 1.0
    assert task.score(a, r"\boxed{\frac{1}{3}}") == 0.0 and task.score(a, "0.5") == 0.0
    assert task.score(b, task.target(b)) == 1.0
    assert "Clearly" in task.prompt(a, shots=1)


# --- file-backed benchmarks -------------------------------------------------------------------------


@pytest.mark.parametrize("name,filename", [("gsm8k", "test.jsonl"), ("math500", "test.jsonl"),
                                           ("humaneval", "HumanEval.jsonl.gz"), ("mbpp", "mbpp.jsonl")])
def test_missing_dataset_names_the_path(name, filename, tmp_path):
    task = get_task(name, data=str(tmp_path))
    with pytest.raises(DataError) as e:
        task.examples("test", 5, 0)
    assert str(e.value) == (f"--data {tmp_path}: the folder has no {filename}; give the official {name} "
                            f"{filename} (or the folder holding it)")
    assert e.value.exit_code == 1


def test_malformed_dataset_lines_are_all_named_with_the_fix(tmp_path, cli):
    """As ``--input``: every bad line in one usage error (exit 2) with what a line must be, a line that
    is not UTF-8 too (the reader ``--input`` uses, ``sources.py``)."""
    bad = tmp_path / "test.jsonl"
    bad.write_text('{"question": "q", "answer": "1"}\nnot json\n[1]\n{"question": "q"}\n')
    with pytest.raises(UsageError) as e:
        get_task("gsm8k", data=str(bad)).examples("test", 1, 0)
    msg = str(e.value)
    assert msg == (f"--data {bad}: 3 of 4 line(s) invalid, nothing decoded: {bad}:2: not valid JSON (Expecting "
                   f"value); each line must be one JSON object; {bad}:3: a JSON array, not an object; {bad}:4: lacks "
                   "answer; each line must be one UTF-8 JSON object with the fields question, answer (the official "
                   "gsm8k format)")
    r = cli("profile", "--task", "gsm8k", "--data", str(bad), "--limit", "1", "--policies", "none")
    assert r.exit_code == 2 and f"{bad}:2: not valid JSON" in r.stderr and "using model" not in r.stderr
    bad.write_bytes(b'{"question": "q", "answer": "1"}\n' * 2 + b'{"question": "\xff"}\nnot json\n')
    with pytest.raises(UsageError, match=r"test.jsonl:3: not UTF-8 text \(byte 0xff at character 15\); save the file "
                                         "as UTF-8 JSONL; .*test.jsonl:4: not valid JSON"):
        get_task("gsm8k", data=str(bad)).examples("test", 1, 0)


@pytest.mark.skipif(not GSM8K_FILE.is_file(),
                    reason="needs ../shared/data/gsm8k (in CI and development; not in a plain clone)")
def test_gsm8k_real_file():
    task = get_task("gsm8k", data=str(GSM8K_FILE))
    items = task.examples("test", None, 0)
    assert len(items) == 1319
    sub = task.examples("test", 50, 7)
    assert len(sub) == 50 and sub == task.examples("test", 50, 7)
    for ex in sub:
        assert "<<" not in ex.answer and task.score(ex, task.target(ex)) == 1.0
    ex = items[0]
    assert task.prompt(ex) == f"Question: {ex.question}\nAnswer:"
    prompt = task.prompt(ex, shots=8, seed=0)
    assert prompt.count("Question: ") == 9 and prompt.endswith(f"Question: {ex.question}\nAnswer:")
    assert task.score(ex, " She sells 9 eggs.\n#### 18\n\nQuestion: next one? 99") == 1.0
    assert task.score(ex, "She makes $18 every day.") == 1.0 and task.score(ex, "#### 19") == 0.0
    with pytest.raises(UsageError, match="only a 'test' split"):
        task.examples("train", 5, 0)


@pytest.mark.skipif(not HUMANEVAL_FILE.is_file(),
                    reason="needs ../shared/data/humaneval (in CI and development; not in a plain clone)")
def test_humaneval_real_items():
    task = get_task("humaneval", data=str(HUMANEVAL_FILE), allow_code_execution=True)
    items = task.examples("test", None, 0)
    assert len(items) == 164
    for ex in items[:2]:
        assert task.prompt(ex) == ex.question and ex.question.rstrip().endswith('"""')
        assert task.score(ex, ex.answer) == 1.0
        assert task.score(ex, ex.answer + "\n\ndef unrelated():\n    pass\n") == 1.0  # cut at "\ndef"
        assert task.score(ex, "    return None\n") == 0.0
        full = ex.question + ex.answer  # a completion that repeats the whole function
        assert task.score(ex, f"```python\n{full}\n```") == 1.0
    with pytest.raises(UsageError, match="--allow-code-execution"):
        get_task("humaneval", data=str(HUMANEVAL_FILE)).score(items[0], items[0].answer)


def _mbpp_rows():
    rows = []
    for tid in (2, 3, 4, 11, 12):
        rows.append({"task_id": tid, "text": f"Write a function to add {tid} to a number.",
                     "code": f"def add_{tid}(n):\r\n    return n + {tid}",
                     "test_list": [f"assert add_{tid}(1) == {1 + tid}", f"assert add_{tid}(0) == {tid}"],
                     "test_setup_code": "", "challenge_test_list": []})
    rows[-1]["test_setup_code"] = "OFFSET = 0"
    rows[-1]["test_list"].append("assert OFFSET == 0")
    return rows


def test_mbpp_format_and_scoring(tmp_path):
    path = tmp_path / "mbpp.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in _mbpp_rows())
    task = get_task("mbpp", data=str(path), allow_code_execution=True)
    tests = task.examples("test", None, 0)
    assert [e.meta["task_id"] for e in tests] == [11, 12]  # full dump: ids 11-510 are the test split
    ex = tests[0]
    prompt = task.prompt(ex, shots=3)
    head = "You are an expert Python programmer, and here is your task: Write a function to add 2 to a number."
    assert prompt.startswith(head + " Your code should pass these tests:\n\nassert add_2(1) == 3\n")
    assert prompt.count("[DONE]") == 3 and prompt.endswith("assert add_11(0) == 11\n[BEGIN]\n")
    assert "return n + 4\n[DONE]\nYou are" in prompt
    assert task.score(ex, task.target(ex)) == 1.0
    assert task.score(ex, "def add_11(n):\n    return n + 11\n[DONE]\nYou are an expert...") == 1.0
    assert task.score(ex, "def add_11(n):\n    return n\n[DONE]") == 0.0
    assert task.score(tests[1], "def add_12(n):\n    return n + 12") == 1.0  # needs its setup code
    with pytest.raises(UsageError, match="--allow-code-execution"):
        get_task("mbpp", data=str(path)).score(ex, ex.answer)
