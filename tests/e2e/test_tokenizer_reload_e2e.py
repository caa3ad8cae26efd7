"""A reload that changes `telemetry.kv_events.tokenizers` (a model added, or a folder changed) loads the new
tokenizer in the routing process (issue 13), in one process and in every `--workers` worker; a folder that
cannot be loaded is refused like any invalid file (422, the running configuration keeps serving).

The "wrong" tokenizer here is the simulator's with its vocabulary's ids reversed: every prompt gets ids the
engines never computed, so the precise index matches nothing until the right folder is reloaded."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import pytest

from proxy.app import AffinityProxy
from proxy.config import ConfigError, load_config, parse_config
from proxy.core.kv_index import KVIndex
from proxy.core.request import RequestSummary
from proxy.dataplane.tokenize import ModelTokenizer, PreciseMatcher
from sim.fleet import Fleet, start_fleet
from sim.kv_events import KVEventsConfig
from sim.tokenizer import TOKENIZER_DIR

from .test_kv_events_e2e import _computed_behind_the_proxy, _continuations_reach_holders, _until, _words


def reversed_tokenizer(folder: Path) -> Path:
    """The simulator's tokenizer folder with every vocabulary id reversed (same words, other ids)."""
    shutil.copytree(TOKENIZER_DIR, folder)
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    top = max(vocab.values())
    data["model"]["vocab"] = {w: top - i for w, i in vocab.items()}
    path.write_text(json.dumps(data))
    return folder


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    f = await start_fleet(2, speed=20.0, kv_events=cfg)
    yield f
    await f.stop()


def _config(fleet: Fleet, tokenizer: Path | str) -> str:
    model = fleet.servers[0].backend.engine.model_name
    lines, kv = [], []
    for s in fleet.servers:
        pub = s.backend.kv_publisher
        assert pub is not None
        lines.append(f"  - {{name: {s.name}, url: '{s.url}', models: ['{model}']}}")
        kv.append(f"      {s.name}: {{endpoint: '{pub.endpoint}', replay_endpoint: '{pub.replay_endpoint}'}}")
    return (
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\ndebug_headers: true\n"
        "health_checks: {enabled: false}\nrouting: {policy: affinity}\n"
        f"backends:\n{chr(10).join(lines)}\n"
        f"telemetry:\n  interval_ms: 100\n  timeout_ms: 80\n  kv_events:\n    stale_after_s: 0\n"
        f"    tokenizers: {{'{model}': '{tokenizer}'}}\n    backends:\n{chr(10).join(kv)}\n"
    )


def test_a_tokenizer_folder_that_cannot_load_is_a_config_error(tmp_path: Path) -> None:
    base = ("backends:\n  - {name: a, url: 'http://127.0.0.1:1', models: [m]}\n"
            "telemetry:\n  kv_events:\n    tokenizers: {m: '%s'}\n    backends:\n      a: {endpoint: 'tcp://127.0.0.1:5557'}\n")
    with pytest.raises(ConfigError) as exc:
        parse_config(base % (tmp_path / "missing"))
    assert len(exc.value.errors) == 1
    assert exc.value.errors[0].startswith("telemetry.kv_events.tokenizers.m (line 5): cannot load the tokenizer")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizers.m"):
        parse_config(base % (tmp_path / "broken"))
    assert parse_config(base % TOKENIZER_DIR).telemetry.kv_events.tokenizers == {"m": str(TOKENIZER_DIR)}


async def test_load_tokenizers_adds_changes_keeps_and_drops(tmp_path: Path) -> None:
    other = reversed_tokenizer(tmp_path / "reversed")
    sim = ModelTokenizer.from_dir(TOKENIZER_DIR)
    index = KVIndex()
    m = PreciseMatcher(index, {"a": sim}, paths={"a": str(TOKENIZER_DIR)})
    assert m.load_tokenizers({"a": str(TOKENIZER_DIR)}) is None  # nothing changed: nothing loads
    assert m.tokenizers["a"] is sim
    task = m.load_tokenizers({"a": str(TOKENIZER_DIR), "b": str(other)})  # a model added
    assert task is not None and "b" not in m.tokenizers  # the old table routes while it loads
    await task
    assert m.tokenizers["a"] is sim and m.tokenizers["b"].encode("user") != sim.encode("user")
    await m.load_tokenizers({"a": str(other), "b": str(other)})  # a's folder changed
    assert m.tokenizers["a"].encode("user") == m.tokenizers["b"].encode("user") != sim.encode("user")
    await m.load_tokenizers({"b": str(other)})  # a removed
    assert list(m.tokenizers) == ["b"] and m.default_model == "b"
    # A folder broken after the configuration's check: the model keeps its tokenizer, and a later reload
    # of the same path tries again.
    b = m.tokenizers["b"]
    await m.load_tokenizers({"b": str(tmp_path / "gone")})
    assert m.tokenizers["b"] is b


