"""The API key (actors/serving/api_keys.py): a key no client could send is refused when the server starts, naming
where it came from; DSQUANT_API_KEY="" is refused like --api-key ""; Serve's proxy guard and the ingress
compare the Authorization header the same way."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors.serving.api_keys import authorized, check_key, env_key
from jobs._serve_flags import api_key, parse_args

KEY = "sk-test_0123.abc~!"


@pytest.mark.parametrize("key", ["clé-secrète", "sk\u00a0x", "sk key", "sk\tkey", " ", "x" * 4097])
def test_a_key_no_client_can_send_is_refused_from_every_source(tmp_path, monkeypatch, key):
    monkeypatch.delenv("DSQUANT_API_KEY", raising=False)
    path = tmp_path / "key"
    path.write_text(key + "\n", encoding="utf-8")
    sources = [(["--api-key", key], "--api-key")]
    if key.strip():                               # a file's first line is stripped: a blank one is "empty"
        sources.append((["--api-key-file", str(path)], f"--api-key-file {path}"))
    for argv, where in sources:
        with pytest.raises(ValueError, match=f"^{where}"):
            api_key(parse_args(argv))
    monkeypatch.setenv("DSQUANT_API_KEY", key)
    with pytest.raises(ValueError, match="^DSQUANT_API_KEY"):
        api_key(parse_args([]))


def test_an_empty_environment_key_is_refused_like_an_empty_flag(monkeypatch):
    monkeypatch.setenv("DSQUANT_API_KEY", "")
    with pytest.raises(ValueError, match=r"DSQUANT_API_KEY \(set; unset it to serve without a key\) is empty"):
        api_key(parse_args([]))
    with pytest.raises(ValueError, match="--api-key is empty"):
        api_key(parse_args(["--api-key", ""]))
    monkeypatch.delenv("DSQUANT_API_KEY")
    assert api_key(parse_args([])) is None
    assert env_key({"DSQUANT_API_KEY": KEY}) == KEY


def test_a_key_file_that_is_a_fifo_or_device_is_not_read(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo")
    for path in (tmp_path / "fifo", "/dev/zero"):
        with pytest.raises(ValueError, match="not a regular file"):
            api_key(parse_args(["--api-key-file", str(path)]))


def test_the_serve_config_refuses_an_unusable_key():
    from actors.serving.serve_config import ServeConfig

    with pytest.raises(ValueError, match="api_key: an API key must be"):
        ServeConfig("/models/q", api_key="clé")
    assert ServeConfig("/models/q", api_key=KEY).api_key == KEY


HEADERS = [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER  {KEY} ", f"Bearer\t{KEY}", f"Bearer {KEY}x", f"Basic {KEY}",
           KEY, "", f"Bearer {KEY[:-1]}", "Bearer clé", "Bearer " + KEY.upper()]


def test_the_proxy_guard_and_the_ingress_agree_on_every_header():
    """The same header value, as the proxy sees it (raw bytes) and as the ingress sees it (Starlette's
    Latin-1 str), gets the same answer."""
    from actors.serving.app.serve_ingress import OpenAIIngress as Ingress
    from actors.serving.app.serve_proxy import ProxyGuard

    guard = ProxyGuard(app=None, api_key=KEY)
    ingress_auth = getattr(Ingress, "func_or_class", Ingress)._auth
    this = SimpleNamespace(config=SimpleNamespace(api_key=KEY))
    for value in HEADERS:
        raw = value.encode("utf-8")
        by_proxy = guard._authorized([(b"Authorization", raw)])
        request = SimpleNamespace(headers={"authorization": raw.decode("latin-1")} if value else {})
        by_ingress = ingress_auth(this, request) is None
        assert by_proxy == by_ingress == authorized(raw, KEY), value
    assert authorized(f"Bearer {KEY}".encode(), KEY) and authorized(f"Bearer {KEY}", KEY)
    assert not authorized(None, KEY) and not authorized("Bearer \u20ac", KEY)


def test_check_key_accepts_every_visible_ascii_character():
    visible = "".join(chr(c) for c in range(0x21, 0x7F))
    assert check_key(visible, "k") == visible
