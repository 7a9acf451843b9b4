"""Item 4 of issue 49: ``ecache models`` (list, ``show``, ``pull``) and the memory refusal.

Nothing here reaches the network: every hub lookup runs against a private Hugging Face cache
(``HF_HUB_CACHE`` under ``tmp_path``, ``HF_HUB_OFFLINE=1``), where a "downloaded" alias is a fake
snapshot laid out as ``hf download`` leaves it; the free memory of the device is monkeypatched.
"""

from __future__ import annotations

import pytest
import torch
from cli_helpers import one_line_error
from conftest import SMALL

from ecache_cli.errors import ModelLoadError
from ecache_cli.models import loader
from ecache_cli.models.loader import load_model, weight_bytes

# --- memory refusal ------------------------------------------------------------------------------------------


def _state_bytes(lm, size: int) -> int:
    """The bytes of a loaded model's checkpoint tensors at ``size`` bytes an element (fused projections
    count once: they are views of the same storage as the checkpoint's own tensors)."""
    return sum(t.numel() for t in lm.model.state_dict().values()) * size


@pytest.mark.parametrize("family", ["llada", "dream"])  # one file, and two shards + index
def test_weight_bytes_are_the_checkpoints_tensors_in_the_load_dtype(family, request):
    path = request.getfixturevalue(f"{family}_dir")
    lm = request.getfixturevalue(f"{family}_lm")
    assert weight_bytes(path, torch.float32) == _state_bytes(lm, 4)
    assert weight_bytes(path, torch.bfloat16) == _state_bytes(lm, 2)


