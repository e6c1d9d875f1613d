"""A Kubernetes API server for tests: kmock 0.8's ``KubernetesEmulator`` plus a small shim we own.

No real kube-apiserver can run on the dev/CI box (research/test-stack.md §1). Stock kmock 0.8 serves
objects over real HTTP but misses what operators rely on; this shim adds it (pin ``kmock==0.8``: it
touches ``kmock._internal``):

* create: ``metadata.namespace`` from the URL, ``generateName``, ``uid``, ``resourceVersion``,
  ``creationTimestamp``, ``generation``; status dropped for resources with a status subresource;
  answers 201; a ``CustomResourceDefinition`` registers its resource for discovery;
* patch (merge or JSON patch): 409 on a stale ``metadata.resourceVersion`` or a failed ``test`` op;
  ``resourceVersion`` bumped on every change, ``generation`` on spec changes; the ``status``
  subresource and the main resource isolated from each other; no-op patches change nothing;
* list and watch: ``labelSelector`` (``=``, ``==``, ``!=``, ``in``, ``notin``, ``k``, ``!k``);
  lists carry ``kind``/``apiVersion``/``resourceVersion``;
* discovery of the core group (``groupVersion: v1``) and ``/api/v1/namespaces[/NAME]`` paths;
* garbage collection: deleting an owner deletes the objects whose ``ownerReferences`` name its uid.

Still not emulated (see test-stack.md §1.7): PUT, strategic-merge lists, field selectors, watch
resumption and bookmarks, admission, CRD defaulting and validation, RBAC.

Standalone: ``python tests/k8s_emulator.py --port-file FILE`` serves until SIGTERM and writes its URL.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import itertools
import json
import re
import secrets
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
from kmock._internal import enums, parsing, references, rendering

__all__ = ["KubeEmulator", "LabelSelector", "merge_diff", "serve"]

CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
_STANDARD_VERBS = {"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}


# ------------------------------------------------------------------------------------ label selectors

_REQ = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9_./-]+)\s*"
    r"(?:(?P<op>==|!=|=|\s+in\s+|\s+notin\s+)\s*(?P<val>\([^)]*\)|[A-Za-z0-9_.-]*))?\s*$"
)


class LabelSelector:
    """A parsed ``labelSelector`` query: a conjunction of requirements."""

    def __init__(self, text: str | None) -> None:
        self.checks: list[Callable[[dict[str, str]], bool]] = []
        for part in _split_top_level(text or ""):
            self.checks.append(self._parse(part))

    @staticmethod
    def _parse(part: str) -> Callable[[dict[str, str]], bool]:
        m = _REQ.match(part)
        if not m:
            raise ValueError(f"unparsable label selector requirement {part!r}")
        key, op, neg = m["key"], (m["op"] or "").strip(), bool(m["neg"])
        if not op:
            return (lambda lb: key not in lb) if neg else (lambda lb: key in lb)
        if neg:
            raise ValueError(f"'!' only goes with a bare key: {part!r}")
        if op in ("in", "notin"):
            values = {v.strip() for v in m["val"].strip("()").split(",") if v.strip()}
            if op == "in":
                return lambda lb: lb.get(key) in values
            return lambda lb: lb.get(key) not in values
        value = m["val"]
        if op == "!=":
            return lambda lb: lb.get(key) != value
        return lambda lb: lb.get(key) == value

    def matches(self, obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(check(labels) for check in self.checks)


def _split_top_level(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p for p in parts if p.strip()]


# ------------------------------------------------------------------------------------ patching


def merge_diff(old: Any, new: Any) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new`` (both objects)."""
    out: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(before, dict) and isinstance(value, dict):
            sub = merge_diff(before, value)
            if sub:
                out[key] = sub
        elif key not in old or before != value:
            out[key] = value
    return out


def _apply(old: dict[str, Any], body: Any) -> dict[str, Any]:
    if isinstance(body, list):
        try:
            return jsonpatch.apply_patch(old, body, in_place=False)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            status = 409 if isinstance(exc, jsonpatch.JsonPatchTestFailed) else 422
            raise kmock.KubernetesError(status=status, reason="Invalid", message=str(exc)) from exc
    if isinstance(body, dict):
        return _merge(old, body)
    raise kmock.KubernetesError(status=400, reason="BadRequest", message="patch body must be JSON")


