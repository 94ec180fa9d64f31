"""The access middleware in-process (httpx over ASGI, a one-route app): API keys on the protected routes only, in
OpenAI's 401 body; the key's partition of the prefix cache; body size and body-read time limits."""

import asyncio
import logging

import httpx
import pytest
from fastapi import FastAPI, Request

from jaxspec.serving.access import TENANT, AccessConfig, Guard, cache_partition, keys_from, warn_if_exposed


def app_with(config: AccessConfig) -> FastAPI:
    app = FastAPI()
    app.add_middleware(Guard, config=config)

    @app.post("/v1/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body()), "tenant": request.scope.get("state", {}).get(TENANT)}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def send(app, method: str, path: str, **kw) -> httpx.Response:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://app") as client:
            return await client.request(method, path, **kw)

    return asyncio.run(main())


def test_keys_guard_the_api_routes_and_health_stays_open():
    app = app_with(AccessConfig(api_keys=("k1", "k2")))
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k1"}, {"Authorization": "k1"}):
        r = send(app, "POST", "/v1/echo", content=b"{}", headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", headers
        assert r.json()["error"] == {
            "message": "missing or invalid API key (expected Authorization: Bearer KEY)",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    for key in ("k1", "k2"):
        r = send(app, "POST", "/v1/echo", content=b"{}", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json() == {"bytes": 2, "tenant": None}
    assert send(app, "GET", "/health").status_code == 200
    assert send(app_with(AccessConfig()), "POST", "/v1/echo", content=b"{}").status_code == 200  # no keys: open


def test_salt_by_key_partitions_the_cache_by_the_key_never_the_key_itself():
    app = app_with(AccessConfig(api_keys=("k1", "k2"), salt_by_key=True))
    bearer = lambda key: {"Authorization": f"Bearer {key}"}
    tenants = [send(app, "POST", "/v1/echo", headers=bearer(k)).json()["tenant"] for k in ("k1", "k2")]
    assert tenants == ["k1", "k2"]
    salts = {cache_partition(k, s) for k in ("k1", "k2") for s in (None, "a", "b")}
    assert len(salts) == 6 and not any("k1" in s or "k2" in s for s in salts)
    assert cache_partition(None, "a") == "a" and cache_partition(None, None) is None
    with pytest.raises(ValueError, match="salt_by_key: partitions the prefix cache by API key, so it needs api_keys"):
        AccessConfig(salt_by_key=True)


def test_bodies_over_the_limit_are_413_and_a_body_that_does_not_arrive_is_408():
    app = app_with(AccessConfig(max_body_bytes=100, body_timeout=0.5))
    assert send(app, "POST", "/v1/echo", content=b"x" * 100).json()["bytes"] == 100
    r = send(app, "POST", "/v1/echo", content=b"x" * 101)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    async def trickle():  # no Content-Length: the limit holds on what arrives
        for _ in range(5):
            yield b"x" * 30

    assert send(app, "POST", "/v1/echo", content=trickle()).status_code == 413

    async def stalled():
        yield b"x"
        await asyncio.sleep(5)
        yield b"y"

    r = send(app, "POST", "/v1/echo", content=stalled())
    assert r.status_code == 408 and r.headers["connection"] == "close"


def test_keys_come_from_flags_or_the_environment_and_an_exposed_host_warns(caplog):
    assert keys_from(["a", "b"], {"JAXSPEC_API_KEY": "c"}) == ("a", "b")
    assert keys_from(None, {"JAXSPEC_API_KEY": "c, d,"}) == ("c", "d") and keys_from(None, {}) == ()
    with caplog.at_level(logging.WARNING, "jaxspec.serving"):
        for host in ("127.0.0.1", "localhost", "::1"):
            warn_if_exposed(host, AccessConfig())
        warn_if_exposed("0.0.0.0", AccessConfig(api_keys=("k",)))
        assert caplog.records == []
        warn_if_exposed("0.0.0.0", AccessConfig())
    assert "without an API key" in caplog.text


def test_the_serve_flags_build_the_access_config(monkeypatch):
    import argparse

    from jaxspec.cli.serve import _access, add_access_args

    p = argparse.ArgumentParser()
    add_access_args(p)
    p.add_argument("--host", default="127.0.0.1")
    flags = ["--api-key", "a", "--api-key", "b", "--prefix-cache-salt-by-key", "--max-body-bytes", "10"]
    args = p.parse_args([*flags, "--body-timeout", "1.5"])
    assert _access(args) == AccessConfig(("a", "b"), True, 10, 1.5) and not args.allow_special_tokens
    monkeypatch.setenv("JAXSPEC_API_KEY", "c")
    assert _access(p.parse_args([])).api_keys == ("c",)
    monkeypatch.delenv("JAXSPEC_API_KEY")
    with pytest.raises(SystemExit, match="--prefix-cache-salt-by-key partitions by API key: set --api-key"):
        _access(p.parse_args(["--prefix-cache-salt-by-key"]))
    with pytest.raises(SystemExit, match="body_timeout: expected a positive number of seconds"):
        _access(p.parse_args(["--body-timeout", "0"]))
