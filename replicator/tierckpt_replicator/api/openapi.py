"""The OpenAPI document of the control API, from the endpoint table and the messages' JSON Schemas.

Each route keeps reading its own raw body (the byte limit is enforced before parsing), so FastAPI
knows nothing of the bodies; the document gets them through each route's ``openapi_extra`` (request
body, path and query parameters, security) and ``responses`` (every status of the table, with the
message's schema from ``tierckpt.protocol.codec.json_schema``). The messages and the records nested in
them are ``components/schemas``. Served at ``GET /v1/openapi.json`` to authenticated callers; there is
no interactive documentation.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tierckpt.protocol import api
from tierckpt.protocol.codec import Message, json_schema

__all__ = ["components", "install_openapi", "route_docs"]

_REF = "#/components/schemas/"
_SECURITY = {"tls": "mutualTLS", "token": "bearerToken"}
_SCHEMES: dict[str, dict[str, Any]] = {
    "tls": {
        "type": "mutualTLS",
        "description": "a client certificate of the tierckpt CA naming the operator or a node "
        "(spiffe://tierckpt.io/operator, spiffe://tierckpt.io/node/<node>); docs/security.md",
    },
    "token": {
        "type": "http",
        "scheme": "bearer",
        "description": "the content of the replicator's --token-file",
    },
}
_ERROR = {
    "type": "object",
    "properties": {"detail": {"type": "string", "description": "why the request was refused"}},
    "required": ["detail"],
}
_PROBE = {
    "type": "object",
    "properties": {"status": {"type": "string", "enum": ["ok", "unavailable"]}},
    "required": ["status"],
}
_OTHER_BODIES: dict[str, dict[str, Any]] = {
    "healthz": _PROBE,
    "readyz": _PROBE,
    "openapi": {"type": "object", "description": "an OpenAPI 3.1 document"},
    "metrics": {"type": "string", "description": "Prometheus text exposition format"},
    "job_metrics": {"type": "string", "description": "Prometheus text exposition format"},
}


def _messages() -> list[type[Message]]:
    seen: list[type[Message]] = []
    for ep in api.ENDPOINTS:
        for cls in (ep.request, ep.response):
            if cls is not None and cls not in seen:
                seen.append(cls)
    return seen


def _relocate(node: Any, renamed: dict[str, str] | None = None) -> Any:
    """A schema with its ``#/$defs/X`` references pointing at ``#/components/schemas/X`` (or at the name
    ``renamed`` gives X)."""
    renamed = renamed or {}
    if isinstance(node, dict):
        return {
            k: (
                _REF + renamed.get(name := v.removeprefix("#/$defs/"), name)
                if k == "$ref" and isinstance(v, str)
                else _relocate(v, renamed)
            )
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_relocate(v, renamed) for v in node]
    return node


def components() -> dict[str, dict[str, Any]]:
    """Every message of the API and every record nested in one, by class name. A message nested in
    another (a ``NodePlan``'s parts) travels without its kind and version: its schema there is
    ``<Name>Fields``."""
    out: dict[str, dict[str, Any]] = {}
    messages = _messages()
    names = {cls.__name__ for cls in messages}
    for cls in messages:
        schema = json_schema(cls)
        defs = schema.pop("$defs", {})
        renamed = {name: f"{name}Fields" for name in defs if name in names}
        for name, sub in [*defs.items(), (cls.__name__, schema)]:
            sub = _relocate(sub, renamed)
            if out.setdefault(renamed.get(name, name), sub) != sub:
                raise AssertionError(f"two different schemas are both called {name}")
    return out


def _body(schema: dict[str, Any], media_type: str = "application/json") -> dict[str, Any]:
    return {"content": {media_type: {"schema": schema}}}


def route_docs(ep: api.Endpoint, auth: str = "token") -> dict[str, Any]:
    """``responses`` and ``openapi_extra`` for ``ep``'s route."""
    if ep.response is not None:
        ok = _body({"$ref": _REF + ep.response.__name__})
    else:
        ok = _body(_OTHER_BODIES[ep.name], ep.media_type)
    responses: dict[int | str, dict[str, Any]] = {
        ep.status: {"description": api.STATUS_MEANINGS[ep.status], **ok}
    }
    for code in ep.errors:
        body = _PROBE if ep.name == "readyz" else _ERROR
        responses[code] = {"description": api.STATUS_MEANINGS[code], **_body(body)}
    extra: dict[str, Any] = {"operationId": ep.name}
    params = [
        {
            "name": p,
            "in": "path",
            "required": True,
            "description": api.PATH_PARAMS[p].description,
            "schema": {"type": "string", "pattern": api.PATH_PARAMS[p].pattern},
        }
        for p in ep.path_params
    ]
    params += [
        {
            "name": q.name,
            "in": "query",
            "required": False,
            "description": q.description,
            "schema": {"type": "boolean", "default": False},
        }
        for q in ep.query
    ]
    if params:
        extra["parameters"] = params
    if ep.request is not None:
        extra["requestBody"] = {"required": True, **_body({"$ref": _REF + ep.request.__name__})}
    extra["security"] = [{_SECURITY[auth]: []}] if ep.auth else []
    return {"responses": responses, "openapi_extra": extra}


def install_openapi(app: FastAPI, auth: str = "token") -> None:
    """``app.openapi()`` builds (once) the document of the app's routes, with the message schemas."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title,
                version=app.version,
                description="The tierckpt replicator's control API (docs/replicator.md).",
                routes=app.routes,
            )
            parts = doc.setdefault("components", {})
            parts.setdefault("schemas", {}).update(components())
            parts["securitySchemes"] = {_SECURITY[auth]: _SCHEMES[auth]}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
