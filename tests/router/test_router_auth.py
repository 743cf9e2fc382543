"""The router with an API key (spec.auth): clients without it get the engine's 401 from the router
itself, clients with it are served, and the router sends the key to the engines."""

from __future__ import annotations

import asyncio
import json

import pytest
from fake_engine import MODEL
from router_fixtures import StartEngines, StartRouter

from kvfleet_router.cli import build_parser
from kvfleet_router.cli import main as router_main
from kvfleet_router.settings import SENDABLE_KEY, RouterSettings

KEY = "sk-router-0123456789abcdef"
COMPLETION = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4}).encode()


async def test_a_client_without_the_key_gets_401_and_reaches_no_engine(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url], api_key=KEY)
    malformed = "malformed Authorization header: expected 'Authorization: Bearer <key>'"
    for headers, message in (
        ({}, "missing API key: send it as the header 'Authorization: Bearer <key>'"),
        ({"Authorization": "Bearer sk-wrong"}, "incorrect API key provided"),
        ({"Authorization": f"Bearer {KEY.upper()}"}, "incorrect API key provided"),
        ({"Authorization": KEY}, malformed),  # no "Bearer "
        ({"Authorization": "Bearer"}, malformed),
        ({"Authorization": f"Basic {KEY}"}, malformed),
    ):
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = await router.post(path, COMPLETION, headers=headers)
            assert response.status == 401, (path, headers)
            assert response.headers["WWW-Authenticate"] == "Bearer"
            assert await response.json() == {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        models = await router.http.get(router.url + "/v1/models", headers=headers)
        assert models.status == 401
    assert engine.bodies == []
    assert KEY not in json.dumps(engine.authorizations)


async def test_a_client_with_the_key_is_served_and_the_key_goes_upstream(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url], api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    response = await router.post("/v1/completions", COMPLETION, headers=auth)
    assert response.status == 200 and (await response.json())["id"] == "cmpl-1"
    models = await router.http.get(router.url + "/v1/models", headers=auth)
    assert [m["id"] for m in (await models.json())["data"]] == [MODEL]
    assert engine.authorizations == [f"Bearer {KEY}"]


@pytest.mark.parametrize(
    "authorization",
    [f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}", f"Bearer {KEY}  "],
    ids=["lowercase-scheme", "uppercase-scheme", "two-spaces", "trailing-spaces"],
)
async def test_the_key_is_accepted_as_the_engine_accepts_it(
    authorization: str, start_engines: StartEngines, start_router: StartRouter
) -> None:
    """HTTP auth schemes are case-insensitive (RFC 7235) and the engine takes these: the router
    answered them 401 "incorrect API key provided"."""
    (engine,) = await start_engines(1)
    router = await start_router([engine.url], api_key=KEY)
    response = await router.post(
        "/v1/completions", COMPLETION, headers={"Authorization": authorization}
    )
    assert response.status == 200, await response.text()
    assert engine.authorizations == [f"Bearer {KEY}"]


async def test_probes_and_metrics_need_no_key(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url], api_key=KEY)
    for path in ("/health", "/ready", "/metrics"):
        assert (await router.http.get(router.url + path)).status == 200, path


async def test_without_a_key_the_client_s_header_passes_through(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url])
    await router.post("/v1/completions", COMPLETION, headers={"Authorization": "Bearer theirs"})
    response = await router.post("/v1/completions", COMPLETION)
    assert response.status == 200
    assert engine.authorizations == ["Bearer theirs", None]


def test_the_key_comes_from_the_environment_and_is_never_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[RouterSettings] = []
    monkeypatch.setattr("kvfleet_router.app.run", seen.append)
    monkeypatch.setenv("KVFLEET_API_KEY", KEY)
    assert router_main(["--backend", "http://127.0.0.1:1"]) == 0
    (settings,) = seen
    assert settings.api_key == KEY
    assert KEY not in repr(settings)
    assert "KVFLEET_API_KEY" in build_parser().format_help()
    with pytest.raises(ValueError, match="api_key: must be a non-empty key"):
        RouterSettings(backends=("http://127.0.0.1:1",), api_key="")


@pytest.mark.parametrize(
    ("argv", "environment", "named"),
    [
        (["--api-key="], None, "--api-key"),
        (["--api-key", "key\n"], None, "--api-key"),
        (["--api-key", " key"], None, "--api-key"),
        ([], "", "$KVFLEET_API_KEY"),  # an empty Secret key: refused, not "no authentication"
        ([], "schl\u00fcssel", "$KVFLEET_API_KEY"),
    ],
)
def test_a_key_no_client_can_send_stops_the_router(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    environment: str | None,
    named: str,
) -> None:
    """The router never starts without authentication, or with a key every client fails, when
    a key was given: exit 2 naming the flag or the variable, and the key not echoed."""
    monkeypatch.setattr("kvfleet_router.app.run", lambda settings: pytest.fail("it started"))
    if environment is None:
        monkeypatch.delenv("KVFLEET_API_KEY", raising=False)
    else:
        monkeypatch.setenv("KVFLEET_API_KEY", environment)
    with pytest.raises(SystemExit) as exit_info:
        router_main(["--backend", "http://127.0.0.1:1", *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"{named}: must be a non-empty key of printable ASCII characters" in error
    assert "key\n" not in error and "schl" not in error


async def test_an_authorization_header_that_is_not_utf8_is_a_401_not_a_500(
    start_engines: StartEngines, start_router: StartRouter
) -> None:
    (engine,) = await start_engines(1)
    router = await start_router([engine.url], api_key=KEY)
    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\r\n"
        b"Content-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(COMPLETION), COMPLETION)
    )
    await writer.drain()
    answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 401"), answer[:80]
    assert b"incorrect API key provided" in answer
    assert engine.bodies == []


@pytest.mark.parametrize("authorization", [b"", b"Authorization: Bearer wrong\r\n"])
async def test_a_client_without_the_key_is_not_invited_to_send_its_body(
    start_engines: StartEngines, start_router: StartRouter, authorization: bytes
) -> None:
    """With Expect: 100-continue it got "100 Continue" (aiohttp answers the expectation before
    the middlewares run) and then a 401: an invitation to upload up to 4 MiB for nothing."""
    (engine,) = await start_engines(1)
    router = await start_router([engine.url], api_key=KEY)
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\n%s\r\n" % (len(COMPLETION), authorization)
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    writer.close()
    assert head.startswith(b"HTTP/1.1 401 "), head
    assert engine.bodies == []


@pytest.mark.parametrize(
    "key", ["sk-local-123", "a", "k e y", "", " key", "key ", "key\n", "schl\u00fcssel", "\x7f"]
)
def test_the_router_takes_the_keys_kvfleet_serve_takes(key: str) -> None:
    """The router may not import the engine, so its key rule is a copy of `kvfleet serve`'s
    (engine argtypes.api_key): one table of keys through both, so the copies cannot drift."""
    import argparse

    from kvfleet_engine.argtypes import api_key

    try:
        api_key(key)
        engine_takes = True
    except argparse.ArgumentTypeError:
        engine_takes = False
    assert (SENDABLE_KEY.fullmatch(key) is not None) == engine_takes
