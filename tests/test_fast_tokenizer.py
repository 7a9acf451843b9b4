"""``FastTokenizer`` (tokenizers without transformers, for a fast cold start) gives what transformers'
tokenizer gives: ids, texts, vocabulary and chat templates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import ecache_cli
from ecache_cli.models.fast_tokenizer import FastTokenizer, usable
from ecache_cli.models.loader import load_tokenizer

TINY = Path(ecache_cli.__file__).resolve().parent / "data" / "tiny"
TEXTS = ["Sort: 9 3 7 1", "", "  leading and trailing  ", "def f(x):\n    return x * 2\n", "ünïcödé → ✓",
         "<|startoftext|>special<|eot_id|> tokens inline<|mdm_mask|>", "Reverse: 4 5 6\n\n\nQ: 12+30=?"]
CHATS = [[{"role": "user", "content": "Sort: 9 3 7 1"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": " hi "},
          {"role": "assistant", "content": "hello"}, {"role": "user", "content": "Reverse: 1 2"}]]


def dirs(llada_dir, dream_dir):
    return [TINY, llada_dir, dream_dir]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["embedded", "llada-rand", "dream-rand"])
def test_same_ids_texts_and_templates_as_transformers(which, llada_dir, dream_dir):
    path = dirs(llada_dir, dream_dir)[which]
    assert usable(path)
    fast, ref = FastTokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert len(fast) == len(ref) and fast.get_vocab() == ref.get_vocab()
    for text in TEXTS:
        for special in (False, True):
            ids = fast(text, add_special_tokens=special)["input_ids"]
            assert ids == ref(text, add_special_tokens=special)["input_ids"], (text, special)
            assert fast.encode(text, add_special_tokens=special) == ids
        ids = ref(text, add_special_tokens=False)["input_ids"]
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (text, skip)
    assert fast.chat_template == ref.chat_template and fast.chat_template
    for chat in CHATS:
        for gen in (False, True):
            want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == want
            assert (fast.apply_chat_template(chat, add_generation_prompt=gen)
                    == ref(want, add_special_tokens=False)["input_ids"])
    specials = ["<|endoftext|>", "<|eot_id|>", "<|mdm_mask|>", "<|mask|>", "<|im_end|>"]
    for t in specials:
        if t in ref.get_vocab():
            assert fast.convert_tokens_to_ids(t) == ref.convert_tokens_to_ids(t)
    # anything else goes to the transformers tokenizer itself
    assert fast.eos_token_id == ref.eos_token_id and sorted(fast.all_special_ids) == sorted(ref.all_special_ids)


def test_pickles_after_rendering_a_template():
    import copy
    import pickle

    fast = FastTokenizer(TINY)
    want = fast.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    for other in (pickle.loads(pickle.dumps(fast)), copy.deepcopy(fast)):
        assert other.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True) == want
        assert other("Sort: 9 3 7 1", add_special_tokens=False)["input_ids"] == fast.encode("Sort: 9 3 7 1", False)


def test_the_loader_uses_it_for_the_embedded_model_and_cleans_up_otherwise(tmp_path):
    assert isinstance(load_tokenizer(TINY), FastTokenizer)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((TINY / name).read_bytes())
    cfg = (TINY / "tokenizer_config.json").read_text().replace('"clean_up_tokenization_spaces": false',
                                                                  '"clean_up_tokenization_spaces": true')
    (tmp_path / "tokenizer_config.json").write_text(cfg)
    assert not usable(tmp_path)  # a transformers-side decode rule: the transformers tokenizer serves it
    assert not isinstance(load_tokenizer(tmp_path), FastTokenizer)


def test_generate_does_not_import_transformers(tmp_path):
    """The cold path of `ecache generate` on the embedded model never imports transformers."""
    code = ("import sys; from ecache_cli.cli import app\n"
            "try:\n    app(['generate', 'Sort: 9 3 7 1', '--gen-length', '8', '--block-length', '8', '-q'])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout
