"""``generate --watch`` and ``ecache chat`` driven through a pseudo-terminal of 80 × 24 (``pty_session.py``).

The live view must fill to the answer ``generate`` prints for the same prompt and settings, mark
refresh steps exactly where the policy refreshed (``trace-drift --jsonl``'s records of the same run),
and fit 80 columns; chat commands must change the settings they name (the records ``/save`` writes say
which settings each answer used), Ctrl-C must stop an answer and keep the session, and ``/save`` must
write records that ``generate --input`` decodes to the same answers.
"""

from __future__ import annotations

import json
import re

import pytest
from cli_helpers import one_line_error, records
from pty_session import REPO, PtySession
from rich.cells import cell_len

from ecache_cli.runs.final_text import FinalText, cut_answer, final_lengths, streamable
from ecache_cli.runs.watch import EMPTY, END, MASK, signal_bar, status_line, visible

PROMPT = "Sort: 9 3 7 1"
#: A 32-position canvas in blocks of 8 and a τ at which the embedded model's run both refreshes and
#: computes partially (the default profile's τ refreshes only at the first step here).
RUN = ["--gen-length", "32", "--block-length", "8", "--tau", "0.001"]
STEP = re.compile(r"^step\s+(\d+)(?:/\d+)? · blk (\d+)/\d+ · (REFRESH|partial) ")


def frames(text: str) -> list[list[str]]:
    """The frames of the live view in the terminal's text: each frame's lines, header first."""
    parts = text.split("ecache watch · ")[1:]
    return [("ecache watch · " + p).split("\n") for p in parts]


def canvas(frame: list[str]) -> str:
    """A frame's canvas: the lines between its header (one row or more, its last field the block) and its
    rule, joined."""
    start = next(i for i, line in enumerate(frame) if re.search(r"block \d+/\d+\s*$", line)) + 1
    end = next(i for i, line in enumerate(frame) if set(line) == {"─"})
    return "".join(frame[start:end])


def view(frame: list[str]) -> list[str]:
    """A frame's lines up to its last status line (what follows the last frame is the command's output)."""
    last = max(i for i, line in enumerate(frame) if STEP.match(line))
    return frame[:last + 1]


def steps_seen(all_frames: list[list[str]]) -> dict[int, bool]:
    """Step (1-based) → whether its status line says REFRESH, from the last status line of each frame."""
    out = {}
    for f in all_frames:
        status = [m for line in f if (m := STEP.match(line))]
        if status:
            out[int(status[-1].group(1))] = status[-1].group(3) == "REFRESH"
    return out


def watch(tmp_path, *args, rows: int = 24) -> tuple[PtySession, int]:
    s = PtySession(["generate", *args], env={"ECACHE_TEST_CWD": str(tmp_path)}, rows=rows)
    return s, s.wait(120)


@pytest.mark.parametrize("family", ["tiny", "dream"])
def test_watch_fills_to_generate_answer_and_marks_refreshes(family, cli, tmp_path, request):
    model = "tiny" if family == "tiny" else str(request.getfixturevalue("dream_dir"))
    flags = ["--model", model, *RUN] + ([] if family == "tiny" else ["--no-chat"])
    res = cli("generate", PROMPT, *flags, "--jsonl", "-q")
    assert res.exit_code == 0, res.stderr
    answer = records(res)[0]["text"]
    trace = cli("trace-drift", PROMPT, *flags, "--jsonl", "-", "-q")
    assert trace.exit_code == 0, trace.stderr
    refreshed = {r["step"] + 1: r["refresh"] for r in records(trace)}

    s, code = watch(tmp_path, PROMPT, *flags, "--watch")
    assert code == 0, s.text
    got = frames(s.text)
    assert len(got) >= len(refreshed)  # one frame per step (and the last one again when the view closes)
    assert steps_seen(got) == refreshed  # refresh marked exactly where the policy refreshed
    assert any(refreshed.values()) and not all(refreshed.values())
    final = canvas(got[-1]).replace(EMPTY, "")  # tokens without text of their own (none in these answers)
    assert final.startswith(visible(answer)), (final, answer)
    assert set(final[len(visible(answer)):]) <= {END, MASK}  # after the answer: its end and the unused masks
    assert MASK in canvas(got[0])  # the first frame still has masks
    for f in got:  # everything fits 80 columns
        assert all(cell_len(line) <= 80 for line in view(f)), f
    after = got[-1][len(view(got[-1])):]  # after the view: the stats line and the normal answer (stdout)
    assert after[0].startswith("NFE ") and answer in after


def test_watch_long_canvas_shows_the_current_block(tmp_path):
    """A canvas taller than the terminal shows the lines around the current block (with a ⋮ line)."""
    s, code = watch(tmp_path, PROMPT, "--gen-length", "512", "--block-length", "256", "--steps", "4",
                    "--ban-eos", "--watch", rows=12)
    assert code == 0, s.text[-2000:]
    got = frames(s.text)
    assert [line for f in got for line in f if line.startswith("⋮ ")]
    for f in got:
        assert len(view(f)) <= 12 and all(cell_len(line) <= 80 for line in view(f)), f


def test_watch_needs_a_terminal(cli):
    plain = cli("generate", PROMPT, *RUN)
    res = cli("generate", PROMPT, *RUN, "--watch")
    assert res.exit_code == 0 and res.stdout == plain.stdout
    lines = [line for line in res.stderr.splitlines() if "--watch" in line]
    assert lines == ["warning: --watch needs a terminal (stderr is not one); decoding without the live view"]
    one_line_error(cli("generate", PROMPT, "--watch", "-q"), 2, "--watch", "-q")
    one_line_error(cli("generate", PROMPT, "--watch", "--stream"), 2, "--watch", "--stream")
    one_line_error(cli("generate", PROMPT, "--watch-delay", "-1"), 2, "--watch-delay -1")
    one_line_error(cli("chat", "--watch-delay", "nan"), 2, "--watch-delay nan")


def chat_session(tmp_path, *args) -> PtySession:
    s = PtySession(["chat", "--gen-length", "32", "--block-length", "8", *args],
                   env={"ECACHE_TEST_CWD": str(tmp_path)})
    s.expect(r"you> ")
    return s


def say(s: PtySession, line: str, until: str = r"you> ") -> str:
    """Type ``line`` and Enter; return what the terminal showed until ``until``."""
    start = s.pos
    s.send(line + "\r")
    s.expect(until)
    return s.text[start:s.pos]


def test_chat_commands_change_settings_and_save_records(cli, tmp_path):
    expected = records(cli("generate", PROMPT, "--gen-length", "32", "--block-length", "8", "--jsonl", "-q"))[0]
    s = chat_session(tmp_path)
    shown = say(s, PROMPT)
    assert expected["text"] in shown.split("\n")  # the same answer as generate, on a line of its own
    assert "τ 0.25 · cache entropy" in say(s, "/tau 0.25")
    say(s, "Reverse: 1 2 3")
    assert "error: /cache 'entropy:kr=3'" in say(s, "/cache entropy:kr=3")  # validated as --policies; continues
    assert "error: /tau: cache dual" not in say(s, "/cache entropy:recent_k=4")
    say(s, "/gen-length 16")
    say(s, "/threshold 0.9")
    say(s, "abc")
    assert "cache dual" in say(s, "/cache dual")
    assert "warning: /tau is not used by /cache dual" in say(s, "/tau 2")  # as --tau under dual: ignored
    assert "error: /gen-length" in say(s, "/gen-length 12")  # not a multiple of the block: nothing changes
    say(s, "x=2")
    stats = say(s, "/stats")
    assert re.search(r"NFE \d+ · refresh \d+ \(\d+%\) · \d+ tokens · [\d.]+ tok/s · work \d+% of no cache", stats)
    assert "saved 4 record(s)" in say(s, "/save chat.jsonl")
    s.send("\x04")  # Ctrl-D
    assert s.wait() == 0

    recs = [json.loads(line) for line in (tmp_path / "chat.jsonl").read_text().splitlines()]
    assert [r["index"] for r in recs] == [0, 1, 2, 3]
    assert recs[0]["text"] == expected["text"] and recs[0]["settings"] == expected["settings"]
    assert recs[1]["settings"]["cache_params"]["tau"] == 0.25
    assert len(recs[1]["messages"]) == 3  # the conversation so far: user, assistant, user
    assert recs[2]["settings"]["cache_params"]["recent_k"] == 4
    assert recs[2]["settings"]["decode"]["gen_length"] == 16 and recs[2]["settings"]["decode"]["threshold"] == 0.9
    assert recs[3]["settings"]["cache"] == "dual" and recs[3]["settings"]["decode"]["gen_length"] == 16
    # valid records: generate --input decodes their conversations to the same answers
    again = cli("generate", "--input", tmp_path / "chat.jsonl", "--gen-length", "32", "--block-length", "8",
                "--tau", "0.25", "--jsonl", "-q")
    assert again.exit_code == 0, again.stderr
    assert records(again)[1]["text"] == recs[1]["text"]


def test_chat_ctrl_c_stops_the_answer_and_keeps_the_session(tmp_path):
    s = chat_session(tmp_path, "--watch", "--watch-delay", "0.3", "--ban-eos")
    s.send(PROMPT + "\r")
    s.expect(r"ecache watch · ")  # the first frame: the answer is decoding
    s.send("\x03")  # Ctrl-C
    s.expect(r"answer stopped; not kept")
    s.expect(r"you> ")
    assert "no answer yet" in say(s, "/stats")  # the stopped turn is not kept
    assert "watch off" in say(s, "/watch off")
    shown = say(s, "abc")
    assert "ecache watch" not in shown
    assert "NFE" in say(s, "/stats")
    s.send("/exit\r")
    assert s.wait() == 0


@pytest.mark.parametrize("which", ["llada_dir", "llada-moe"])
def test_chat_on_an_official_format_checkpoint(which, tmp_path, cli, request):
    """A random LLaDA checkpoint in the official layout, and the LLaDA-MoE fixture saved by the official code."""
    model = str(REPO / "tests" / "fixtures" / "llada-moe") if which == "llada-moe" else request.getfixturevalue(which)
    expected = records(cli("generate", "hi", "--model", model, "--gen-length", "16", "--block-length", "8",
                           "--chat", "--jsonl", "-q"))[0]["text"]
    s = PtySession(["chat", "--model", model, "--gen-length", "16", "--block-length", "8"],
                   env={"ECACHE_TEST_CWD": str(tmp_path)})
    s.expect("you> ")
    shown = say(s, "hi")
    assert expected.strip() and expected in shown.split("\n"), (expected, shown)
    s.send("\x04")
    assert s.wait() == 0


def test_final_text_follows_the_prefix_without_masks():
    import torch

    def decode(ids):
        return "".join(chr(96 + t) for t in ids)

    f = FinalText({0}, decode, max_tokens=6)
    masked = torch.tensor([False, True, False, True, True, True])
    tokens = torch.tensor([1, 9, 3, 9, 9, 9])
    assert final_lengths(masked[None]) == [1]
    assert f.advance(tokens, masked) == "a"  # position 2 is committed but a mask lies before it
    tokens[1], masked[1] = 2, False
    assert f.advance(tokens, masked) == "bc"
    tokens[3], masked[3] = 0, False  # the end token: the answer is decided
    assert f.advance(tokens, masked) == "" and f.reason == "stop" and f.text == "abc"
    assert cut_answer([1, 2, 3, 4], set(), decode, 4, stop=["c"]) == ("ab", "stop", 2)
    assert streamable("abx", None, stop=["xy"]) == "ab"  # a tail that may start a stop string waits


def test_status_line_and_signal_bar():
    line = status_line(11, 256, 1, 8, False, 9, 32, 300, 0.0012, 0.00182, 80.4)
    assert line.plain.startswith("step  12/256 · blk 2/8 · partial 9×32 = 3% · E 0.0012 ▕")
    assert line.plain.endswith("▏ · 80 tok/s") and cell_len(line.plain) <= 80
    assert "REFRESH" in status_line(0, None, 0, 1, True, 300, 32, 300, None, 1.0, None).plain
    over, under = signal_bar(3.0, 1.0).plain, signal_bar(0.5, 1.0).plain
    assert over == "▕████████▏" and under == "▕██  │   ▏"
    assert signal_bar(0.5, None).plain == ""  # a policy without τ: no bar
    assert visible("a\nb\tc\x01") == "a↵b→c\ufffd"


