"""--api-key: every request but /health needs 'Authorization: Bearer KEY'; 401 with an OpenAI-style
error otherwise; the key from the command line or the environment; a warning when serving beyond
loopback without one."""
from __future__ import annotations

import logging

import httpx
import openai
import pytest
import uvicorn

from dflash_gguf import options
from dflash_gguf.server import cli, create_app
from dflash_gguf.server.app import authorized
from support import KW, Oracle, fast, oracle, pair, plain, serve  # noqa: F401 (fixtures)

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def url(fast):
    with serve(create_app(fast, "tiny", api_key=KEY)) as u:
        yield u


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
                                     {"Authorization": f"Bearer {KEY[:-1]}"}, {"Authorization": "Bearer"}],
                         ids=["none", "wrong", "no-scheme", "basic", "longer", "prefix", "scheme-only"])
def test_without_the_key_every_route_but_health_is_401(url, headers):
    for method, path, body in [("GET", "/v1/models", None), ("GET", "/metrics", None),
                               ("POST", "/v1/completions", {"prompt": "def f(", "max_tokens": 2}),
                               ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                               ("GET", "/nowhere", None)]:
        r = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        assert "Authorization: Bearer" in err["message"] and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/health", headers=headers).status_code == 200


def test_with_the_key_requests_are_served_as_without_one(url, plain, oracle):
    ok = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(url + "/v1/models", headers=ok).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200
    want = plain("def main(", max_tokens=12, temperature=0)["choices"][0]["text"]
    oracle.learn(plain)
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    got = client.completions.create(model="tiny", prompt="def main(", max_tokens=12, temperature=0)
    assert got.choices[0].text == want
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    m = httpx.get(url + "/metrics?format=json", headers=ok).json()
    assert sum(x["count"] for x in m["requests"] if x["status"] == 401) > 0


def test_authorized_compares_the_whole_token():
    assert authorized(f"Bearer {KEY}", KEY) and authorized(f"bearer  {KEY} ", KEY)
    for h in (None, "", KEY, f"Bearer {KEY[:-1]}", f"Bearer {KEY}0", "Bearer", f"Token {KEY}"):
        assert not authorized(h, KEY), h


@pytest.mark.parametrize("host, quiet", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                         ("127.0.0.2", True), ("0.0.0.0", False), ("192.0.2.7", False),
                                         ("myhost", False)])
def test_loopback(host, quiet):
    assert cli.loopback(host) is quiet


@pytest.mark.parametrize("argv_key, env_key, host, warns, key", [
    (None, None, "0.0.0.0", True, None), (None, None, "127.0.0.1", False, None),
    ("k1", None, "0.0.0.0", False, "k1"), (None, "k2", "0.0.0.0", False, "k2"), ("k1", "k2", "0.0.0.0", False, "k1"),
])
def test_the_cli_takes_the_key_from_flag_or_environment(fast, monkeypatch, caplog, argv_key, env_key, host,
                                                        warns, key):
    seen = {}
    monkeypatch.setattr(options, "load_llama", lambda args: fast)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    monkeypatch.setattr(cli, "create_app", lambda *a, **kw: seen.update(api_key=kw["api_key"]) or create_app(*a, **kw))
    if env_key:
        monkeypatch.setenv(cli.API_KEY_ENV, env_key)
    else:
        monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    argv = ["-m", "unused.gguf", "--host", host] + (["--api-key", argv_key] if argv_key else [])
    with caplog.at_level(logging.WARNING, logger="dflash_gguf.server"):
        assert cli.main(argv) == 0
    assert seen["api_key"] == key and seen["host"] == host
    assert any("without an API key" in r.getMessage() for r in caplog.records) is warns


@pytest.mark.parametrize("missing, expect", [((), ("uvloop", "httptools")), (("uvloop",), ("asyncio", "httptools")),
                                             (("httptools",), ("uvloop", "h11")),
                                             (("uvloop", "httptools"), ("asyncio", "h11"))])
def test_the_cli_serves_on_uvloop_and_httptools_where_installed(fast, monkeypatch, missing, expect):
    import importlib.util
    real = importlib.util.find_spec

    def find_spec(name, *a):
        if name in ("uvloop", "httptools"):     # installed or not, as the case says
            return None if name in missing else object()
        return real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    seen = {}
    monkeypatch.setattr(options, "load_llama", lambda args: fast)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(**kw))
    assert cli.main(["-m", "unused.gguf"]) == 0
    assert (seen["loop"], seen["http"]) == expect
