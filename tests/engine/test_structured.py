"""Structured output (response_format): the format's checks, the mask over a model's logits,
answers on every path (cold, fall-through, the exact fast path from the cached logits, an
agentic turn) that parse and satisfy their schema, no relaxed answer under a format, the
refusal where a back end samples answers itself, and the OpenAI SDK's `parse` through a real
server. The tiny models answer garbage, so an answer that parses and conforms is the
grammar's doing."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
import torch
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from prepos.backends.remote import RemoteBackend, make_adapter
from prepos.chat.format import ChatFormat
from prepos.config import EngineConfig, GateConfig
from prepos.core import AnswerPath, Match, Request, SamplingParams
from prepos.decode.structured import Grammars
from prepos.engine import Engine
from prepos.engine.session import TURN, query_key
from prepos.errors import InvalidResponseFormat, InvalidSampling
from prepos.response_format import canonical, schema_of
from prepos.server.http.errors import status_of
from tests.support.helpers import promote
from tests.support.remote_fakes import FakeCluster, hash_logits
from tests.support.server_harness import ServerProc

SYSTEM = "You are a market analyst. Answer with one word."
Q = "What is the trend?"
SCHEMA = {"type": "object", "properties": {
    "trend": {"enum": ["up", "down", "flat"]},
    "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
    "note": {"type": "string", "maxLength": 6},
    "final": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["trend", "confidence", "note", "final", "tags"],
    "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "call", "schema": SCHEMA,
                                                 "strict": True}}
LONG = 160  # enough tokens for any answer SCHEMA admits (a 6-character string escaped)


def conforms(value, schema: dict) -> bool:
    """Whether `value` satisfies `schema`, for the keywords the tests' schemas use."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", ()))
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(conforms(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
                and all(conforms(v, schema.get("items", {})) for v in value))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "boolean":
        return isinstance(value, bool)
    return kind is None


def assert_conforms(res, schema=SCHEMA):
    assert res.finish_reason == "stop", (res.finish_reason, res.text)
    assert conforms(json.loads(res.text), schema), res.text


def streaming(eng, **kw):
    sid = eng.create_session("streaming", system=SYSTEM, **kw)
    eng.append(sid, "AAPL 101.2 101.5 101.9 102.4")
    eng.wait_idle()
    return sid


def structured(max_tokens=LONG, fmt=FORMAT, **kw) -> Request:
    return Request(SamplingParams(max_tokens=max_tokens, response_format=fmt, **kw))


# == the format ============================================================================
def test_formats_are_normalized_to_one_canonical_text():
    assert canonical({"type": "text"}) is None
    assert canonical({"type": "json_object"}) == '{"type":"json_object"}'
    canon = canonical(FORMAT)
    assert canonical(canon) == canon == canonical(json.dumps(FORMAT, indent=2))
    assert schema_of(canon) == SCHEMA
    assert list(schema_of(canon)["properties"]) == list(SCHEMA["properties"])  # order kept
    assert schema_of(canonical({"type": "json_object"})) == {"type": "object"}
    sp = SamplingParams(response_format=FORMAT)
    assert sp.response_format == canon and sp.shaped and not sp.greedy
    assert hash(sp) == hash(SamplingParams(response_format=canon))


@pytest.mark.parametrize("spec, says", [
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "schema must be"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": True}}, "schema must be"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "name"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "not": {}}}},
     "not"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string",
                                                        "format": "made-up"}}}, "made-up"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}, "objekt"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "http://x.example/s"}}},
     "x.example"),
    ([{"type": "json_object"}], "must be an object"),
    ("{not json", "not valid JSON"),
])
def test_formats_it_cannot_enforce_are_refused_naming_the_problem(spec, says):
    with pytest.raises(InvalidResponseFormat) as err:
        SamplingParams(response_format=spec)
    assert says in str(err.value) and err.value.param == "response_format"
    assert isinstance(err.value, InvalidSampling) and status_of(err.value) == 400


