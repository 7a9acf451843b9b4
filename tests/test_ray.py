"""The ``ray`` extra: ``ecache serve --ray`` (Ray Serve replicas of the same app) and ``ecache generate
--input --ray N`` (the batches on a Ray Data actor pool), on the embedded model.

The Ray tests start a local Ray instance of two CPUs on loopback (small object store, no dashboard) once
for the module and shut it down at its end; they are ``slow`` (a minute or more on two cores: Ray's
processes and each replica's model load) and run in ``.ci/run``'s slow step, which installs the extra.
They skip only where ``ray`` cannot be imported. The flag checks and the missing-extra error run in the
default suite, with or without Ray.
"""

from __future__ import annotations

import builtins
import json
import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
from cli_helpers import one_line_error

GEN = ["--gen-length", "16", "--block-length", "8"]
PROMPTS = ["Sort: 9 3 7 1", "Reverse: 1 2 3", "Sort: 5 2 8", "Reverse: 4 5 6 7", "Sort: 3 1 2"]


# --- flags and the missing extra (no Ray needed) ----------------------------------------------------


@pytest.mark.parametrize("args, needle", [
    (["serve", "--replicas", "2"], "--replicas applies to Ray replicas; add --ray"),
    (["serve", "--cores-per-replica", "2"], "--cores-per-replica applies to Ray replicas; add --ray"),
    (["serve", "--ray", "--replicas", "0"], "--replicas '0': give a number ≥ 1 or auto"),
    (["serve", "--ray", "--replicas", "many"], "--replicas 'many': give a number ≥ 1 or auto"),
    (["serve", "--ray", "--cores-per-replica", "0"], "--cores-per-replica 0 must be ≥ 1"),
    (["generate", "--ray", "0", "--input", "in.jsonl"], "--ray 0 must be ≥ 1"),
    (["generate", "--ray", "2", "Sort: 3 1 2"], "--ray decodes the records of --input FILE"),
    (["generate", "--ray", "2", "--input", "in.jsonl", "--stream"], "--stream shows the canvas of this process"),
])
def test_bad_ray_flags_are_one_line_usage_errors(cli, tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "Sort: 3 1 2"}\n')
    one_line_error(cli(*args), 2, needle)


@pytest.mark.parametrize("args", [["serve", "--ray"], ["generate", "--ray", "2", "--input", "in.jsonl"]])
def test_without_ray_the_error_names_the_extra(cli, tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "Sort: 3 1 2"}\n')
    real = builtins.__import__

    def no_ray(name, *a, **k):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"No module named {name!r}", name=name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    one_line_error(cli(*args), 1, "needs Ray, the 'ray' extra: pip install 'ecache[ray]'")


def test_deployment_options_fix_the_replicas_or_autoscale_on_requests_in_flight():
    from ecache_cli.serve.handling import ServeOptions
    from ecache_cli.serve.ray_serve import deployment_options

    opts = ServeOptions(model_name="tiny", max_batch=8, max_queue=100, shutdown_grace=5.0)
    res = {"num_cpus": 2, "num_gpus": 0}
    fixed = deployment_options("3", res, opts, capacity=4)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == res and fixed["max_ongoing_requests"] == 108
    assert fixed["graceful_shutdown_timeout_s"] == 5.0
    auto = deployment_options("auto", res, opts, capacity=4)
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}


def test_replicas_beyond_the_clusters_room_are_refused_naming_the_flags():
    from types import SimpleNamespace

    from ecache_cli.errors import EcacheError
    from ecache_cli.serve.ray_serve import check_capacity

    cluster = SimpleNamespace(cluster_resources=lambda: {"CPU": 8.0, "GPU": 2.0})
    assert check_capacity(cluster, "4", {"num_cpus": 2, "num_gpus": 0}) == 4
    assert check_capacity(cluster, "auto", {"num_cpus": 1, "num_gpus": 1}) == 2
    with pytest.raises(EcacheError, match=r"--replicas 3: the Ray cluster holds 2 replica\(s\) of 1 GPU each; lower"):
        check_capacity(cluster, "3", {"num_cpus": 1, "num_gpus": 1})
    with pytest.raises(EcacheError, match=r"holds 0 replica\(s\) of 16 CPU core\(s\)"):
        check_capacity(cluster, "auto", {"num_cpus": 16, "num_gpus": 0})


