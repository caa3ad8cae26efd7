"""Model aliases and fallbacks: `models:` maps public names to served names (the forwarded body says the
served name); an alias's fallback model takes its requests while no backend of the served model is routable."""

from __future__ import annotations

from typing import AsyncIterator

import openai
import pytest

from proxy.app import AffinityProxy
from proxy.config import ConfigError, parse_config
from proxy.core.snapshot import Health, Snapshot
from sim.fleet import Fleet, start_fleet


@pytest.fixture
async def two_models() -> AsyncIterator[tuple[Fleet, Fleet]]:
    big = await start_fleet(2, speed=200.0, model_name="org/big-70b", name_prefix="big")
    small = await start_fleet(2, speed=200.0, model_name="org/small-8b", name_prefix="small")
    yield big, small
    await big.stop()
    await small.stop()


def _text(big: Fleet, small: Fleet) -> str:
    lines = [f"  - {{name: {s.name}, url: '{s.url}', models: ['{m}']}}"
             for fleet, m in ((big, "org/big-70b"), (small, "org/small-8b")) for s in fleet.servers]
    return ("listen: {port: 0}\nadmin: {port: 0}\ndebug_headers: true\n"
            "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\nrouting: {policy: affinity}\n"
            "models:\n  gpt-4o: {served: org/big-70b, fallback: org/small-8b}\n  gpt-4o-mini: {served: org/small-8b}\n"
            "backends:\n" + "\n".join(lines) + "\n")


async def test_aliases_rewrite_the_model_and_fall_back_when_the_served_model_is_down(
        two_models: tuple[Fleet, Fleet]) -> None:
    big, small = two_models
    proxy = AffinityProxy(parse_config(_text(big, small)))
    await proxy.start()
    try:
        async with openai.AsyncOpenAI(base_url=proxy.http_url + "/v1", api_key="k", max_retries=0) as c:
            async def ask(model: str, i: int) -> tuple[str, str]:
                raw = await c.chat.completions.with_raw_response.create(
                    model=model, max_tokens=1, messages=[{"role": "user", "content": f"question {i}"}])
                return raw.headers["x-affinity-backend"], raw.parse().model

            for i in range(6):
                backend, served = await ask("gpt-4o", i)
                assert backend.startswith("big-") and served == "org/big-70b"
                backend, served = await ask("gpt-4o-mini", i)
                assert backend.startswith("small-") and served == "org/small-8b"

            def down(snap: Snapshot) -> Snapshot:
                for s in big.servers:
                    snap = snap.replace_backend(s.name, health=Health.UNHEALTHY)
                return snap

            proxy.store.update(down)
            for i in range(6):
                backend, served = await ask("gpt-4o", i)
                assert backend.startswith("small-") and served == "org/small-8b"
            # asked for by its own name (no alias, no fallback), the downed model is a 503, not another model
            with pytest.raises(openai.APIStatusError) as err:
                await c.chat.completions.create(model="org/big-70b", max_tokens=1,
                                                messages=[{"role": "user", "content": "x"}])
            assert err.value.status_code == 503
    finally:
        await proxy.stop()


def test_a_fallback_must_be_another_model() -> None:
    with pytest.raises(ConfigError, match="fallback"):
        parse_config("backends:\n  - {name: a, url: 'http://h:1'}\nmodels:\n  x: {served: y, fallback: y}\n")
