"""What one API key's traffic may show or change for another: the relaxed path's class
evidence is each owner's own (its statistics, answer sets and promotion), `/metrics` names no
question and can need a key, `/v1/models` names no path, a Responses item's role is checked
by type, and an open server on a non-loopback address says what it shares."""

from __future__ import annotations

import os

import httpx
import pytest

from prepos.config import EngineConfig, GateConfig, RelaxedConfig
from prepos.core import Match, Request, SamplingParams
from prepos.engine import Engine
from prepos.gate.question_class import classify
from prepos.gate.relaxed import PROBATION, PROMOTED, ClassGate
from tests.support.server_harness import ServerProc

ONE = Request(SamplingParams(max_tokens=1))
UP = 11  # a token id, as far as a ClassGate is concerned


# -- the class gate ------------------------------------------------------------------------
def test_class_evidence_and_its_bounds_are_each_owner_s():
    gate = ClassGate(RelaxedConfig(start="cold", min_verified=3, r_max=0.6, max_classes=2,
                                   session_pending=8, owner_pending=1))
    gate.decide("a1", "c", None, UP, owner="A")
    for _ in range(3):
        gate.evidence("c", False, UP, owner="A")
    assert gate.status("c", owner="A") == PROMOTED
    assert gate.status("c", owner="B") == PROBATION  # A's verdicts are not B's
    assert not gate.decide("b1", "c", None, UP, owner="B").serve  # B's answer set is empty
    assert gate.decide("a1", "c", None, UP, owner="A").verify  # served: a check booked
    gate.settle("a1", owner="A")
    ids = [gate.decide("a3", "c", None, UP, owner="A").answer_id for _ in range(2)]
    assert len(os.path.commonprefix(ids)) < 10  # random: a sequence counts others' answers
    gate.settle("a3", owner="A")  # the first booked a check; A's budget (1) left none
    for cls in ("x", "y", "z"):  # B's classes fill B's room, never A's
        gate.decide("b1", cls, None, UP, owner="B")
    assert gate.status("c", owner="A") == PROMOTED
    assert gate.book_evidence("b1", owner="B")  # B's verification budget is its own
    assert not gate.book_evidence("b2", owner="B")
    assert gate.book_evidence("a2", owner="A")
    rx = gate.metrics()
    assert rx["classes"] == {"promoted": 1, "probation": 2, "demoted": 0}
    assert "'c'" not in repr(rx) and "'x'" not in repr(rx)  # counted, never named


# -- through the engine --------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(model_dirs):
    eng = Engine.from_pretrained(model_dirs["chatml"], EngineConfig(
        backend="torch", threads=2, chunk_tokens=4,
        relaxed=RelaxedConfig(start="cold", min_verified=3, r_max=0.6, session_pending=64)))
    vocab = eng.fmt.tokenizer.batch_decode([[i] for i in range(len(eng.fmt.tokenizer))])
    eng.set_gate(GateConfig(tau=-1.0, answers=tuple({t.strip() for t in vocab if t.strip()})))
    yield eng
    eng.close()


QUESTION = "Is it rising?"  # on this model and data, the full path agrees with the header


def session(eng, owner: str) -> str:
    sid = eng.create_session("streaming", system="Market.", fast_path="relaxed", owner=owner)
    eng.append(sid, "AAPL 101.2 101.5 101.9 102.4")
    eng.wait_idle()
    return sid


def ask(eng, sid: str):
    res = eng.query(sid, QUESTION, ONE).result()
    eng.wait_idle()
    return res


def test_one_key_s_agreements_never_serve_another_key_relaxed(engine):
    eng = engine
    cls = classify(QUESTION)
    a, b = session(eng, "key-a"), session(eng, "key-b")
    try:
        for _ in range(2):  # A's full answers: two agreeing verdicts, A's class still cold
            assert ask(eng, a).match is not Match.RELAXED
        assert eng.info(a)["relaxed"]["classes"][cls]["verified"] == 2
        assert eng.info(b)["relaxed"]["classes"] == {}
        assert ask(eng, b).match is not Match.RELAXED
        seen = eng.info(b)["relaxed"]["classes"][cls]  # B's own ask alone, not A's two
        assert (seen["verified"], seen["withheld"], seen["agreements_total"]) == (1, 1, 1)
        for _ in range(2):  # B's agreements promote B's class ...
            ask(eng, b)
        assert eng.info(b)["relaxed"]["classes"][cls]["status"] == PROMOTED
        assert ask(eng, b).match is Match.RELAXED
        res = ask(eng, a)  # ... and never A's: A has two verdicts of its own
        assert res.match is not Match.RELAXED and res.answer_id is None
        mine = eng.info(a)["relaxed"]["classes"][cls]
        assert (mine["verified"], mine["served"], mine["withheld"]) == (3, 0, 3)
        assert QUESTION.lower().rstrip("?") not in repr(eng.metrics())
    finally:
        eng.close_session(a)
        eng.close_session(b)