def _merge(old: Any, patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(old) if isinstance(old, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict):
            out[key] = _merge(out.get(key), value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _spec_of(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _path_fix(original: Callable[[str], parsing.ParsedPath]) -> Callable[[str], parsing.ParsedPath]:
    """Parse ``/api/v1/namespaces[/NAME[/SUB]]`` as the cluster-scoped ``namespaces`` resource."""

    def parse_path(path: str) -> parsing.ParsedPath:
        parts = path.strip("/").split("/")
        own = len(parts) <= 4 or (len(parts) == 5 and parts[4] in ("status", "finalize"))
        if parts[:3] == ["api", "v1", "namespaces"] and own:
            name = parts[3] if len(parts) > 3 else None
            sub = parts[4] if len(parts) > 4 else None
            return parsing.ParsedPath("", "v1", "namespaces", None, name, sub)
        return original(path)

    parse_path.__wrapped__ = original  # type: ignore[attr-defined]
    return parse_path


if not hasattr(parsing.parse_path, "__wrapped__"):
    parsing.parse_path = _path_fix(parsing.parse_path)


# ------------------------------------------------------------------------------------ the emulator


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's in-memory API server with the behaviours listed in the module docstring."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._rv_counter = itertools.count(1)
        self.resources.load_bundled()

    # -- helpers

    def _info(self, resource: references.resource) -> references.ResourceInfo | None:
        return self.resources[resource] if resource in self.resources else None  # noqa: SIM401 (get() auto-creates)

    def _has_status(self, resource: references.resource) -> bool:
        info = self._info(resource)
        return bool(info and "status" in info.subresources)

    def _next_rv(self) -> str:
        return str(next(self._rv_counter))

    def register_crd(self, crd: dict[str, Any]) -> None:
        """Serve the resource a CustomResourceDefinition declares (all served versions)."""
        spec = crd["spec"]
        names = spec["names"]
        for version in spec.get("versions", []):
            if not version.get("served", True):
                continue
            subresources = set((version.get("subresources") or {}).keys())
            self.resources[f"{spec['group']}/{version['name']}/{names['plural']}"] = kmock.ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                verbs=_STANDARD_VERBS,
                shortnames=set(names.get("shortNames", [])),
                categories=set(names.get("categories", [])),
                subresources=subresources,
            )

    # -- request handling

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if request.resource is not None and request.action == enums.action.UPDATE and request.name:
            response = await self._update(request)
            await self._collect_garbage()
            return response
        if request.resource is not None and request.action == enums.action.CREATE:
            self._prepare_create(request)
        response = await super()._handle(request)
        if request.action == enums.action.CREATE and response.status == 200 and not response.prepared:
            response.set_status(201)
            if request.resource == CRDS and isinstance(request.data, dict):
                self.register_crd(request.data)
        if request.action == enums.action.DELETE:
            await self._collect_garbage()
        return response

    def _prepare_create(self, request: rendering.Request) -> None:
        body = request.data
        if not isinstance(body, dict):
            raise kmock.KubernetesError(status=400, reason="BadRequest", message="object body required")
        meta = body.setdefault("metadata", {})
        info = self._info(request.resource)
        if info is not None and info.namespaced is False:
            meta.pop("namespace", None)
        elif request.namespace:
            if meta.get("namespace", request.namespace) != request.namespace:
                raise kmock.KubernetesError(
                    status=400,
                    reason="BadRequest",
                    message="the namespace of the object does not match the URL",
                )
            meta["namespace"] = request.namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if not meta.get("name"):
            raise kmock.KubernetesError(status=422, reason="Invalid", message="metadata.name is required")
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), creationTimestamp=_now())
        meta["generation"] = 1
        meta.pop("deletionTimestamp", None)
        if self._has_status(request.resource):
            body.pop("status", None)

    async def _update(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """Apply a merge or JSON patch atomically, with conflict checks and subresource isolation."""
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise kmock.KubernetesObjectNotFoundError()
            obj = self.objects[key]
            old = copy.deepcopy(obj.raw)
            body = request.data
            claimed = body.get("metadata", {}).get("resourceVersion") if isinstance(body, dict) else None
            current = old.get("metadata", {}).get("resourceVersion")
            if claimed is not None and claimed != current:
                raise kmock.KubernetesError(
                    status=409,
                    reason="Conflict",
                    message=f"resourceVersion {claimed} is stale (now {current})",
                )
            new = self._isolate(request, old, _apply(old, body))
            if new == old:
                return aiohttp.web.json_response(old)
            new["metadata"]["resourceVersion"] = self._next_rv()
            if _spec_of(new) != _spec_of(old):
                new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
            obj.patch(merge_diff(old, new))
            raw = obj.raw
            await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
            meta = raw.get("metadata", {})
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                obj.delete()
                await self._buses[request.resource].put({"type": "DELETED", "object": raw})
        return aiohttp.web.json_response(raw)

    def _isolate(
        self, request: rendering.Request, old: dict[str, Any], new: dict[str, Any]
    ) -> dict[str, Any]:
        """Status subresource writes touch only status; main-resource writes never touch it."""
        meta = dict(new.get("metadata") or {})
        for fixed in ("uid", "name", "namespace", "creationTimestamp", "resourceVersion", "generation"):
            if fixed in old.get("metadata", {}):
                meta[fixed] = old["metadata"][fixed]
        if old.get("metadata", {}).get("deletionTimestamp"):
            meta["deletionTimestamp"] = old["metadata"]["deletionTimestamp"]
        new = {**new, "metadata": meta}
        if request.subresource == "status":
            out = {k: v for k, v in old.items() if k != "status"}
            if "status" in new:
                out["status"] = new["status"]
            return out
        if request.subresource is None and self._has_status(request.resource):
            out = {k: v for k, v in new.items() if k != "status"}
            if "status" in old:
                out["status"] = old["status"]
            return out
        return new

    async def _collect_garbage(self) -> None:
        """Delete dependents of objects that are gone (background cascading deletion)."""
        while True:
            async with self._lock:
                alive = {
                    obj.raw["metadata"].get("uid")
                    for obj in self.objects.values()
                    if not obj.deleted and "metadata" in obj.raw
                }
                orphans = []
                for key, obj in self.objects.items():
                    if obj.deleted:
                        continue
                    meta = obj.raw.get("metadata", {})
                    owners = [o.get("uid") for o in meta.get("ownerReferences") or []]
                    if (
                        owners
                        and not any(uid in alive for uid in owners)
                        and not meta.get("deletionTimestamp")
                    ):
                        orphans.append(key)
                for key in orphans:
                    obj = self.objects[key]
                    resource = key[0] if isinstance(key[0], kmock.resource) else kmock.resource(key[0])
                    if obj.raw["metadata"].get("finalizers"):
                        obj.patch(
                            {"metadata": {"deletionTimestamp": _now(), "resourceVersion": self._next_rv()}}
                        )
                        await self._buses[resource].put({"type": "MODIFIED", "object": obj.raw})
                    else:
                        raw = obj.raw
                        obj.delete()
                        await self._buses[resource].put({"type": "DELETED", "object": raw})
            if not orphans:
                return

    # -- discovery, list, watch

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_version(request)
        if isinstance(payload, dict) and payload.get("groupVersion", "").startswith("/"):
            payload["groupVersion"] = payload["groupVersion"].lstrip("/")
        return payload

    def _list_meta(self, request: rendering.Request) -> tuple[str, str]:
        info = self._info(request.resource)
        group, version = request.resource.group, request.resource.version
        kind = (info.kind if info and info.kind else request.resource.plural.capitalize()) + "List"
        return kind, f"{group}/{version}" if group else version

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_list(request)
        selector = LabelSelector(request.params.get("labelSelector"))
        kind, api_version = self._list_meta(request)
        items = [obj for obj in payload["items"] if selector.matches(obj)]
        rv = str(max((int(o["metadata"].get("resourceVersion", 0)) for o in items), default=0))
        return {"apiVersion": api_version, "kind": kind, "metadata": {"resourceVersion": rv}, "items": items}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        selector = LabelSelector(request.params.get("labelSelector"))
        async for event in super()._serve_watch(request):
            if not isinstance(event, dict) or selector.matches(event.get("object") or {}):
                yield event


# ------------------------------------------------------------------------------------ standalone


async def serve(port: int = 0, port_file: Path | None = None, stop: asyncio.Event | None = None) -> None:
    """Serve on 127.0.0.1 until ``stop`` is set (or SIGTERM/SIGINT), writing the URL to ``port_file``."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with KubeEmulator() as emulator, kmock.Server(emulator, port=port or None) as server:
        url = str(server.url).rstrip("/")
        if port_file is not None:
            tmp = port_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"url": url}))
            tmp.replace(port_file)
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", type=Path)
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.port_file))


if __name__ == "__main__":
    main()