def test_chat_streams_the_answer_as_its_leading_tokens_become_final(profiles_dir):
    """In-process: the answer reaches the output in several pieces, each written once its tokens have no
    mask before them, and the pieces join to the answer."""
    import io

    from rich.console import Console

    from ecache_cli import options as o
    from ecache_cli.models.loader import load_model
    from ecache_cli.runs.chat import ChatSession, SettingsSource

    class Out:
        def __init__(self):
            self.writes: list[str] = []

        def write(self, text: str) -> None:
            self.writes.append(text)

        def flush(self) -> None:
            pass

    out = Out()
    source = SettingsSource("tiny", o.decode_flags(32, 8, *[None] * 10), o.cache_flags(*[None] * 6))
    session = ChatSession(load_model("tiny", device="cpu", dtype="float32"), source, out, Console(file=io.StringIO()))
    session.ask(PROMPT)
    chunks = [w for w in out.writes if w]
    assert "".join(chunks) == session.records[0]["text"] + "\n"
    assert len(chunks) >= 3, chunks  # streamed, not written at the end
    assert session.history == [{"role": "user", "content": PROMPT},
                               {"role": "assistant", "content": session.records[0]["text"]}]


def _session(model: str, **decode):
    """An in-process chat session on ``model`` (stderr's notes and errors in ``session.console.file``)."""
    import io

    from rich.console import Console

    from ecache_cli.models.loader import load_model
    from ecache_cli.runs.chat import ChatSession, SettingsSource

    path = str(REPO / model) if model.startswith("tests/") else model
    source = SettingsSource(path, dict(decode), {})
    return ChatSession(load_model(path, device="cpu", dtype="float32"), source, io.StringIO(),
                       Console(file=io.StringIO(), width=400))


def test_chat_commands_check_the_policy_and_tau_against_the_model(profiles_dir):
    """/cache refuses a policy the loaded model does not take in one line, changing nothing (as generate's run
    would refuse it); /tau on a block-diffusion model says τ does not apply; /threshold off turns the family's
    default threshold off."""
    s = _session("tests/fixtures/llada2-mini", gen_length=16, block_length=8)
    assert s.settings.cache == "block" and s.settings.decode.threshold == 0.95  # LLaDA2's default
    for line in ("/cache entropy", "/cache dual:refresh_every=4"):
        s.command(line)
    s.command("/tau 0.3")
    s.command("/threshold off")
    errors = [x for x in s.console.file.getvalue().splitlines() if x.startswith("error:")]
    assert errors[0] == ("error: /cache entropy does not apply to the llada2 model family (its attention "
                         "is block-causal, so the keys and values of finished blocks are cached exactly); use none "
                         "or block")
    assert errors[1].startswith("error: /cache dual does not apply to the llada2 model family")
    warnings = [x for x in s.console.file.getvalue().splitlines() if x.startswith("warning:")]
    assert warnings == ["warning: /tau is not used by the llada2 model family (τ is EntropyCache's threshold; block "
                        "diffusion caches finished blocks exactly); ignored"]  # as --tau on this family
    assert len(errors) == 2 and s.settings.cache == "block" and s.source.cache_flags.get("policy") is None
    assert s.settings.decode.threshold is None and "threshold" not in s.describe()
    s.command("/threshold 0.8")
    assert s.settings.decode.threshold == 0.8
    tiny = _session("tiny", gen_length=32, block_length=8)
    tiny.command("/cache block")
    shown = tiny.console.file.getvalue()
    assert "error: /cache block does not apply to the llada model family" in shown and "--cache" not in shown
    assert "; use one of none, " in shown and tiny.settings.cache != "block"
    tiny.command("/cache dual")
    tiny.command("/tau 0.3")  # under dual: warned and ignored, kept for entropy, as --cache dual --tau 0.3
    assert "warning: /tau is not used by /cache dual (it takes refresh_every); ignored" in tiny.console.file.getvalue()
    assert tiny.settings.cache == "dual" and "tau" not in tiny.settings.cache_params
    tiny.command("/cache entropy")
    assert tiny.settings.cache_params["tau"] == 0.3


def test_a_changed_setting_is_said_once_and_save_suggests_a_jsonl_name(tmp_path):
    """The status line after ``/cache``, ``/gen-length`` is the settings line, naming each setting once;
    ``/save`` given a folder suggests a ``.jsonl`` file in it (the records are JSONL)."""
    s = _session("tiny", gen_length=32, block_length=8)
    s.command("/cache dual")
    s.command("/gen-length 16")
    s.command(f"/save {tmp_path}")
    assert s.console.file.getvalue().splitlines() == [
        "cache dual · gen-length 32, block 8", "cache dual · gen-length 16, block 8",
        f"error: /save {tmp_path} is a folder; give a file name (e.g. {tmp_path / 'chat.jsonl'})"]