def test_a_cuda_device_reserves_one_gpu_per_replica_and_loads_on_its_own():
    from ecache_cli.runs.ray_batch import replica_device, resources

    assert resources("cuda:1", 4) == {"num_cpus": 1, "num_gpus": 1} and replica_device("cuda:1") == "cuda"
    assert resources("cpu", 4) == {"num_cpus": 4, "num_gpus": 0} and replica_device("cpu") == "cpu"


class _InlineRay:
    """``ray.remote(f).options(...).remote()`` and ``ray.get`` run ``f`` in this process (no Ray needed)."""

    def remote(self, fn):
        class Task:
            def options(self, **_):
                return self

            def remote(self):
                return fn()

        return Task()

    def get(self, value):
        return value


def test_the_pre_deploy_check_reads_no_weight_and_still_refuses_bad_settings(monkeypatch):
    """``serve --ray``'s probe checks the settings and the prompt limit on the model's config and
    tokenizer alone: a weight read would fail here."""
    import ecache_cli.models.loader as loader
    from ecache_cli.commands.serve import prompt_limit
    from ecache_cli.errors import UsageError
    from ecache_cli.runs.settings import resolve_settings
    from ecache_cli.runtime import inspect_for_command
    from ecache_cli.serve.ray_serve import probe

    def no_weights(*a, **k):
        raise AssertionError("the pre-deploy check read the weights")

    monkeypatch.setattr(loader, "load_weights", no_weights)
    inspect = partial(inspect_for_command, "tiny", "cpu", "auto")
    settings = resolve_settings("tiny", {"gen_length": 16, "block_length": 8}, {})
    limit = probe(_InlineRay(), inspect, partial(prompt_limit, settings=settings, max_prompt_tokens=None), {})
    assert limit == inspect().spec.max_positions - 16 > 0
    with pytest.raises(UsageError, match="--max-prompt-tokens 1000000 \\+ --gen-length 16 exceed"):
        probe(_InlineRay(), inspect, partial(prompt_limit, settings=settings, max_prompt_tokens=10**6), {})
    dual = resolve_settings("tiny", {"gen_length": 16, "block_length": 8}, {"policy": "dual"})
    sdar = partial(inspect_for_command, str(Path(__file__).parent / "fixtures" / "sdar"), "cpu", "auto")
    with pytest.raises(UsageError, match="--cache dual does not apply to the sdar model family"):
        probe(_InlineRay(), sdar, partial(prompt_limit, settings=dual, max_prompt_tokens=None), {})
    with pytest.raises(AssertionError, match="read the weights"):  # the patch holds: loading would read them
        loader.load_model("tiny", "cpu")


# --- on a local Ray instance ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray", reason="the 'ray' extra is not installed (pip install -e '.[ray]'); "
                                            ".ci/run installs it")
    import logging

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the replicas inherit it: one torch thread each
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024, log_to_driver=False,
             logging_level=logging.ERROR, _node_ip_address="127.0.0.1")
    try:
        yield ray
    finally:
        ray.shutdown()


def _generated(cli, *args) -> list[dict]:
    res = cli("generate", "--jsonl", "--quiet", *GEN, *args)
    assert res.exit_code == 0, res.output
    return [json.loads(line) for line in res.stdout.splitlines()]


def _same(rec: dict) -> dict:
    """A record less what the run measures (its wall time and rate, the process's memory)."""
    out = {k: v for k, v in rec.items() if k != "memory"}
    out["stats"] = {k: v for k, v in rec["stats"].items() if k not in ("wall_s", "tokens_per_s")}
    return out


