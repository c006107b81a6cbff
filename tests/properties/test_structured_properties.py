"""Every structured-output request is a 4xx naming the problem (a code) or a valid answer,
never a 5xx: random JSON Schemas (valid, unsupported and malformed, property names and
values holding markup strings and any Unicode) as `response_format` or as tools' parameters
under every `tool_choice`, with random `max_tokens`, streamed or not, on each in-process
back end, over a model whose `<tool_call>` is an added token that is not special.

`PREPOS_STRUCTURED_EXAMPLES` sets the examples per back end (default 40, a CI run of about a
minute); the counts of each outcome are printed (`pytest -s`)."""

from __future__ import annotations

import json
import os
from collections import Counter

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prepos.config import EngineConfig
from prepos.lab.tiny import build_model
from tests.support.helpers import loaded_app
from tests.support.models import BACKENDS, backend_config

EXAMPLES = int(os.environ.get("PREPOS_STRUCTURED_EXAMPLES", "40"))
MARKUP = ["<tool_call>", "</tool_call>", "<|im_end|>", "<|im_start|>", "\U000F0000"]

names = st.one_of(st.sampled_from(["a", "b", "id", *MARKUP]),
                  st.text(st.characters(exclude_categories=("Cs",)), max_size=5))
values = st.one_of(names, st.integers(-3, 3), st.booleans(), st.none())
leaf = st.one_of(
    st.sampled_from([{"type": "string"}, {"type": "number"}, {"type": "boolean"},
                     {"type": "null"}, {}, {"type": "string", "format": "date"},
                     {"type": "string", "pattern": "^[a-c]{1,3}$"},
                     # unsupported or malformed: refused, or ignored where lenient
                     {"type": "banana"}, {"minimum": "x"}, {"type": "string", "pattern": "("},
                     {"type": "array", "uniqueItems": True}, {"not": {"type": "null"}},
                     {"$ref": "#/nowhere"}, {"type": "string", "format": "no-such"}]),
    st.builds(lambda n, m: {"type": "string", "minLength": n, "maxLength": n + m},
              st.integers(0, 3), st.integers(0, 3)),
    st.builds(lambda lo, d: {"type": "integer", "minimum": lo, "maximum": lo + d},
              st.integers(-5, 5), st.integers(-1, 6)),
    st.builds(lambda xs: {"enum": xs}, st.lists(values, max_size=3)),
    st.builds(lambda v: {"const": v}, values),
)


def _object(props: dict, required: bool, closed: bool) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required else [], "additionalProperties": not closed}


schemas = st.recursive(leaf, lambda inner: st.one_of(
    st.builds(_object, st.dictionaries(names, inner, max_size=3), st.booleans(),
              st.booleans()),
    st.builds(lambda it, lo: {"type": "array", "items": it, "minItems": lo,
                              "maxItems": lo + 2}, inner, st.integers(0, 2)),
    st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=2)),
), max_leaves=5)
objects = st.builds(_object, st.dictionaries(names, schemas, max_size=3), st.booleans(),
                    st.booleans())
tools = st.lists(st.builds(
    lambda name, params, strict: {"type": "function", "function": {
        "name": name, "parameters": params, **({"strict": strict} if strict is not None
                                               else {})}},
    st.sampled_from(["f", "get_price", "note"]), st.one_of(objects, schemas),
    st.sampled_from([None, True, False])), min_size=1, max_size=3,
    unique_by=lambda t: t["function"]["name"])


@st.composite
def requests(draw) -> dict:
    body: dict = {"max_tokens": draw(st.integers(1, 48)), "stream": draw(st.booleans()),
                  "messages": [{"role": "user", "content": draw(st.sampled_from(
                      ["Give me JSON.", "Call a tool for <tool_call>.", "x"]))}]}
    if draw(st.booleans()):
        kind = draw(st.sampled_from(["json_object", "json_schema"]))
        fmt: dict = {"type": kind}
        if kind == "json_schema":
            fmt["json_schema"] = {"name": "out", "schema": draw(st.one_of(objects, schemas))}
        body["response_format"] = fmt
        return body
    body["tools"] = draw(tools)
    names_ = [t["function"]["name"] for t in body["tools"]]
    body["tool_choice"] = draw(st.sampled_from(
        ["auto", "none", "required", *({"type": "function", "function": {"name": n}}
                                       for n in names_)]))
    parallel = draw(st.sampled_from([None, True, False]))
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return body


@pytest.fixture(scope="module", params=[b for b in BACKENDS if "/" not in b])
def client(request, tmp_path_factory):

    from prepos.server.http.app import create_app
    from prepos.server.http.state import ServerConfig

    cfg = backend_config(request.param)
    model = build_model(tmp_path_factory.mktemp("qwen") / "qwen-qwen2", "qwen", "qwen2", seed=1)
    app = create_app(ServerConfig(model=model, engine=EngineConfig(threads=2, **cfg)))
    with loaded_app(app) as c:
        c.model_name = model.name
        c.backend_name = request.param
        yield c


def _chunks(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def check(client, body: dict, seen: Counter) -> None:
    r = client.post("/v1/chat/completions", json={"model": client.model_name, **body})
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["code"] and err["message"], r.text
        seen[f"{r.status_code} {err['code']}"] += 1
        return
    if body["stream"]:
        chunks = _chunks(r.text)
        assert not any("error" in c for c in chunks), (body, r.text)
        last = [c for c in chunks if c["choices"]][-1]["choices"][0]
        finish, msg = last["finish_reason"], last["delta"]
    else:
        choice = r.json()["choices"][0]
        finish, msg = choice["finish_reason"], choice["message"]
    assert finish in ("stop", "length", "tool_calls"), r.text
    seen[f"200 {finish}"] += 1
    fmt = body.get("response_format")
    if fmt and not body["stream"] and finish == "stop":
        value = json.loads(msg["content"])  # a whole answer is valid JSON of the schema
        schema = fmt.get("json_schema", {}).get("schema", {"type": "object"})
        jsonschema.validate(value, schema)
    forced = body.get("tool_choice") not in (None, "auto", "none")
    if forced:
        assert "<tool_call>" not in (msg.get("content") or ""), r.text
    if forced and finish == "tool_calls":
        named = body["tool_choice"]
        for call in msg["tool_calls"]:
            assert named == "required" or call["function"]["name"] == \
                named["function"]["name"]
            json.loads(call["function"]["arguments"])
        if body.get("parallel_tool_calls") is False:
            assert len(msg["tool_calls"]) == 1


def test_structured_requests_are_a_4xx_or_a_valid_answer(client):
    seen: Counter = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests())
    def run(body):
        check(client, body, seen)

    run()
    print(f"\n{client.backend_name}: {sum(seen.values())} requests, "
          f"{json.dumps(dict(sorted(seen.items())))}")
    assert sum(v for k, v in seen.items() if k.startswith("200")) > 0