# == the mask ==============================================================================
def test_the_mask_covers_the_models_vocabulary_beyond_the_tokenizers(make_engine):
    eng = make_engine("chatml")
    n_tok = len(eng.fmt.tokenizer)
    n_model = max(eng.backend.vocab_size, n_tok) + 37  # a model's rows past the tokenizer's
    grammar = Grammars(eng.fmt).constraint(SamplingParams(response_format=FORMAT))
    logits = torch.randn(n_model)
    before = logits.clone()
    masked = grammar.mask(logits)
    assert torch.equal(logits, before)  # a new tensor: a cached record is never changed
    allowed = torch.isfinite(masked).nonzero().flatten().tolist()
    assert allowed and max(allowed) < n_tok
    assert all(eng.fmt.decode([t]).startswith("{") for t in allowed)
    assert torch.equal(masked[allowed], before[allowed])
    for t in eng.fmt.encode('{"trend":"up","confidence":7,"note":"","final":true,"tags":[]}'):
        assert torch.isfinite(grammar.mask(logits)[t])
        grammar.accept(t)
    assert grammar.finished


def test_compiled_formats_are_kept_in_a_bounded_lru(make_engine):
    eng = make_engine("chatml")
    grammars = Grammars(eng.fmt, capacity=2)
    formats = [{"type": "json_schema", "json_schema": {"schema": {"enum": [i]}}}
               for i in range(3)]
    for f in formats:
        assert grammars.constraint(SamplingParams(response_format=f)) is not None
    assert len(grammars) == 2
    assert grammars.constraint(SamplingParams()) is None
    two = grammars.constraint(SamplingParams(response_format=formats[2]))
    for t in eng.fmt.encode("2"):
        two.accept(t)
    assert two.finished  # a fresh matcher per answer, from the cached one


# == answers on every path =================================================================
def test_cold_answers_satisfy_the_schema(make_engine, family):
    eng = make_engine(family)
    sid = streaming(eng, preposition=False)
    res = eng.query(sid, Q, structured()).result()
    assert res.path is AnswerPath.COLD
    assert_conforms(res)
    plain = eng.query(sid, Q, Request(SamplingParams(max_tokens=LONG))).result()
    assert plain.text != res.text  # free text from the same state: the grammar's doing
    for seed in (1, 2, 3):  # sampled answers too (fall-through), the grammar before the choice
        assert_conforms(eng.query(sid, Q, structured(temperature=1.0, seed=seed)).result())


def test_any_json_object(make_engine):
    eng = make_engine("chatml")
    sid = streaming(eng)
    res = eng.query(sid, "Summarize.", structured(fmt={"type": "json_object"})).result()
    assert res.path is AnswerPath.FALL and res.text.startswith("{")
    if res.finish_reason == "stop":  # an open object may run to max_tokens on a tiny model
        assert isinstance(json.loads(res.text), dict)


def test_the_exact_fast_path_serves_a_structured_answer(make_engine, family):
    eng = make_engine(family)
    sid = streaming(eng, standing=[Q])
    rec = eng.session(sid).ready.records[query_key(Q)]
    first = Grammars(eng.fmt).constraint(SamplingParams(response_format=FORMAT))
    opening = torch.isfinite(first.mask(rec.logits))
    res = eng.query(sid, Q, structured()).result()
    assert res.path is AnswerPath.FAST and res.match is Match.EXACT
    assert_conforms(res)
    # the first token is the cached distribution's best among those the grammar allows
    assert res.tokens[0] == int(torch.argmax(rec.logits.float().masked_fill(~opening,
                                                                            float("-inf"))))
    if rec.argmax not in opening.nonzero().flatten().tolist():
        assert res.tokens[0] != rec.argmax  # the raw argmax was not JSON: masked away


def test_an_agentic_turn_from_the_fast_path_is_structured_and_committed(make_engine, family):
    eng = make_engine(family)
    sid = eng.create_session("agentic", system=SYSTEM)
    eng.add_message(sid, "user", "Report the trend as JSON.")
    eng.wait_idle()
    assert TURN in eng.session(sid).ready.records
    res = eng.turn(sid, None, structured()).result()
    assert res.path is AnswerPath.FAST and res.match is Match.EXACT
    assert_conforms(res)
    assert json.loads(eng.session(sid).snap.messages[-1]["content"]) == json.loads(res.text)