async def test_a_reload_loads_the_new_tokenizer_and_a_bad_one_is_refused(tmp_path: Path, fleet: Fleet) -> None:
    model = fleet.servers[0].backend.engine.model_name
    wrong = reversed_tokenizer(tmp_path / "reversed")
    path = tmp_path / "proxy.yaml"
    path.write_text(_config(fleet, wrong))
    proxy = AffinityProxy(load_config(str(path)), config_path=str(path))
    assert proxy.precise is not None
    matcher = proxy.precise.matcher
    await proxy.start()
    try:
        await asyncio.sleep(0.5)  # SUB sockets connect
        async with aiohttp.ClientSession() as s:
            prompts = await _computed_behind_the_proxy(s, fleet, 2, 3, seed=600, step=10)
            await _until(lambda: all(proxy.precise.index.num_blocks(f"sim-{i}") >= 60 for i in range(2)))

            def held(i: int, p: str) -> int:
                got = matcher(RequestSummary(prompt=p, model=model, endpoint="/v1/completions"))
                return 0 if got is None else got.cached.get(f"sim-{i}", 0)

            assert all(held(i, p) == 0 for (i, _), p in prompts.items())  # the wrong ids match nothing

            path.write_text(_config(fleet, TOKENIZER_DIR))
            async with s.post(proxy.admin_url + "/admin/reload") as r:
                assert r.status == 200, await r.text()
            await _until(lambda: all(held(i, p) >= 304 for (i, _), p in prompts.items()))
            for (i, j), p in prompts.items():
                body = {"model": model, "prompt": p + " " + _words(7300 + 10 * i + j, 40), "max_tokens": 1}
                async with s.post(proxy.http_url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200 and resp.headers["x-affinity-backend"] == f"sim-{i}", (i, j)
                    assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] >= 304

            # A folder that cannot be loaded: 422, and the tokenizer in force keeps routing.
            path.write_text(_config(fleet, tmp_path / "missing"))
            async with s.post(proxy.admin_url + "/admin/reload") as r:
                assert r.status == 422
                errors = (await r.json())["errors"]
            assert any(e.startswith(f"telemetry.kv_events.tokenizers.{model}") and "cannot load" in e for e in errors)
            async with s.get(proxy.admin_url + "/admin/reload") as r:
                assert (await r.json())["last"]["ok"] is False
            assert proxy.config.telemetry.kv_events.tokenizers == {model: str(TOKENIZER_DIR)}
            await asyncio.sleep(0.2)
            assert all(held(i, p) >= 304 for (i, _), p in prompts.items())
    finally:
        await proxy.stop()


async def test_every_worker_loads_the_reloaded_tokenizer(tmp_path: Path, fleet: Fleet) -> None:
    """`run --workers 2`: the supervisor checks the folder (422 for a bad one), each worker loads it."""
    from tests.deploy.procs import AFFINITY_PROXY, start_proxy

    model = fleet.servers[0].backend.engine.model_name
    wrong = reversed_tokenizer(tmp_path / "reversed")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(_config(fleet, wrong))
    proxy = await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])
    try:
        workers = proxy.workers()
        assert len(workers) == 2
        async with aiohttp.ClientSession() as s:
            cfg.write_text(_config(fleet, tmp_path / "missing"))
            async with s.post(proxy.admin + "/admin/reload") as r:
                assert r.status == 422 and "tokenizers" in " ".join((await r.json())["errors"])
            cfg.write_text(_config(fleet, TOKENIZER_DIR))
            async with s.post(proxy.admin + "/admin/reload") as r:
                assert r.status == 200, await r.text()
            await _until(lambda: sum("tokenizers now" in line for line in proxy.log) == 2, timeout=20)
            prompts = await _computed_behind_the_proxy(s, fleet, 2, 3, seed=900, step=10)
        await asyncio.sleep(1.5)  # every worker has applied the events
        await _continuations_reach_holders(proxy.port, model, prompts, ["sim-0", "sim-1"], workers, 9300)
    finally:
        await proxy.terminate()