def test_watch_on_without_a_terminal_warns_as_the_flag_does():
    """``/watch on`` where stderr is no terminal: the warning of ``--watch`` there, the session goes on
    answering without the live view (not a failed line)."""
    s = _session("tiny", gen_length=32, block_length=8)
    s.command("/watch on")
    assert s.console.file.getvalue().splitlines() == [
        "warning: /watch needs a terminal (stderr is not one); answering without the live view"]
    assert s.watch is False


def test_a_command_without_its_value_says_what_it_needs():
    """A setting's command given no value names that, with an example (``/threshold`` with its ``off``), as
    ``/cache`` and ``/save`` do; the settings stay as they were."""
    s = _session("tiny", gen_length=32, block_length=8)
    before = s.describe()
    for line in ("/tau", "/threshold", "/gen-length ", "/watch", "/cache", "/save"):
        s.command(line)
    assert s.console.file.getvalue().splitlines() == [
        "error: /tau needs a value, e.g. /tau 0.5", "error: /threshold needs a value, e.g. /threshold 0.9 or "
        "/threshold off", "error: /gen-length needs a value, e.g. /gen-length 64", "error: /watch needs on or off, "
        "e.g. /watch on", "error: /cache needs a policy, e.g. /cache entropy:tau=0.5",
        "error: /save needs a file name, e.g. /save chat.jsonl"]
    assert s.describe() == before


def test_watch_on_under_quiet_is_refused_as_the_flags_are(monkeypatch):
    """``/watch on`` in a ``-q`` session is refused as ``--watch -q`` is (the live view is stderr, which -q
    silences), on a terminal too; the session keeps answering without it."""
    from ecache_cli import console
    from ecache_cli.runs import watch

    s = _session("tiny", gen_length=32, block_length=8)
    monkeypatch.setattr(watch, "watch_available", lambda c: True)  # as at a terminal
    monkeypatch.setattr(console, "quiet", True)
    s.command("/watch on")
    assert s.console.file.getvalue().splitlines() == [
        "error: /watch on draws the canvas on stderr and -q silences stderr; start chat without -q to watch"]
    assert s.watch is False
    monkeypatch.setattr(console, "quiet", False)
    s.command("/watch on")
    assert s.watch is True


def test_chat_refuses_a_policy_the_model_does_not_take_at_start(cli):
    res = cli("chat", "--model", REPO / "tests" / "fixtures" / "sdar", "--cache", "dual", input="hello\n")
    assert res.exit_code == 2, res.stderr
    errors = [x for x in res.stderr.splitlines() if x.startswith("error:")]  # after the "using model" line
    assert len(errors) == 1 and errors[0].startswith("error: --cache dual does not apply to the sdar model family")
    assert "ecache chat: type a message" not in res.stderr


def test_piped_chat_prints_no_keyboard_prompt(cli):
    """Piped lines are a script: the start line and the answers, no "type a message" prompt for a person."""
    res = cli("chat", "--gen-length", "16", "--block-length", "8", input="Sort: 3 1 2\n")
    assert res.exit_code == 0, res.stderr
    assert res.stderr.startswith("using model") and "type a message" not in res.stderr, res.stderr
    assert res.stdout.strip() == "1 2 3"