def test_a_structured_request_never_takes_the_relaxed_path(make_engine):
    eng = make_engine("chatml")
    sid = streaming(eng, fast_path="relaxed")
    header = eng.ready_header(sid)
    eng.set_gate(GateConfig(tau=header.gap - 1e-3, answers=(header.top_text,)))
    if header.argmax not in eng.gate.answer_ids:
        pytest.skip("the random model's argmax is not a whole-word token")
    promote(eng, "Is it rising?", header.argmax)
    plain = eng.query(sid, "Is it rising?", Request(SamplingParams(max_tokens=4))).result()
    assert plain.match is Match.RELAXED  # the gate fires for a free-text answer
    res = eng.query(sid, "Is it rising?", structured()).result()
    assert res.match is not Match.RELAXED and res.path is AnswerPath.FALL
    assert_conforms(res)


def test_a_back_end_that_samples_answers_itself_refuses_a_format(model_dirs):
    tok = AutoTokenizer.from_pretrained(str(model_dirs["chatml"]), local_files_only=True)
    cl = FakeCluster("vllm", hash_logits(len(tok)), ["a"])
    be = RemoteBackend(make_adapter("vllm"), cl.urls, len(tok), 2048, top_k=8,
                       health_interval=None, transport=cl.transport)
    with Engine(be, ChatFormat(tok), EngineConfig(gate=GateConfig(tau=0.0))) as eng:
        sid = eng.create_session("streaming", system=SYSTEM, preposition=False)
        before = eng.session(sid).version
        with pytest.raises(InvalidSampling, match="response_format"):
            eng.query(sid, Q, structured())
        assert eng.session(sid).version == before and not cl.replicas["a"].requests


# == the OpenAI SDK through the server =====================================================
class Call(BaseModel):
    trend: Literal["up", "down", "flat"]
    confidence: int = Field(ge=0, le=100)
    note: str = Field(max_length=6)
    final: bool


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    with ServerProc(model_dirs["chatml"], tmp_path_factory.mktemp("srv-structured")) as srv:
        yield srv


def test_the_sdk_parses_a_pydantic_model_stateless_and_from_the_fast_path(server, oai,
                                                                           model_dirs):
    model = model_dirs["chatml"].name
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q}]
    r = oai.chat.completions.parse(model=model, messages=msgs, response_format=Call,
                                   max_tokens=LONG)
    assert isinstance(r.choices[0].message.parsed, Call)
    assert r.choices[0].finish_reason == "stop"
    assert r.model_extra["prepos"]["path"] in ("cold", "fall-through")  # a new implicit session
    with httpx.Client(base_url=server.url, timeout=120) as http:
        sid = http.post("/sessions", json={"kind": "streaming", "system": SYSTEM,
                                           "standing_queries": [Q]}).json()["id"]
        http.post(f"/sessions/{sid}/append", json={"data": "AAPL 101.2 101.5 101.9"})
        http.get(f"/sessions/{sid}", params={"wait_ready": 30})
        # the session API takes the same response_format
        r = http.post(f"/sessions/{sid}/query", json={"question": Q, "max_tokens": LONG,
                                                       "response_format": FORMAT}).json()
        assert r["path"] == "fast" and r["finish_reason"] == "stop"
        assert conforms(json.loads(r["text"]), SCHEMA)
        bad = http.post(f"/sessions/{sid}/query", json={"question": Q, "response_format": {
            "type": "json_schema", "json_schema": {"schema": {"not": {}}}}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    fast = oai.chat.completions.parse(model=model, messages=msgs, response_format=Call,
                                      max_tokens=LONG, extra_body={"session_id": sid})
    assert isinstance(fast.choices[0].message.parsed, Call)
    assert fast.model_extra["prepos"]["path"] == "fast"
    obj = oai.chat.completions.create(model=model, messages=msgs, max_tokens=LONG,
                                      response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")


def test_the_server_refuses_what_it_cannot_enforce_naming_response_format(oai, model_dirs):
    model = model_dirs["chatml"].name
    msgs = [{"role": "user", "content": Q}]
    bad = [{"type": "yaml"},
           {"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}},
           {"type": "json_schema", "json_schema": {"name": "x", "schema": {
               "type": "array", "uniqueItems": True}}}]
    for spec in bad:
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=model, messages=msgs, response_format=spec)
        assert err.value.body["param"] == "response_format", spec
        assert err.value.body["code"] == "invalid_request"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model, messages=msgs, tools=tools,
                                    tool_choice="required",
                                    response_format={"type": "json_object"})
    assert err.value.body["param"] == "response_format"