# -- over HTTP -----------------------------------------------------------------------------
KEY_A, KEY_B, SCRAPE = "tenant-a", "tenant-b", "scraper"
MERGER = "will alice's merger with bob corp close next week?"
RISING = ["ACME 31 32 34 35 37 38", "ACME 40 41 43 44 46 48", "ACME 49 51 52 54 55 57"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from prepos.paths import DEFAULT_MODEL

    with ServerProc(DEFAULT_MODEL, tmp_path_factory.mktemp("tenants"), "--host", "0.0.0.0",
                    "--api-key", KEY_A, "--api-key", KEY_B, "--metrics-key", SCRAPE,
                    "--relaxed-start", "serve") as srv:
        yield srv


def client(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=120,
                        headers={"Authorization": f"Bearer {key}"})


def relaxed_session(c: httpx.Client) -> str:
    from prepos.lab.task.market import SYSTEM_PROMPT

    r = c.post("/sessions", json={"kind": "streaming", "system": SYSTEM_PROMPT,
                                  "fast_path": "relaxed"})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    for d in RISING:
        assert c.post(f"/sessions/{sid}/append", json={"data": d}).is_success
    assert c.get(f"/sessions/{sid}", params={"wait_ready": 30}).json()["ready"]["done"]
    return sid


def test_two_keys_see_only_their_own_class_and_metrics_name_no_question(server):
    with client(server, KEY_A) as a, client(server, KEY_B) as b:
        sa, sb = relaxed_session(a), relaxed_session(b)
        for _ in range(2):
            r = a.post(f"/sessions/{sa}/query", json={"question": MERGER, "max_tokens": 1})
            assert r.status_code == 200, r.text
        cls = classify(MERGER)
        mine = a.get(f"/sessions/{sa}").json()["relaxed"]["classes"][cls]
        assert mine["withheld"] + mine["served"] == 2
        r = b.post(f"/sessions/{sb}/query", json={"question": MERGER, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["match"] != "relaxed"  # B starts empty
        seen = b.get(f"/sessions/{sb}").json()["relaxed"]["classes"][cls]
        assert (seen["verified"], seen["withheld"], seen["served"]) == (1, 1, 0)

        assert httpx.get(server.url + "/metrics").status_code == 401
        assert a.get("/metrics").status_code == 401  # an API key is not the metrics key
        r = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with client(server, SCRAPE) as m:
            r = m.get("/metrics")
        assert r.status_code == 200
        assert "prepos:relaxed_classes{" in r.text
        labels = [line[line.index("{"):line.rindex("}")] for line in r.text.splitlines()
                  if "{" in line and not line.startswith("#")]
        for word in ("alice", "merger", "bob", "corp", "week"):
            assert not any(word in lab for lab in labels), word


def test_models_name_the_model_not_its_path(server):
    from prepos.paths import DEFAULT_MODEL

    with client(server, KEY_A) as a:
        listed = a.get("/v1/models").json()["data"][0]
        one = a.get(f"/v1/models/{listed['id']}")
    assert one.status_code == 200 and one.json() == listed
    assert listed["id"] == listed["root"] == DEFAULT_MODEL.name
    assert str(DEFAULT_MODEL.parent) not in one.text and "/" not in listed["root"]


@pytest.mark.parametrize("role", [["user"], 1, {"r": "user"}, None, True])
def test_a_responses_item_role_of_another_type_is_a_400(server, role):
    with client(server, KEY_A) as a:
        r = a.post("/v1/responses", json={"model": "trend-reader", "input": [
            {"type": "message", "role": role, "content": "hi"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input[0].role"


def test_the_warning_of_an_open_server_on_a_non_loopback_address(server, model_dirs,
                                                                 tmp_path):
    from prepos.server.http.auth import open_warning

    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.1.2.3"):
        assert open_warning(host, ()) is None, host
    for host in ("0.0.0.0", "::", "192.168.1.4", "example.com"):
        assert "same owner" in open_warning(host, ()), host
    assert open_warning("0.0.0.0", ("k",)) is None
    assert "no API keys" not in server.tail(100_000)  # with keys: none
    with ServerProc(model_dirs["chatml"], tmp_path / "open", "--host", "0.0.0.0") as srv:
        log = srv.tail()
    assert "no API keys and listening on 0.0.0.0" in log and "stored responses" in log


# -- session names ---------------------------------------------------------------------------
def test_two_keys_each_make_a_session_of_one_name_and_learn_nothing_of_the_other(
        model_dirs, tmp_path):
    """A name is in its key's namespace: key B asking for a session named as key A's gets
    what it would get had A none (a 404, then a 201 making its own), never 409; the two
    sessions stay apart, each shown by the bare name, through a restart on the journal."""
    journal = tmp_path / "journal.sqlite"
    args = ("--api-key", KEY_A, "--api-key", KEY_B)
    with ServerProc(model_dirs["chatml"], tmp_path / "one", *args, journal=journal) as srv, \
            client(srv, KEY_A) as a, client(srv, KEY_B) as b:
        r = a.post("/sessions", json={"kind": "streaming"}, headers={"x-session-id": "orders"})
        assert r.status_code == 201 and r.json()["id"] == "orders"
        assert a.post("/sessions", json={"kind": "streaming", "session_id": "orders"}
                      ).status_code == 409  # the caller's own: it exists
        assert b.get("/sessions/orders").status_code == 404
        r = b.post("/sessions", json={"kind": "agentic"}, headers={"x-session-id": "orders"})
        assert r.status_code == 201, r.text
        assert r.json()["id"] == "orders" and r.headers["location"] == "/sessions/orders"
        assert r.headers["x-session-id"] == "orders" and r.json()["kind"] == "agentic"
        r = a.post("/sessions/orders/append", json={"data": "AAPL 101"})
        assert r.status_code == 200 and r.json() == {**r.json(), "session_id": "orders",
                                                      "version": 1}
        r = b.post("/sessions/orders/messages", json={"role": "user", "content": "hi"})
        assert r.status_code == 200, r.text
        assert r.headers["x-session-id"] == "orders"
        r = b.post("/v1/chat/completions", headers={"x-session-id": "orders"}, json={
            "model": "chatml-llama", "max_tokens": 1, "messages": [
                {"role": "user", "content": "hi"}, {"role": "user", "content": "more"}]})
        assert r.status_code == 200, r.text
        assert r.json()["prepos"]["session_id"] == "orders"
        assert [s["id"] for s in a.get("/sessions").json()["data"]] == ["orders"]
        assert [s["id"] for s in b.get("/sessions").json()["data"]] == ["orders"]
        ia, ib = a.get("/sessions/orders").json(), b.get("/sessions/orders").json()
        assert (ia["kind"], ia["version"], ia["id"]) == ("streaming", 1, "orders")
        assert ib["kind"] == "agentic" and ib["id"] == "orders"
        versions = (ia["version"], ib["version"])
        r = a.post("/sessions/orders/query", json={"question": "trend?", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["session_id"] == "orders"
    with ServerProc(model_dirs["chatml"], tmp_path / "two", *args, journal=journal) as srv, \
            client(srv, KEY_A) as a, client(srv, KEY_B) as b:
        ia, ib = a.get("/sessions/orders").json(), b.get("/sessions/orders").json()
        assert (ia["kind"], ib["kind"]) == ("streaming", "agentic")
        assert (ia["version"], ib["version"]) == versions
        assert a.delete("/sessions/orders").json() == {"session_id": "orders", "closed": True}
        assert a.get("/sessions/orders").status_code == 404
        assert b.get("/sessions/orders").json()["version"] == versions[1]
