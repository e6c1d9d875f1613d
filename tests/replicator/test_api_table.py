"""The replicator serves exactly the endpoint table (``tierckpt.protocol.api``), documents it in an
OpenAPI document behind the token, and ``docs/replicator.md`` describes every endpoint."""

from __future__ import annotations

import json
import re
import typing
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from fastapi.routing import APIRoute

from tierckpt.protocol.api import ENDPOINTS, STATUS_MEANINGS, Port, served_on
from tierckpt.protocol.codec import Message
from tierckpt.protocol.control import (
    BackupResult,
    JobPolicy,
    NodeInventory,
    PeerAssignment,
    PeerNode,
    PurgeResult,
    RankHoldings,
    RestoreAccepted,
    RestorePlan,
    Tier,
)
from tierckpt_replicator.daemon import Daemon
from tierckpt_replicator.settings import Settings

TOKEN = "table-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DOC = Path(__file__).resolve().parents[2] / "docs" / "replicator.md"


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    root = tmp_path / "ramdisk"
    root.mkdir()
    d = Daemon(Settings(node_name="n", root=root, auth="token", token_file=token, advertise_host="127.0.0.1"))
    yield d
    await d.shutdown()


@pytest.fixture
async def http(daemon: Daemon) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=daemon.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replicator") as client:
        yield client


@pytest.mark.parametrize("port", ["api", "probes"])
def test_the_app_serves_exactly_the_table(daemon: Daemon, port: Port):
    app = daemon.app if port == "api" else daemon.probe_app
    served = served_on(port)
    routes = [r for r in app.routes if isinstance(r, APIRoute)]
    assert sorted((m, r.path) for r in routes for m in r.methods) == sorted(
        (ep.method, ep.path) for ep in served
    )
    assert len(routes) == len(served)  # nothing else: no docs UI, no default /openapi.json
    by_name = {r.name: r for r in routes}
    for ep in served:
        route = by_name[ep.name]
        assert (route.path, route.methods, route.status_code) == (ep.path, {ep.method}, ep.status)
        handler = route.endpoint.handler  # type: ignore[attr-defined]
        declared = typing.get_type_hints(handler)["return"]
        if ep.response is not None:
            assert declared is ep.response, ep.name  # the handler returns the table's message
        params = set(typing.get_type_hints(handler)) - {"request", "return"}
        assert params == {*ep.path_params, *(q.name for q in ep.query)}, ep.name


async def test_openapi_document_needs_the_token(http: httpx.AsyncClient):
    assert (await http.get("/v1/openapi.json")).status_code == 401
    resp = await http.get("/v1/openapi.json", headers={"Authorization": "Bearer wrong"})
    assert resp.status_code == 403
    for hidden in ("/openapi.json", "/docs", "/redoc", "/v1/docs"):
        assert (await http.get(hidden, headers=AUTH)).status_code == 404


def _validator(doc: dict[str, Any], name: str) -> jsonschema.Draft202012Validator:
    """A validator for ``components/schemas/<name>``, its references resolved inside ``doc``."""
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _samples() -> list[Message]:
    job = "team_train_1234abcd"
    nodes = {"a": PeerNode("a", "http://10.0.0.1:8470", "zone-a"), "b": PeerNode("b", "http://10.0.0.2:8470")}
    return [
        NodeInventory(
            job=job,
            node="a",
            endpoint="http://10.0.0.1:8470",
            updated_at=1.5,
            ranks={0: RankHoldings(local=(10, 20)), 1: RankHoldings(replica=(20,))},
            world_sizes={10: 2, 20: 2},
            gcs=(10,),
        ),
        PeerAssignment(job=job, generation=3, nodes=nodes, peers={"a": ("b",)}, node_ranks={"a": 0, "b": 1}),
        JobPolicy(job=job, generation=7, bucket="ckpt-bucket", prefix="team/a", keep_last=2),
        RestorePlan(
            job=job, step=20, world_size=2, sources={0: Tier.LOCAL, 1: Tier.GCS}, holders={0: ("a",)}
        ),
        BackupResult(job=job, step=None),
        RestoreAccepted(job=job),
        PurgeResult(job=job, purged=True, bucket=True),
    ]


async def test_openapi_document_describes_every_endpoint(http: httpx.AsyncClient):
    resp = await http.get("/v1/openapi.json", headers=AUTH)
    assert resp.status_code == 200
    doc = resp.json()
    api_port = served_on("api")
    assert doc["openapi"].startswith("3.1") and set(doc["paths"]) == {ep.path for ep in api_port}
    assert doc["components"]["securitySchemes"]["bearerToken"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "the content of the replicator's --token-file",
    }
    for ep in api_port:
        op = doc["paths"][ep.path][ep.method.lower()]
        assert op["operationId"] == ep.name and op["summary"] == ep.summary
        assert set(op["responses"]) == {str(s) for s in (ep.status, *ep.errors)}, ep.name
        for code in ep.errors:
            assert op["responses"][str(code)]["description"] == STATUS_MEANINGS[code]
        ok = op["responses"][str(ep.status)]["content"]
        if ep.response is not None:
            assert ok == {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{ep.response.__name__}"}}
            }
        else:
            assert list(ok) == [ep.media_type]
        if ep.request is not None:
            body = op["requestBody"]
            assert body["required"] is True
            assert body["content"]["application/json"]["schema"]["$ref"].endswith("/" + ep.request.__name__)
        else:
            assert "requestBody" not in op
        params = {(p["in"], p["name"]) for p in op.get("parameters", [])}
        assert params == {("path", p) for p in ep.path_params} | {("query", q.name) for q in ep.query}
        assert op["security"] == ([{"bearerToken": []}] if ep.auth else [])
    # the schemas are those of the wire bodies: real messages validate, altered ones do not
    for msg in _samples():
        check = _validator(doc, type(msg).__name__)
        body = msg.to_dict()
        check.validate(body)
        for broken in ({**body, "kind": "tierckpt.other"}, {k: v for k, v in body.items() if k != "job"}):
            assert not check.is_valid(broken), (type(msg).__name__, broken)
    inventory = _validator(doc, "NodeInventory")  # integer keys are integers, for a fuzzer too
    assert not inventory.is_valid({**_samples()[0].to_dict(), "world_sizes": {"ten": 2}})
    job = doc["paths"]["/v1/jobs/{job}/inventory"]["get"]["parameters"][0]["schema"]
    check = jsonschema.Draft202012Validator(job)
    assert check.is_valid("team_train_1234abcd") and not check.is_valid("..") and not check.is_valid("a/b")


def test_the_docs_describe_every_endpoint():
    """Every endpoint is in docs/replicator.md with a complete JSON example of each of its messages
    (each example decodes as that message)."""
    text = DOC.read_text()
    examples: dict[str, list[str]] = {}
    for block in re.findall(r"```json\n(.*?)```", text, flags=re.S):
        examples.setdefault(json.loads(block).get("kind", ""), []).append(block)
    for ep in ENDPOINTS:
        assert f"`{ep.method} {ep.path}" in text, ep.name
        for cls in (ep.request, ep.response):
            if cls is not None:
                assert examples.get(cls.KIND), (ep.name, cls.KIND)
                for block in examples[cls.KIND]:
                    cls.from_bytes(block)