@pytest.mark.slow
def test_two_ray_serve_replicas_answer_concurrent_requests_as_generate_does(ray_local, cli):
    import httpx
    from ray import serve

    from ecache_cli.commands.serve import prompt_limit
    from ecache_cli.errors import UsageError
    from ecache_cli.runs.ray_batch import resources
    from ecache_cli.runs.settings import resolve_settings
    from ecache_cli.runtime import inspect_for_command, load_for_command
    from ecache_cli.serve.app import bind
    from ecache_cli.serve.handling import ServeOptions
    from ecache_cli.serve.ray_serve import deploy, probe, shutdown

    settings = resolve_settings("tiny", {"gen_length": 16, "block_length": 8}, {})
    load = partial(load_for_command, "tiny", "cpu", "auto", 1)
    inspect = partial(inspect_for_command, "tiny", "cpu", "auto")
    res = resources("cpu", 1)
    limit = probe(ray_local, inspect, partial(prompt_limit, settings=settings, max_prompt_tokens=None), res)
    assert limit == prompt_limit(load()[0], settings, None)  # what one server computes after loading
    with pytest.raises(UsageError, match="--max-prompt-tokens 1000000 \\+ --gen-length 16 exceed"):
        probe(ray_local, inspect, partial(prompt_limit, settings=settings, max_prompt_tokens=10**6), res)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    opts = ServeOptions(model_name="tiny", max_batch=4, max_queue=16, max_prompt_tokens=limit, warmup=1)
    url = deploy(load, settings, opts, "2", res, "127.0.0.1", port)
    try:
        replicas = serve.status().applications["ecache"].deployments["ecache"].replica_states
        assert replicas.get("RUNNING") == 2, replicas
        alone = _generated(cli, *PROMPTS)

        def chat(prompt):
            r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                           json={"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 16})
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
            got = list(pool.map(chat, PROMPTS * 2))
        for prompt, ref, resp in zip(PROMPTS * 2, alone * 2, got):
            assert resp["choices"][0]["message"]["content"] == ref["text"], prompt
            assert resp["usage"]["completion_tokens"] == len(ref["token_ids"])
        assert httpx.get(f"{url}/health/ready").status_code == 200
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
    finally:
        shutdown()


@pytest.mark.slow
def test_generate_ray_writes_generates_records_in_order_and_resumes(ray_local, cli, tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"prompt": p, "id": i}) for i, p in enumerate(PROMPTS)]
    src.write_text("\n".join(lines[:2] + ['{"question": "no prompt field"}'] + lines[2:]) + "\n")
    plain, on_ray = tmp_path / "plain.jsonl", tmp_path / "ray.jsonl"
    flags = [*GEN, "-b", "2", "--skip-invalid", "--input", src]
    res = cli("generate", *flags, "-q", "--output", plain)
    assert res.exit_code == 0, res.output
    res = cli("generate", *flags, "-q", "--output", on_ray, "--ray", "2")
    assert res.exit_code == 0, res.output
    want = [json.loads(line) for line in plain.read_text().splitlines()]
    got = [json.loads(line) for line in on_ray.read_text().splitlines()]
    assert [r["index"] for r in got] == list(range(len(PROMPTS) + 1))
    assert got[2]["line"] == 3 and ":3: " in got[2]["error"]  # the invalid line's record, in its place
    assert [_same(r) if "stats" in r else r for r in got] == [_same(r) if "stats" in r else r for r in want]
    assert [r.get("text") for r in got] == ["1 3 7 9", "3 2 1", None, "2 5 8", "7 6 5 4", "1 2 3"]
    # an interrupted run: two records and half of the third; --resume decodes the rest on Ray
    written = on_ray.read_bytes().splitlines(keepends=True)
    on_ray.write_bytes(b"".join(written[:3]) + written[3][:40])
    res = cli("generate", *flags, "--output", on_ray, "--ray", "2", "--resume")
    assert res.exit_code == 0, res.output
    assert "3 record(s) kept (a torn last line dropped), 3 to decode" in res.stderr
    resumed = [json.loads(line) for line in on_ray.read_text().splitlines()]
    assert resumed[:3] == got[:3]
    assert [_same(r) if "stats" in r else r for r in resumed] == [_same(r) if "stats" in r else r for r in want]