def test_chat_names_the_chat_command_to_use_and_goes_on(tmp_path):
    """Piped input: a /gen-length that is not whole blocks is one error line naming the /gen-length that
    is, and the session goes on; at the end a last error line names the failed line and the script exits 2
    (a line that is not UTF-8 stops it before any answer, exit 2:
    ``test_contracts.test_chat_reads_piped_stdin_in_full_first``)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "ECACHE_THREADS": "1", "PYTHONPATH": str(REPO),
           "XDG_CONFIG_HOME": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "ecache_cli", "chat", "--gen-length", "32", "--block-length", "8"],
                         input=b"Sort: 3 1 2\n/gen-length 17\nReverse: 1 2\n", capture_output=True,
                         cwd=tmp_path, env=env, timeout=300)
    err = res.stderr.decode()
    assert res.returncode == 2 and "Traceback" not in err, err
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert errors == ["error: /gen-length 17 is not a multiple of --block-length 8: use a gen-length that is (e.g. "
                      "16 or 24) or a block length that divides 17",  # ecache generate's words, after /gen-length
                      "error: piped line 2 failed (the errors above); the other lines ran; fix the script and pipe "
                      "it again"]
    assert len([x for x in res.stdout.decode().splitlines() if x.strip()]) == 2  # both messages answered


def test_a_command_that_switches_to_a_policy_without_tau_warns_the_session_tau_ignored(profiles_dir):
    """``/tau`` then ``/threshold`` (which takes the embedded model's parallel profile, whose policy is none):
    the session's τ is named as ignored in one warning, in the words ``--tau 0.5 --threshold 0.9`` get
    (``runs.settings.not_used_by``), once; back on a policy that takes τ, the answer uses it again."""
    from ecache_cli.runs.settings import not_used_by

    s = _session("tiny", gen_length=32, block_length=8)
    s.command("/tau 0.5")
    s.command("/threshold 0.9")
    s.command("/gen-length 16")
    warnings = [x for x in s.console.file.getvalue().splitlines() if x.startswith("warning:")]
    assert s.settings.cache == "none" and s.settings.policy_from_profile
    assert warnings == [f"warning: /tau is {not_used_by(s.settings).replace('--cache', '/cache')}; ignored"]
    assert "(the policy of profile " in warnings[0] and "pass /cache to choose another; it takes no parameter" \
        in warnings[0]
    s.command("/threshold off")
    assert s.settings.cache == "entropy" and s.settings.cache_params["tau"] == 0.5
    assert len([x for x in s.console.file.getvalue().splitlines() if x.startswith("warning:")]) == 1


def test_chat_stats_and_help_answer_on_stdout_under_q_and_tau_under_dual_warns_as_the_flag(cli):
    """``/stats`` and ``/help`` are asked-for output: on stdout beside the answers, kept under ``-q``
    (which drops status lines); ``/tau`` under a policy without τ is one warning and ignored, as ``--tau``
    under it is; a clean piped script exits 0."""
    flag = cli("chat", "-q", "--gen-length", "16", "--block-length", "8", "--cache", "dual", "--tau", "0.1",
               input="/exit\n")
    assert flag.exit_code == 0 and flag.stderr.splitlines() == [
        "warning: --tau is not used by --cache dual (it takes refresh_every); ignored"], flag.stderr
    res = cli("chat", "-q", "--gen-length", "16", "--block-length", "8", "--cache", "dual",
              input="/stats\nSort: 3 1 2\n/stats\n/tau 0.1\n/help\n")
    assert res.exit_code == 0, res.stderr
    assert res.stderr.splitlines() == ["warning: /tau is not used by /cache dual (it takes refresh_every); ignored "
                                       "(/cache entropy uses τ 0.1)"]
    out = res.stdout.splitlines()
    assert out[0] == "no answer yet" and out[1] == "1 2 3", out
    assert re.fullmatch(r"NFE \d+ · refresh \d+ \(\d+%\) · \d+ tokens · [\d.]+ tok/s · work \d+% of no cache", out[2])
    assert out[3] == "commands:" and out[-1].lstrip().startswith("/exit")
    assert max(len(line) for line in out[3:]) <= 80, out  # the list fits the width, as every table does


def test_chat_help_wraps_to_the_terminal(monkeypatch):
    from ecache_cli.runs.chat import HELP, help_text

    monkeypatch.setenv("COLUMNS", "60")
    import shutil

    narrow = help_text(shutil.get_terminal_size().columns).splitlines()
    assert max(len(line) for line in narrow) <= 60 < max(len(line) for line in HELP.splitlines())
    assert " ".join(" ".join(narrow).split()) == " ".join(HELP.split())  # every word kept, in order


def test_an_answers_stats_break_between_their_fields_at_the_terminals_width():
    """``/stats`` (chat, on stdout) and the stats after a watched answer: one line where it fits, else broken
    between its ``·`` fields, never inside one, so 60 columns hold it as they hold ``/help``."""
    from ecache_cli.runs.watch import stats_line

    stats = {"nfe": 32, "full_forwards": 5, "generated_tokens": 6, "tokens_per_s": 49.4, "token_layer_share": 0.48}
    wide = stats_line(stats, 80)
    assert wide == stats_line(stats) == "NFE 32 · refresh 5 (16%) · 6 tokens · 49.4 tok/s · work 48% of no cache"
    narrow = stats_line(stats, 60).splitlines()
    assert narrow == ["NFE 32 · refresh 5 (16%) · 6 tokens · 49.4 tok/s", "work 48% of no cache"]
    assert all(len(line) <= 20 for line in stats_line(stats, 20).splitlines()[1:])  # a field a line
