"""`/openapi.json`: an OpenAPI 3.1 document of every route, written from the route registry
(`server/http/routing.py`): each operation's path and query parameters, request body, success
body (JSON, or server-sent events described event by event), and the error responses, all
of the one error shape of `server/http/errors.py` (the Messages API's in Anthropic's,
`Doc.error_body`). Schemas come from the pydantic models of `server/http/request_bodies.py`
(requests) and `server/http/response_bodies.py` (responses), as `components/schemas` referenced by
`$ref`.

A server-sent event stream is described the way OpenAPI 3.2 reads a `text/event-stream`
schema before `itemSchema`: the schema of one event, an object with `event` (its name) and
`data` (a string; JSON data names its schema with `contentMediaType` and `contentSchema`).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from prepos.server.http import idempotency
from prepos.server.http import response_bodies as responses
from prepos.server.http.routing import Doc, Registered

REF = "#/components/schemas/{model}"
PATH_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")
PATH_DOC = {"sid": "a session id, as POST /sessions returned it",
            "model_id": "a model id, as GET /v1/models lists it"}
ERRORS = {400: "the request is invalid: the error names the field and the problem",
          401: "a key is required (the server was started with API keys) and none or a "
               "wrong one was sent",
          404: "no such session for this key, or no such model",
          409: "the session is of the other kind, or its state conflicts with the request",
          403: "a web page's request: its Host or Origin is not one this server takes "
               "(--allowed-hosts, --allowed-origins)",
          413: "the body is over the server's size limit",
          415: "the body is not JSON (send Content-Type: application/json)",
          422: "this Idempotency-Key was used for another request",
          429: "the server's queue or session limit is full; retry after `Retry-After`",
          503: "the model is loading (retry after `Retry-After`) or failed to load",
          529: "the model is loading or the server is overloaded (Anthropic's "
               "`overloaded_error`; retry after `Retry-After`)"}


def document(registered: Iterable[Registered], title: str, version: str,
             description: str = "") -> dict:
    """The OpenAPI document of these routes."""
    registered = list(registered)
    components = _Components()
    paths: dict[str, dict] = {}
    for r in sorted(registered, key=lambda r: (r.path, r.method)):
        path = PATH_PARAM.sub(r"{\1}", r.path)
        paths.setdefault(path, {})[r.method.lower()] = _operation(r, components)
    return {"openapi": "3.1.0",
            "info": {"title": title, "version": version, "description": description},
            "paths": paths,
            "components": {"schemas": components.schemas(),
                           "securitySchemes": {"bearer": {
                               "type": "http", "scheme": "bearer",
                               "description": "an API key, where the server has any"}}}}


def install(app, registered: Iterable[Registered]) -> None:
    """Make `app.openapi()` (what FastAPI serves as `/openapi.json`) this document."""
    registered = list(registered)
    app.state.api_routes = registered  # what the document is written from
    cache: list[dict] = []

    def openapi() -> dict:
        if not cache:
            cache.append(document(registered, app.title, app.version, app.description))
        return cache[0]

    app.openapi = openapi


def path_params(path: str) -> list[str]:
    return PATH_PARAM.findall(path)


class _Components:
    """The models every operation names, turned into `components/schemas` at the end."""

    def __init__(self) -> None:
        self.models: dict[tuple[type[BaseModel], str], None] = {}

    def ref(self, model: type[BaseModel], mode: str = "serialization") -> dict:
        self.models[(model, mode)] = None
        return {"$ref": REF.format(model=model.__name__)}

    def schemas(self) -> dict:
        refs, top = models_json_schema(list(self.models), ref_template=REF)
        names = {model.__name__ for model, _ in self.models}
        defs = dict(top.get("$defs", {}))
        if names - defs.keys():
            raise ValueError(f"models named twice or renamed: {sorted(names - defs.keys())}")
        return dict(sorted(defs.items()))

    def schema(self, spec: Any, mode: str = "serialization") -> dict:
        """A model as a `$ref`, a JSON schema as itself."""
        if isinstance(spec, type) and issubclass(spec, BaseModel):
            return self.ref(spec, mode)
        return dict(spec)


def _operation(r: Registered, c: _Components) -> dict:
    doc = r.doc
    op: dict[str, Any] = {"operationId": getattr(r.fn, "__name__", r.method.lower()),
                          "summary": doc.summary}
    if doc.description or r.fn.__doc__:
        op["description"] = doc.description or _dedent(r.fn.__doc__)
    if doc.tags:
        op["tags"] = list(doc.tags)
    params = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"},
               "description": PATH_DOC.get(n, n)} for n in path_params(r.path)]
    params += [{"name": q.name, "in": "query", "required": False, "schema": dict(q.schema),
                "description": q.description} for q in doc.query]
    if getattr(r.fn, "idempotent", False):
        params.append(dict(idempotency.PARAMETER))
    if params:
        op["parameters"] = params
    if doc.body is not None:
        op["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": c.schema(doc.body, "validation")}}}
    op["responses"] = _responses(r, doc, c)
    if not doc.public:
        op["security"] = [{}, {"bearer": []}]  # a key only where the server has keys
    return op


def _responses(r: Registered, doc: Doc, c: _Components) -> dict:
    content: dict[str, Any] = {}
    if doc.response is not None:
        content[doc.media] = {"schema": c.schema(doc.response)}
    if doc.events is not None:
        content["text/event-stream"] = {"schema": _events(doc.events, c)}
    out: dict[str, Any] = {str(doc.status): {"description": doc.summary or "success",
                                             "content": content}}
    for status, body in (doc.others or {}).items():
        out[str(status)] = {"description": ERRORS.get(status, "see the body"),
                            "content": {"application/json": {"schema": c.schema(body)}}}
    error = {"application/json": {"schema": c.schema(doc.error_body or responses.ErrorBody)}}
    for status in sorted(_error_statuses(r, doc) - {int(s) for s in out}):
        out[str(status)] = {"description": ERRORS.get(status, "an error"), "content": error}
    return out


def _error_statuses(r: Registered, doc: Doc) -> set[int]:
    statuses = set(doc.errors) | {403}  # `cross_site.py`: every request's Host
    if not doc.public:
        statuses |= {401, 503}
    if doc.body is not None:
        statuses |= {400, 413}
    if r.method not in ("GET", "HEAD", "OPTIONS"):
        statuses |= {400, 415}  # a body that is not JSON; an Idempotency-Key not taken
    if getattr(r.fn, "idempotent", False):
        statuses |= {409, 422}  # the key's first request still running; used for another
    if doc.query:
        statuses.add(400)
    if path_params(r.path):
        statuses.add(404)
    return statuses


def _events(events: Mapping[str, Any], c: _Components) -> dict:
    """One event of the stream: which names it may have, and each one's data."""
    return {"oneOf": [{"type": "object", "required": ["event", "data"],
                       "properties": {"event": {"const": name}, "data": _data(data, c)}}
                      for name, data in events.items()]}


def _data(spec: Any, c: _Components) -> dict:
    if isinstance(spec, tuple):
        return {"anyOf": [_data(s, c) for s in spec]}
    if isinstance(spec, str):
        return {"const": spec}
    return {"type": "string", "contentMediaType": "application/json",
            "contentSchema": c.schema(spec)}


def _dedent(text: str) -> str:
    return inspect.cleandoc(text)
