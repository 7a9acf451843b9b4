"""Build the embedded tiny model's tokenizer: a small BPE trained on the synthetic train splits.

Run from the repository root::

    python -m scripts.build_tokenizer --out ecache_cli/data/tiny

Design (each choice is about exact round trips and a model of a few million parameters):
- BPE without byte-level remapping: tokens are plain text, so code, newlines and 4-space indentation
  decode exactly (decoder: ByteFallback then Fuse = concatenate). Characters outside printable ASCII
  fall back to the 256 byte tokens ``<0x00>``..``<0xFF>`` (ids 6-261, Llama-style), so any text
  round-trips.
- Pre-tokenization: a GPT-2-like split (words with one leading space, punctuation runs, whitespace runs
  keep their last space for the next word) then ``Digits(individual_digits=True)``: every number is
  spelled digit by digit with the same ten tokens wherever it appears.
- Special tokens at fixed ids, LLaDA's strings: ``<|startoftext|>`` 0, ``<|endoftext|>`` 1,
  ``<|mdm_mask|>`` 2, ``<|start_header_id|>`` 3, ``<|end_header_id|>`` 4, ``<|eot_id|>`` 5; the chat
  template is LLaDA's (always ends with the assistant header).
- Corpus: train-split questions and answers of arith, code and list, plus few-shot prompts; seeded, so
  the same arguments write byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import statistics
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from ecache_cli.tasks import get_task

SPECIAL_TOKENS = ["<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]  # ids 0..5, in this order
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
DOMAINS = ("arith", "code", "list")
SPLIT_PATTERN = r" ?[\p{L}_]+| ?\p{N}+| ?[^\s\p{L}\p{N}_]+|\s+(?!\S)|\s+"
# LLaDA-8B-Instruct's template: header per message, content trimmed, bos before the first message, and
# the assistant header always appended (LLaDA has no add_generation_prompt switch).
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
)
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<|startoftext|>",
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "add_bos_token": False,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 4096,
    "additional_special_tokens": SPECIAL_TOKENS[2:],  # transformers 5 reads it as extra_special_tokens
    "chat_template": CHAT_TEMPLATE,
}
SPECIAL_TOKENS_MAP = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
                      "pad_token": "<|endoftext|>", "additional_special_tokens": SPECIAL_TOKENS[2:]}


def corpus(n_per_domain: int, seed: int, shots: int = 8) -> list[str]:
    """Return training texts: ``question\\nanswer`` of ``n_per_domain`` train examples per domain, plus
    one ``shots``-shot prompt with its answer for every 20 examples."""
    texts = []
    for name in DOMAINS:
        task = get_task(name)
        exs = task.examples("train", n_per_domain, seed)
        texts += [f"{ex.question}\n{ex.answer}" for ex in exs]
        texts += [task.prompt(ex, shots=shots, seed=i) + "\n" + ex.answer for i, ex in enumerate(exs[::20])]
    return texts


def train(texts: list[str], vocab_size: int) -> Tokenizer:
    """Return a BPE tokenizer trained on ``texts`` with the special and byte tokens at fixed ids."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
    ])
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(BYTE_TOKENS), min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=list(string.printable), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return _insert_byte_tokens(tok)


def _insert_byte_tokens(tok: Tokenizer) -> Tokenizer:
    # The trainer cannot seed byte-fallback tokens, so they are spliced into the vocab after the special
    # tokens; merges are stored as strings, so renumbering the vocab keeps them valid.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    ordered = sorted(vocab, key=vocab.get)
    assert ordered[: len(SPECIAL_TOKENS)] == SPECIAL_TOKENS, ordered[:8]
    rest = [t for t in ordered[len(SPECIAL_TOKENS):] if t not in BYTE_TOKENS]
    new_order = SPECIAL_TOKENS + BYTE_TOKENS + rest
    spec["model"]["vocab"] = {t: i for i, t in enumerate(new_order)}
    for added in spec["added_tokens"]:
        added["id"] = new_order.index(added["content"])
    return Tokenizer.from_str(json.dumps(spec))


def write(tok: Tokenizer, out: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    config = dict(TOKENIZER_CONFIG)
    config["added_tokens_decoder"] = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(SPECIAL_TOKENS_MAP, indent=2) + "\n")


def verify(out: Path, texts: list[str]) -> dict:
    """Load ``out`` with ``transformers.AutoTokenizer`` and check ids, round trips and the chat template.

    Returns a summary dict (vocab size, texts checked); raises ``AssertionError`` on the first failure.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(t) == i, (t, tok.convert_tokens_to_ids(t))
    assert sorted(tok.all_special_ids) == list(range(len(SPECIAL_TOKENS))), tok.all_special_ids
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, text
    chat = tok.apply_chat_template([{"role": "user", "content": "Sort: 9 3 7 1"}], tokenize=False)
    expected = ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nSort: 9 3 7 1<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert chat == expected, chat
    ids = tok.encode(chat, add_special_tokens=False)
    assert ids[:2] == [0, 3] and ids.count(5) == 1 and ids.count(4) == 2, ids
    return {"vocab_size": len(tok), "texts_checked": len(texts)}


def length_report(tok_dir: Path, n: int = 200, seed: int = 0) -> dict:
    """Return token counts (min/median/max) of 0- and 8-shot prompts and of targets, per domain (test split)."""
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    report = {}
    for name in DOMAINS:
        task = get_task(name)
        exs = task.examples("test", n, seed)
        for label, texts in (("prompt_0shot", [task.prompt(ex) for ex in exs]),
                             ("prompt_8shot", [task.prompt(ex, shots=8, seed=i) for i, ex in enumerate(exs)]),
                             ("target", [task.target(ex) for ex in exs])):
            lens = [len(e.ids) for e in tok.encode_batch(texts)]
            report[f"{name}/{label}"] = (min(lens), statistics.median(lens), max(lens))
    return report


def main(argv: list[str] | None = None) -> None:
    """Build, write and verify the tokenizer; print the vocab size and prompt/answer token lengths."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("ecache_cli/data/tiny"), help="output folder")
    p.add_argument("--vocab-size", type=int, default=3072, help="upper bound, byte tokens included")
    p.add_argument("--examples", type=int, default=6000, help="train examples per domain")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-report", action="store_true", help="skip the token-length report")
    args = p.parse_args(argv)
    texts = corpus(args.examples, args.seed)
    tok = train(texts, args.vocab_size)
    write(tok, args.out)
    check = corpus(300, args.seed + 1) + [
        "def f(x):\n    if x:\n        return 'é ü 漢字'\n\treturn None\n", "  two  spaces \n\n\nend  "]
    summary = verify(args.out, check)
    print(f"wrote {args.out}: vocab {summary['vocab_size']} tokens, {summary['texts_checked']} round trips ok")
    if not args.no_report:
        for key, (lo, med, hi) in length_report(args.out).items():
            print(f"  {key:22s} min {lo:4d}  median {med:6.1f}  max {hi:4d}")


if __name__ == "__main__":
    main()