def test_weight_bytes_fall_back_to_the_spec_for_an_unreadable_header(llada_dir, llada_lm, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(llada_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\xff" * 16)
    assert weight_bytes(broken, torch.float32, llada_lm.spec) == llada_lm.spec.n_params * 4
    assert weight_bytes(broken, torch.float32) == 0  # no spec: no figure (the load's own check reports the file)


def _tight(monkeypatch, path, spare: int = -1) -> int:
    """Make the device's free memory ``spare`` bytes more than ``path``'s float32 weights need; return the need."""
    need = weight_bytes(path, torch.float32)
    monkeypatch.setattr(loader, "free_memory", lambda device: need + spare)
    return need


def test_load_model_refuses_weights_that_do_not_fit_before_reading_any(llada_dir, monkeypatch):
    need = _tight(monkeypatch, llada_dir)
    read = []
    real = loader.load_weights
    monkeypatch.setattr(loader, "load_weights", lambda *a, **k: read.append(1) or real(*a, **k))
    with pytest.raises(ModelLoadError) as e:
        load_model(llada_dir, device="cpu", dtype="float32")
    msg = str(e.value)
    assert read == [] and "\n" not in msg
    shown = loader._apart(need, need - 1)
    assert f"needs {shown[0]}" in msg and f"has {shown[1]} free" in msg and "--force" in msg
    assert "use --dtype bfloat16" in msg  # half the bytes fit
    lm = load_model(llada_dir, device="cpu", dtype="float32", force=True)
    assert read == [1] and lm.model is not None
    assert load_model(llada_dir, device="cpu", dtype="bfloat16").dtype == torch.bfloat16  # bfloat16 fits


def test_weights_that_just_fit_load(llada_dir, monkeypatch):
    _tight(monkeypatch, llada_dir, spare=0)
    assert load_model(llada_dir, device="cpu", dtype="float32").spec.family == "llada"


def test_figures_that_round_alike_get_more_digits():
    assert loader._apart(15 * 2**30, 14 * 2**30) == ("15.0 GiB", "14.0 GiB")
    assert loader._apart(int(14.93 * 2**30), int(14.91 * 2**30)) == ("14.93 GiB", "14.91 GiB")
    assert loader._apart(2**30 + 1, 2**30) == ("1,073,741,825 bytes", "1,073,741,824 bytes")


def test_free_memory_reads_the_device():
    import psutil

    assert abs(loader.free_memory(torch.device("cpu")) - psutil.virtual_memory().available) < 2**30
    assert loader.free_memory(torch.device("meta")) is None  # no figure: no refusal


def test_an_unknown_free_memory_refuses_nothing(llada_dir, monkeypatch):
    monkeypatch.setattr(loader, "free_memory", lambda device: None)
    assert load_model(llada_dir, device="cpu", dtype="float32").spec.family == "llada"


#: Each command that loads a model, with arguments that make it start (a prompt, a task, a free port).
LOADING = {
    "generate": ["generate", "Sort: 3 1", *SMALL],
    "profile": ["profile", "Sort: 3 1", "--policies", "none", *SMALL],
    "calibrate": ["calibrate", "--task", "list", "--limit", "2", "--gen-length", "16", "--block-length", "8",
                  "--dry-run", "-q"],
    "trace-drift": ["trace-drift", "Sort: 3 1", "--gen-length", "16", "--block-length", "8", "--no-chat", "-q"],
    "serve": ["serve", "--port", "0", "-q"],
}


@pytest.mark.parametrize("command", list(LOADING))
def test_every_loading_command_refuses_a_model_that_does_not_fit(cli, llada_dir, monkeypatch, command):
    need = _tight(monkeypatch, llada_dir)
    res = cli(*LOADING[command], "--model", llada_dir, "--device", "cpu", "--dtype", "float32")
    shown = loader._apart(need, need - 1)
    one_line_error(res, 1, f"needs {shown[0]} for its weights in float32", f"has {shown[1]} free", "--force")
    assert res.stdout == ""


def test_force_loads_a_model_that_does_not_fit(cli, llada_dir, monkeypatch):
    _tight(monkeypatch, llada_dir)
    res = cli(*LOADING["generate"], "--model", llada_dir, "--device", "cpu", "--dtype", "float32", "--force")
    assert res.exit_code == 0, res.stderr
    assert res.stdout.strip()


def test_lm_eval_model_args_refuse_and_force_alike(llada_dir, monkeypatch, profiles_dir):
    pytest.importorskip("lm_eval")
    from ecache_cli.evaluation.lm_eval_adapter import EcacheLM

    _tight(monkeypatch, llada_dir)
    args = f"model={llada_dir},device=cpu,dtype=float32"
    with pytest.raises(ModelLoadError, match="force=true") as e:  # its model_args key, not --force
        EcacheLM.create_from_arg_string(args)
    assert "--force" not in str(e.value), str(e.value)
    assert EcacheLM.create_from_arg_string(args + ",force=true").lm.spec.family == "llada"


# --- ecache models: the list ------------------------------------------------------------------------------------

ZEROS = "0" * 40


def hub_snapshot(cache, repo: str, src):
    """Lay ``src`` out as the Hugging Face cache's snapshot of ``repo`` (what ``hf download`` leaves:
    ``models--org--name/snapshots/<commit>/`` and ``refs/main``); the same layout as tests/test_families.py."""
    import shutil

    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / ZEROS
    shutil.copytree(src, snap)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(ZEROS)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty private Hugging Face cache (``HF_HUB_CACHE``), offline: no test reaches the network."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _aliases() -> list[str]:
    from ecache_cli.models.registry import FAMILIES

    return ["tiny", *(a for fam in FAMILIES.values() for a in fam.aliases)]


def _listing(cli, *args, columns: int = 80):
    from typer.testing import CliRunner

    from ecache_cli.cli import app

    res = CliRunner().invoke(app, ["models", *args], env={"COLUMNS": str(columns)})
    assert res.exit_code == 0, res.output
    return res


@pytest.mark.parametrize("columns", [60, 80, 120])
def test_the_list_fits_the_terminal_and_names_every_model(cli, hub, columns):
    out = _listing(cli, columns=columns).stdout
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= columns, max(lines, key=len)
    assert "…" not in out
    firsts = [ln.split()[0] for ln in lines if ln.strip() and not ln.startswith(" ")]
    names = [w for w in firsts if w in _aliases()]
    assert names == _aliases()  # every model name whole, on its own row, in registry order (60 columns too)
    for cell in ("8.0B", "14.9", "29.9", "7.4B", "1.7B active", "llada-moe", "cpGRPO"):
        assert cell in out, (columns, cell)
    if columns == 60:  # the kind moves under the name: no kind column, no word cut inside
        stripped = [ln.rstrip() for ln in lines]
        assert "kind" not in lines[0] and "  code cpGRPO" in stripped and "  Instruct" in stripped


def test_the_list_as_json_has_one_object_per_model(cli, hub):
    import json

    out = _listing(cli, "--json").stdout
    assert out.count("\n") == 1  # one line, as every command's --json on stdout
    rows = json.loads(out)
    assert [r["alias"] for r in rows] == _aliases()
    by = {r["alias"]: r for r in rows}
    assert by["tiny"]["local"] == "yes" and by["tiny"]["repo"] is None
    assert by["llada-8b"] == {"alias": "llada-8b", "repo": "GSAI-ML/LLaDA-8B-Instruct", "family": "llada",
                              "kind": "Instruct", "params": 8_015_581_184, "active_params": 8_015_581_184,
                              "bf16_bytes": 2 * 8_015_581_184, "fp32_bytes": 4 * 8_015_581_184, "local": "no",
                              "path": None}
    moe = by["llada-moe"]
    assert moe["family"] == "llada-moe" and moe["active_params"] < moe["params"] / 3
    assert by["diffucoder-7b"]["repo"] == "apple/DiffuCoder-7B-Instruct"


def test_the_list_sees_the_local_cache_without_the_network(cli, hub, llada_dir, dream_dir, monkeypatch):
    import json

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", _no_network)
    snap = hub_snapshot(hub, "GSAI-ML/LLaDA-8B-Base", llada_dir)
    part = hub_snapshot(hub, "Dream-org/Dream-v0-Base-7B", dream_dir)
    (part / "model-00002-of-00002.safetensors").unlink()  # an interrupted download
    by = {r["alias"]: r for r in json.loads(_listing(cli, "--json").stdout)}
    assert (by["llada-8b-base"]["local"], by["llada-8b-base"]["path"]) == ("yes", str(snap))
    assert by["dream-7b-base"]["local"] == "part" and by["llada-8b"]["local"] == "no"
    rows = {ln.split()[0]: ln.split() for ln in _listing(cli, columns=120).stdout.splitlines() if ln.strip()}
    # one vocabulary: the table's local column says what --json says
    for alias in ("tiny", "llada-8b-base", "dream-7b-base", "llada-8b"):
        assert rows[alias][-1] == by[alias]["local"], alias


def test_hf_home_places_the_cache_too(cli, tmp_path, llada_dir, monkeypatch):
    import json

    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_snapshot(tmp_path / "hf" / "hub", "GSAI-ML/LLaDA-1.5", llada_dir)
    by = {r["alias"]: r for r in json.loads(_listing(cli, "--json").stdout)}
    assert by["llada-1.5"]["local"] == "yes"


def _no_network(*args, **kwargs):
    raise AssertionError(f"the network was asked for: snapshot_download{args}")


# --- README: the table is the list's ----------------------------------------------------------------------------


def test_the_readme_table_is_what_ecache_models_reports(cli, hub):
    """README.md's "Supported models" table equals the rows ``ecache models --json`` reports, in the cells
    the list prints (``runs/models.readme_table``); on a mismatch the message holds the table to paste."""
    import json
    import re

    from conftest import REPO

    from ecache_cli.runs.models import readme_table

    rows = json.loads(_listing(cli, "--json").stdout)
    want = readme_table(rows)
    text = (REPO / "README.md").read_text()
    m = re.search(r"^\| alias \| Hugging Face repository \|.*?\n(?:\|.*\n)+", text, flags=re.M)
    assert m, "README.md has no Supported models table"
    assert m.group(0) == want, "README.md's Supported models table is stale; paste this:\n" + want
    tiny = next(ln for ln in want.splitlines() if ln.startswith("| `tiny`"))
    assert "| llada | demo (arith, code, list) | 1.2M | <0.1 | <0.1 |" in tiny


# --- ecache models show -----------------------------------------------------------------------------------------


def _show(cli, *args, code: int = 0, columns: int = 1000):
    from typer.testing import CliRunner

    from ecache_cli.cli import app

    res = CliRunner().invoke(app, ["models", "show", *map(str, args)], env={"COLUMNS": str(columns)})
    assert res.exit_code == code, res.output
    return res


def _fields(text: str) -> dict[str, str]:
    """The ``key  value`` rows of ``show``'s output (printed wide enough for one line each)."""
    import re

    out = {}
    for ln in text.splitlines():
        m = re.match(r"^(\S.*?|  \S.*?)  +(\S.*)$", ln)
        if m:
            out[m.group(1).strip()] = m.group(2).rstrip()
    return out


def test_show_the_embedded_model(cli, hub):
    f = _fields(_show(cli, "tiny").stdout)
    assert f["model"] == "tiny (embedded)" and f["family"].startswith("llada: LLaDA")
    assert f["parameters"] == "1.2M" and f["weights"] == "2.3 MiB in bfloat16, 4.7 MiB in float32"
    assert f["architecture"] == "4 layers, hidden 128, 4 heads / 4 kv heads of 32, MLP 384"
    assert f["vocabulary"] == "1472" and f["max positions"] == "4096" and f["sampler"] == "llada"
    assert f["logit shift"].startswith("0 ")
    assert "mask 2 '<|mdm_mask|>'" in f["tokens"] and "eos 1 '<|endoftext|>'" in f["tokens"]
    assert f["chat template"].startswith("yes, starting {%")
    assert f["default profile"].endswith("profiles/tiny/default.yaml (shipped with ecache)")
    assert "policy entropy" in f["cache"] and "gen_length 256" in f["decode"]
    assert "repository" not in f


def test_show_and_the_list_carry_no_trailing_spaces_off_a_terminal(cli, hub):
    """Off a terminal rich pads each line to 80 columns; the lines written end at their last character."""
    for out, first in ((_show(cli, "tiny").stdout, "tiny (embedded)"), (cli("models").stdout, "local")):
        lines = out.splitlines()
        assert len(lines) > 5 and [line for line in lines if line != line.rstrip()] == []
        assert lines[0].startswith("model ") and lines[0].endswith(first)


def test_show_an_alias_not_downloaded_says_how_to_get_it(cli, hub):
    res = _show(cli, "llada-moe")
    f = _fields(res.stdout)
    assert f["repository"] == "inclusionAI/LLaDA-MoE-7B-A1B-Instruct" and f["parameters"] == "7.4B (1.7B active)"
    assert f["weights"] == "13.7 GiB in bfloat16, 27.4 GiB in float32" and f["family"].startswith("llada-moe: ")
    local = [ln for ln in res.stdout.splitlines() if "not downloaded" in ln]
    assert local == [
        "local            not downloaded: run `ecache models pull llada-moe` (or `hf download "
        "inclusionAI/LLaDA-MoE-7B-A1B-Instruct` on a connected machine)"]
    assert "architecture" not in f and "tokens" not in f
    assert f["default profile"].startswith("none")


def test_show_an_alias_with_a_shipped_profile(cli, hub):
    f = _fields(_show(cli, "diffucoder-7b").stdout)
    assert f["default profile"].endswith("profiles/diffucoder-7b/default.yaml (shipped with ecache)")
    assert "temperature 0.4" in f["decode"] and "top_p 0.95" in f["decode"] and "remasking entropy" in f["decode"]


def test_show_a_downloaded_alias_reads_its_checkpoint(cli, hub, moe_dir):
    snap = hub_snapshot(hub, "inclusionAI/LLaDA-MoE-7B-A1B-Base", moe_dir)
    res = _show(cli, "llada-moe-base")
    f = _fields(res.stdout)
    assert f["local"] == f"in the Hugging Face cache: {snap}"
    assert f["experts"].startswith("8 in 2 of 2 layers, 2 per token")
    assert f["kind"] == "Base" and "mask" in f["tokens"] and "'" in f["tokens"]  # token strings from the tokenizer
    spec_params = json_show(cli, "llada-moe-base")
    assert spec_params["params"] < 10**7 and spec_params["config"]["experts"]["experts"] == 8
    assert spec_params["bf16_bytes"] == weight_bytes(snap, torch.bfloat16)


def json_show(cli, name):
    import json

    out = _show(cli, name, "--json").stdout
    assert out.count("\n") == 1
    return json.loads(out)


@pytest.mark.parametrize("family,shift", [("llada", "0"), ("dream", "1")])
def test_show_a_checkpoint_folder(cli, hub, request, family, shift):
    path = request.getfixturevalue(f"{family}_dir")
    info = json_show(cli, path)
    assert info["source"] == "folder" and info["family"] == family and info["path"] == str(path)
    assert info["config"]["logit_shift"] == int(shift) and info["tokens"]["mask"]["token"]
    assert info["fp32_bytes"] == weight_bytes(path, torch.float32) and info["get"] is None
    f = _fields(_show(cli, path).stdout)
    assert f["logit shift"].startswith(shift) and f["local"] == f"checkpoint folder: {path}"


def test_show_a_partly_downloaded_alias(cli, hub, dream_dir):
    snap = hub_snapshot(hub, "Dream-org/Dream-v0-Instruct-7B", dream_dir)
    (snap / "model-00001-of-00002.safetensors").unlink()
    f = _fields(_show(cli, "dream-7b").stdout)
    assert f["local"] == (f"partly downloaded: {snap}: 1 of 2 shards listed in model.safetensors.index.json is "
                          "missing (model-00001-of-00002.safetensors); run `ecache models pull dream-7b` (or "
                          "`hf download Dream-org/Dream-v0-Instruct-7B` on a connected machine)")
    assert f["architecture"].startswith("2 layers")  # the config is there


# One rule for a checkpoint whose index lists shards that are not there (models.loader.missing_weights_error):
# `ecache generate` (exit 1) and `ecache models show` (its local row, exit 0) name every missing shard in the
# index's order and end with the fix: `ecache models pull NAME` for an alias, copy them in for a folder.
ALL_SHARDS = ("2 of 2 shards listed in model.safetensors.index.json are missing (model-00001-of-00002.safetensors, "
              "model-00002-of-00002.safetensors)")


def _generate(cli, model):
    return cli("generate", "-q", "--model", model, "hi", "--gen-length", "16", "--block-length", "8")


def test_a_folder_missing_every_shard_names_them_all(cli, hub, dream_dir, tmp_path):
    import shutil

    folder = tmp_path / "dshard"
    shutil.copytree(dream_dir, folder)
    for f in folder.glob("model-0000*"):
        f.unlink()
    want = f"{folder}: {ALL_SHARDS}; copy or download the missing shards into {folder}"
    assert one_line_error(_generate(cli, folder), 1) == f"error: {want}"
    res = _show(cli, folder)
    assert _fields(res.stdout)["local"] == f"incomplete: {want}" and res.exit_code == 0
    assert json_show(cli, folder)["missing"] == ["model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"]


def test_an_alias_missing_every_shard_gives_the_pull_fix(cli, hub, dream_dir):
    snap = hub_snapshot(hub, "Dream-org/Dream-v0-Instruct-7B", dream_dir)
    for f in snap.glob("model-0000*"):
        f.unlink()
    want = (f"{snap}: {ALL_SHARDS}; run `ecache models pull dream-7b` (or `hf download Dream-org/Dream-v0-Instruct-7B` "
            "on a connected machine)")
    assert one_line_error(_generate(cli, "dream-7b"), 1) == f"error: {want}"
    res = _show(cli, "dream-7b")
    assert _fields(res.stdout)["local"] == f"partly downloaded: {want}" and res.exit_code == 0


def test_show_rejects_what_is_no_model(cli, hub, tmp_path):
    one_line_error(_show(cli, "nosuch", code=1), 1, "'nosuch'", "ecache models")  # a missing model, as --model
    (tmp_path / "empty").mkdir()
    one_line_error(_show(cli, tmp_path / "empty", code=1), 1, "no config.json", str(tmp_path / "empty"))


# One rule for a tokenizer file that does not load (models.loader.load_tokenizer): `ecache models show` fails with
# `ecache generate`'s error, naming the tokenizer, not config.json (without the tokenizer LLaDA-MoE and LLaDA2
# would read their default mask id, outside the tiny vocabulary). A folder with no tokenizer file at all stays
# a note: the config reads without it.
def _broken_tokenizer(tmp_path, family: str, file: str, text: str):
    from ecache_cli.models.synthetic import write_random_checkpoint

    folder = write_random_checkpoint(tmp_path / family, family, shards=1, seed=0)
    (folder / file).write_text(text)
    return folder


@pytest.mark.parametrize("family,file,text,words", [
    ("llada-moe", "tokenizer.json", "{garbage", "cannot load tokenizer.json (Exception: "),
    ("llada2", "tokenizer_config.json", "[1,2", "cannot load the tokenizer (JSONDecodeError: "),
])
def test_show_a_broken_tokenizer_says_what_generate_says(cli, hub, tmp_path, family, file, text, words):
    folder = _broken_tokenizer(tmp_path, family, file, text)
    line = one_line_error(_generate(cli, folder), 1, f"{folder}: {words}")
    assert one_line_error(_show(cli, folder, code=1), 1) == line
    assert one_line_error(_show(cli, folder, "--json", code=1), 1) == line
    assert "config.json" not in line


def test_show_a_folder_without_tokenizer_files_notes_it(cli, hub, llada_dir, tmp_path):
    import shutil

    from ecache_cli.models.loader import TOKENIZER_FILES

    folder = tmp_path / "notok"
    shutil.copytree(llada_dir, folder)
    for name in TOKENIZER_FILES:
        (folder / name).unlink(missing_ok=True)
    res = _show(cli, folder)
    assert res.stderr.startswith("note: no tokenizer, so no token strings or chat template (") and \
        "no tokenizer files" in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert _fields(res.stdout)["architecture"].startswith("2 layers")


# --- ecache models pull -----------------------------------------------------------------------------------------


def _pull(cli, name, code):
    res = cli("models", "pull", name)
    assert res.exit_code == code, res.output
    return res


def test_pull_offline_says_so_and_gives_the_command(cli, hub):
    res = _pull(cli, "llada-8b", 1)
    one_line_error(res, 1, "HF_HUB_OFFLINE is set", "`hf download GSAI-ML/LLaDA-8B-Instruct`", "connected machine")
    assert res.stdout == "" and not any(hub.iterdir())


def test_pull_with_the_hub_unreachable_says_so(cli, hub, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")

    def unreachable(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'\nmore")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    res = _pull(cli, "dream-coder-7b", 1)
    one_line_error(res, 1, "the download failed (ConnectionError: Failed to resolve 'huggingface.co')",
                   "`hf download Dream-org/Dream-Coder-v0-Instruct-7B`")


def test_pull_of_a_cached_alias_touches_no_network(cli, hub, llada_dir, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", _no_network)
    snap = hub_snapshot(hub, "GSAI-ML/LLaDA-8B-Instruct", llada_dir)
    res = _pull(cli, "llada-8b-instruct", 0)
    assert res.stdout == f"{snap}\n" and "already in the Hugging Face cache" in res.stderr


def test_pull_downloads_with_the_loaders_patterns(cli, hub, llada_dir, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def fake(repo, **kwargs):
        calls.append((repo, kwargs))
        return str(hub_snapshot(hub, repo, llada_dir))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    res = _pull(cli, "llada-1.5", 0)
    ((repo, kwargs),) = calls
    assert repo == "GSAI-ML/LLaDA-1.5" and kwargs["allow_patterns"] == loader.HUB_PATTERNS
    assert kwargs["cache_dir"] == hub and not kwargs.get("local_files_only")
    assert res.stdout.strip().endswith(f"snapshots/{ZEROS}") and "downloaded llada-1.5" in res.stderr
    assert _pull(cli, "llada-1.5", 0).stderr.count("already in the Hugging Face cache") == 1  # now cached


def test_pull_that_leaves_a_shard_missing_fails(cli, hub, dream_dir, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")

    def partial(repo, **kwargs):
        snap = hub_snapshot(hub, repo, dream_dir)
        (snap / "model-00002-of-00002.safetensors").unlink()
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", partial)
    assert one_line_error(_pull(cli, "dream-7b-base", 1), 1) == (
        "error: Dream-org/Dream-v0-Base-7B: the download is incomplete: 1 of 2 shards listed in "
        "model.safetensors.index.json is missing (model-00002-of-00002.safetensors); run `ecache models pull "
        "dream-7b-base` again")


def test_pull_of_tiny_a_folder_or_nothing(cli, hub, llada_dir):
    res = _pull(cli, "tiny", 0)
    assert res.stdout.strip().endswith("data/tiny") and "embedded in the package" in res.stderr
    one_line_error(_pull(cli, str(llada_dir), 2), 2, "is a local folder", "alias")
    one_line_error(_pull(cli, "nosuch", 1), 1, "'nosuch'", "ecache models")


# --- the command group ------------------------------------------------------------------------------------------


def test_models_usage_errors_are_one_line(cli, hub):
    one_line_error(cli("models", "nosuch"), 2, "nosuch", "ecache models --help")
    one_line_error(cli("models", "--json", "show", "tiny"), 2, "--json goes after the subcommand")
    one_line_error(cli("models", "show"), 2, "missing argument 'NAME'", "ecache models show --help")


@pytest.mark.parametrize("args", [["models"], ["models", "show"], ["models", "pull"]])
def test_models_help_fits_80_columns(args):
    from typer.testing import CliRunner

    from ecache_cli.cli import app

    res = CliRunner().invoke(app, [*args, "-h"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert max(len(ln) for ln in res.stdout.splitlines()) <= 80 and "…" not in res.stdout
    if args == ["models"]:
        assert "show" in res.stdout and "pull" in res.stdout and "--json" in res.stdout


def test_a_repo_id_is_shown_and_pulled_like_an_alias(cli, hub, llada_dir):
    info = json_show(cli, "someone/llada-finetune")
    assert (info["source"], info["local"], info["family"], info["params"]) == ("repo", "no", None, None)
    assert info["get"] == {"ecache": "ecache models pull someone/llada-finetune",
                           "hub": "hf download someone/llada-finetune"}
    one_line_error(_pull(cli, "someone/llada-finetune", 1), 1, "HF_HUB_OFFLINE is set",
                   "`hf download someone/llada-finetune`")
    snap = hub_snapshot(hub, "someone/llada-finetune", llada_dir)
    info = json_show(cli, "someone/llada-finetune")
    assert (info["local"], info["family"], info["path"]) == ("yes", "llada", str(snap))
    assert _pull(cli, "someone/llada-finetune", 0).stdout == f"{snap}\n"


def test_the_repo_of_a_known_alias_is_shown_with_the_aliases_facts(cli, hub):
    """``models show ORG/NAME`` of an alias's repository shows what the alias does (family, parameters),
    with the repo id as the name to pull."""
    by_alias, by_repo = json_show(cli, "dream-7b"), json_show(cli, "Dream-org/Dream-v0-Instruct-7B")
    assert by_repo["source"] == "repo" and by_repo["family"] == by_alias["family"] == "dream"
    assert by_repo["params"] == by_alias["params"] is not None
    assert by_repo["get"]["ecache"] == "ecache models pull Dream-org/Dream-v0-Instruct-7B"


def test_quantized_sizes_keep_embeddings_and_head_in_the_compute_dtype():
    """``models show``'s int8 / int4 estimates (and the memory check under --quantize): LLaDA-8B's
    1.04B embedding and head parameters stay bfloat16, the other 6.98B take 1 byte (int8) or 0.53 (int4)."""
    import torch

    from ecache_cli.models.loader import quantized_bytes
    from ecache_cli.models.registry import spec_from_config
    from ecache_cli.models.synthetic import tiny_config

    spec = spec_from_config(tiny_config("llada", vocab_size=126464, d_model=4096, n_layers=32, n_heads=32,
                                        mlp_hidden=12288))
    bf16 = spec.n_params * 2
    outer = 126464 * 4096 * 2
    assert quantized_bytes(bf16, spec, torch.bfloat16, "int8") == outer * 2 + (spec.n_params - outer)
    int4 = int(outer * 2 + (spec.n_params - outer) * (0.5 + 4 / 128))
    assert quantized_bytes(bf16, spec, torch.bfloat16, "int4") == int4
    assert 8.0e9 < quantized_bytes(bf16, spec, torch.bfloat16, "int8") < 9.5e9  # an 8B model: about 8 GB in int8
    f32 = quantized_bytes(spec.n_params * 4, spec, torch.float32, "int8")
    assert f32 > quantized_bytes(bf16, spec, torch.bfloat16, "int8")


def test_show_gives_an_aliass_quantized_sizes_before_it_is_downloaded(cli, monkeypatch, tmp_path):
    """Without the checkpoint, ``models show`` estimates int8 / int4 sizes from the registry's counts: the
    same figures the official config gives."""
    import json

    import torch

    from ecache_cli.models.loader import quantized_bytes
    from ecache_cli.models.registry import spec_from_config
    from ecache_cli.models.synthetic import tiny_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    r = cli("models", "show", "llada-8b", "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)["quantized_bytes"]
    spec = spec_from_config(tiny_config("llada", vocab_size=126464, d_model=4096, n_layers=32, n_heads=32,
                                        mlp_hidden=12288))
    assert got == {f: quantized_bytes(spec.n_params * 2, spec, torch.bfloat16, f) for f in ("int8", "int4")}
