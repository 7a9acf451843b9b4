"""The embedded tiny tokenizer (ecache_cli/data/tiny) and its builder, scripts/build_tokenizer.py."""

import importlib.util
from pathlib import Path

import pytest

import ecache_cli
from ecache_cli.tasks import get_task

TINY = Path(ecache_cli.__file__).resolve().parent / "data" / "tiny"
# load the script by path: it is not part of the installed package, and bare `pytest` has no repo root
# on sys.path
_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_tokenizer.py"
_spec = importlib.util.spec_from_file_location("build_tokenizer", _SCRIPT)
build_tokenizer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_tokenizer)
SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY))


def test_files_and_special_ids(tok):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (TINY / name).is_file()
    assert [tok.convert_tokens_to_ids(t) for t in SPECIALS] == [0, 1, 2, 3, 4, 5]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|startoftext|>", "<|endoftext|>", "<|endoftext|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 1)
    assert sorted(tok.all_special_ids) == [0, 1, 2, 3, 4, 5]
    assert 1000 <= len(tok) <= 4096
    assert tok("Sort: 9 3 7 1").input_ids[0] != 0  # no bos/eos added


def test_chat_template(tok):
    chat = tok.apply_chat_template([{"role": "user", "content": " Sort: 9 3 7 1\n"}], tokenize=False)
    assert chat == ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nSort: 9 3 7 1<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.encode(chat, add_special_tokens=False)
    assert ids[:2] == [0, 3] and ids.count(3) == 2 and ids.count(4) == 2
    assert ids.count(5) == 1 and tok.decode(ids) == chat
    two = tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                                  tokenize=False)
    assert two.count("<|startoftext|>") == 1 and two.startswith("<|startoftext|><|start_header_id|>system")
    assert two.endswith("u<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_round_trips_exactly(tok):
    texts = ["def f(x):\n    if x:\n        return [x, 'a b']\n\treturn None\n", "  lead\n\n\n  trail  ",
             "Janet\u2019s ducks lay 16 eggs \u2014 caf\u00e9 \u6f22\u5b57 \U0001f600", "<|mdm_mask|>x<|eot_id|>"]
    for name in ("arith", "code", "list"):
        task = get_task(name)
        exs = task.examples("test", 150, 5)
        texts += [f"{ex.question}\n{ex.answer}" for ex in exs]
        texts += [task.prompt(ex, shots=8, seed=i) for i, ex in enumerate(exs[:5])]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, text


def test_digits_are_single_tokens(tok):
    pieces = tok.convert_ids_to_tokens(tok.encode("assert f([12, 345]) == 3 * 12 = 36", add_special_tokens=False))
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("12345312" "36")


def test_builder_is_deterministic(tmp_path):
    texts = build_tokenizer.corpus(150, seed=0)
    for out in (tmp_path / "a", tmp_path / "b"):
        build_tokenizer.write(build_tokenizer.train(texts, 1024), out)
    a, b = (tmp_path / "a" / "tokenizer.json").read_bytes(), (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert a == b
    summary = build_tokenizer.verify(tmp_path / "a", texts[:100])
    assert summary["vocab_size"] <= 1024


def test_answers_fit_the_generation_canvas(tok):
    # the tiny model generates into a 256-token canvas; answers must stay short and regular
    limits = {"arith": 100, "code": 80, "list": 40}
    for name, limit in limits.items():
        task = get_task(name)
        answers = [task.target(ex) for ex in task.examples("test", 500, 11)]
        longest = max(len(ids) for ids in tok(answers, add_special_tokens=False).input_ids)
        assert longest < limit, (name, longest)
