"""`prepos serve --backend llama-server --engine-url URL`: the whole server, one command, in
front of a real llama-server (the bundled kind of model exported to GGUF), driven by the
session API and the OpenAI SDK. Bad options are refused at start with a clear message.

Skipped, with the reason, only when no llama-server binary is found
(`scripts/build_llama_server.sh` builds and caches one; `.ci/run` calls it)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from prepos.backends.llama_server import LlamaServer, find_binary
from tests.support.server_harness import SRC, ServerProc

pytestmark = pytest.mark.slow

BINARY = find_binary()
SYSTEM = "You are a market analyst. Answer with one word."
Q = "What is the trend?"


@pytest.fixture(scope="module")
def llama(model_dirs, tmp_path_factory):
    if BINARY is None:
        pytest.skip("no llama-server binary: run scripts/build_llama_server.sh (or set "
                    "PREPOS_LLAMA_SERVER)")
    from prepos.backends.gguf_export import export

    root = tmp_path_factory.mktemp("serve-remote")
    gguf = export(model_dirs["chatml"], root / "model.gguf")
    srv = LlamaServer(BINARY, gguf, slots=4, log=root / "llama.log")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(model_dirs, llama, tmp_path_factory):
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-remote"),
                    "--backend", "llama-server", "--engine-url", llama.url) as srv:
        yield srv


def test_the_session_api_answers_from_the_engine(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        health = c.get("/health").json()
        assert health["status"] == "ok"
        hot = c.post("/sessions", json={"kind": "streaming", "system": SYSTEM,
                                        "standing_queries": [Q]}).json()["id"]
        base = c.post("/sessions", json={"kind": "streaming", "system": SYSTEM,
                                         "preposition": False}).json()["id"]
        for sid in (hot, base):
            r = c.post(f"/sessions/{sid}/append", json={"data": "AAPL 101.2 101.5 101.9"})
            assert r.status_code == 200, r.text
        for _ in range(8):
            if c.get(f"/sessions/{hot}", params={"wait_ready": 30}).json()["ready"]["done"]:
                break
        asked = {sid: c.post(f"/sessions/{sid}/query",
                             json={"question": Q, "max_tokens": 4}).json()
                 for sid in (hot, base)}
        assert asked[base]["path"] == "cold"
        assert asked[hot]["path"] == "fast" and asked[hot]["match"] == "exact"
        assert asked[hot]["tokens"][:1] == asked[base]["tokens"][:1]
        assert any(ln.startswith("prepos:requests_total{") and 'path="fast"' in ln
                   for ln in c.get("/metrics").text.splitlines())


def test_the_openai_sdk_streams_and_continues_a_conversation(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                           temperature=0)
    assert whole.choices[0].finish_reason in ("stop", "length")
    streamed = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                              temperature=0, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    assert text == whole.choices[0].message.content
    messages += [{"role": "assistant", "content": text},
                 {"role": "user", "content": "And tomorrow?"}]
    later = client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                           temperature=0)
    assert later.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("args, says", [
    (["--backend", "llama-server"], "needs --engine-url"),
    (["--engine-url", "http://127.0.0.1:1"], "--engine-url needs --backend"),
    (["--engine-model", "m"], "--engine-model needs --backend"),
    (["--background-gives-way"], "--background-gives-way needs --backend"),
])
def test_a_remote_backend_without_its_partner_option_is_refused(model_dirs, args, says):
    r = subprocess.run([sys.executable, "-m", "prepos.cli", "serve", "--model",
                        str(model_dirs["chatml"]), "--journal", "none", "--port", "0", *args],
                       capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and says in r.stderr, r.stderr
