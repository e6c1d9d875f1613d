"""The Kubernetes API emulator shim (tests/fixtures/k8s_emulator.py) behaves like an apiserver where our
operator depends on it: object metadata, conflicts, patches, status subresource, selectors, discovery,
finalizers, garbage collection and TokenReview. Real HTTP, and the real ``kubernetes`` client for
compatibility."""

from __future__ import annotations

import asyncio
import json

import kubernetes
import pytest

from tests.fixtures.k8s_emulator import LabelSelector, merge_diff

CM = "/api/v1/namespaces/ns1/configmaps"


async def _json(resp):
    return json.loads(await resp.text())


async def test_create_stamps_metadata_and_answers_201(kube):
    resp = await kube.post(CM, json={"metadata": {"generateName": "cfg-"}, "data": {"a": "1"}})
    assert resp.status == 201
    obj = await _json(resp)
    meta = obj["metadata"]
    assert meta["name"].startswith("cfg-") and len(meta["name"]) > 4
    assert (
        meta["namespace"] == "ns1" and meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"]
    )
    dup = await kube.post(CM, json={"metadata": {"name": meta["name"]}})
    assert dup.status == 409
    mismatch = await kube.post(CM, json={"metadata": {"name": "x", "namespace": "other"}})
    assert mismatch.status == 400


async def test_patches_bump_versions_and_detect_conflicts(kube):
    obj = await _json(await kube.post(CM, json={"metadata": {"name": "c"}, "data": {"a": "1"}}))
    rv0 = obj["metadata"]["resourceVersion"]
    ok = await _json(await kube.patch(f"{CM}/c", json={"data": {"b": "2"}}))
    assert ok["data"] == {"a": "1", "b": "2"} and ok["metadata"]["resourceVersion"] != rv0
    stale = await kube.patch(f"{CM}/c", json={"metadata": {"resourceVersion": rv0}, "data": {"c": "3"}})
    assert stale.status == 409
    failed_test = await kube.patch(
        f"{CM}/c",
        data=json.dumps(
            [
                {"op": "test", "path": "/metadata/resourceVersion", "value": rv0},
                {"op": "add", "path": "/data/d", "value": "4"},
            ]
        ),
        headers={"Content-Type": "application/json-patch+json"},
    )
    assert failed_test.status == 409
    rv1 = ok["metadata"]["resourceVersion"]
    json_patch = await kube.patch(
        f"{CM}/c",
        data=json.dumps(
            [
                {"op": "test", "path": "/metadata/resourceVersion", "value": rv1},
                {"op": "remove", "path": "/data/a"},
            ]
        ),
        headers={"Content-Type": "application/json-patch+json"},
    )
    assert json_patch.status == 200
    assert (await _json(json_patch))["data"] == {"b": "2"}
    same = await _json(await kube.patch(f"{CM}/c", json={"data": {"b": "2"}}))
    assert same["metadata"]["resourceVersion"] == (await _json(json_patch))["metadata"]["resourceVersion"]


async def test_crd_registration_status_isolation_and_generation(kube_with_crds):
    kube = kube_with_crds
    disc = await _json(await kube.get("/apis/tierckpt.io/v1alpha1"))
    kinds = {r["name"]: (r["kind"], r["namespaced"]) for r in disc["resources"]}
    assert kinds["checkpointconfigurations"] == ("CheckpointConfiguration", False)
    assert kinds["checkpointjobs"] == ("CheckpointJob", True)
    assert "checkpointjobs/status" in kinds
    url = "/apis/tierckpt.io/v1alpha1/checkpointconfigurations"
    body = {
        "metadata": {"name": "c1", "namespace": "ignored"},
        "spec": {"gcs": {"bucket": "b"}},
        "status": {"jobs": 9},
    }
    created = await _json(await kube.post(url, json=body))
    assert "namespace" not in created["metadata"] and "status" not in created
    assert created["metadata"]["generation"] == 1
    st = await _json(await kube.patch(f"{url}/c1/status", json={"status": {"jobs": 2}, "spec": {"x": 1}}))
    assert st["status"] == {"jobs": 2} and "x" not in st["spec"] and st["metadata"]["generation"] == 1
    main = await _json(
        await kube.patch(f"{url}/c1", json={"status": {"jobs": 5}, "spec": {"gcs": {"prefix": "p"}}})
    )
    assert main["status"] == {"jobs": 2} and main["spec"]["gcs"] == {"bucket": "b", "prefix": "p"}
    assert main["metadata"]["generation"] == 2
    meta_only = await _json(await kube.patch(f"{url}/c1", json={"metadata": {"labels": {"a": "b"}}}))
    assert meta_only["metadata"]["generation"] == 2


async def test_label_selectors_on_list_and_watch(kube):
    for name, labels in [("a", {"app": "x", "tier": "1"}), ("b", {"app": "y"}), ("c", {})]:
        await kube.post(CM, json={"metadata": {"name": name, "labels": labels}})

    async def names(selector):
        body = await _json(await kube.get(CM, params={"labelSelector": selector}))
        assert body["kind"] == "ConfigMapList" and body["apiVersion"] == "v1"
        return sorted(i["metadata"]["name"] for i in body["items"])

    assert await names("app=x") == ["a"]
    assert await names("app==x,tier") == ["a"]
    assert await names("app!=x") == ["b", "c"]
    assert await names("app in (x, y)") == ["a", "b"]
    assert await names("app notin (x)") == ["b", "c"]
    assert await names("!app") == ["c"]

    seen = []

    async def watch():
        async with kube.get(CM, params={"watch": "true", "labelSelector": "app=x"}) as resp:
            async for line in resp.content:
                if line.strip():
                    seen.append(json.loads(line))
                if len(seen) == 2:
                    return

    task = asyncio.create_task(watch())
    await asyncio.sleep(0.2)
    await kube.post(CM, json={"metadata": {"name": "d", "labels": {"app": "y"}}})
    await kube.post(CM, json={"metadata": {"name": "e", "labels": {"app": "x"}}})
    await asyncio.wait_for(task, 5)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in seen] == [("ADDED", "a"), ("ADDED", "e")]
    # every object carries its kind and apiVersion, as kube-apiserver's watch events do (kopf's diff base
    # is kept by kind: tierckpt_operator.registry.DiffBase)
    assert {(e["object"]["kind"], e["object"]["apiVersion"]) for e in seen} == {("ConfigMap", "v1")}
    node = await _json(await kube.post("/api/v1/nodes", json={"metadata": {"name": "n1"}}))
    assert (node["kind"], node["apiVersion"]) == ("Node", "v1")


async def test_namespaces_and_core_discovery(kube):
    assert (await kube.post("/api/v1/namespaces", json={"metadata": {"name": "team"}})).status == 201
    listed = await _json(await kube.get("/api/v1/namespaces"))
    assert [i["metadata"]["name"] for i in listed["items"]] == ["team"]
    assert (await _json(await kube.get("/api/v1/namespaces/team")))["metadata"]["name"] == "team"
    assert (await _json(await kube.get("/api/v1")))["groupVersion"] == "v1"


async def test_finalizers_and_garbage_collection(kube):
    owner = await _json(await kube.post(CM, json={"metadata": {"name": "owner", "finalizers": ["x/y"]}}))
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    await kube.post(CM, json={"metadata": {"name": "child", "ownerReferences": [ref]}})
    await kube.post(CM, json={"metadata": {"name": "held", "ownerReferences": [ref], "finalizers": ["f/g"]}})
    assert (await kube.delete(f"{CM}/owner")).status == 200
    marked = await _json(await kube.get(f"{CM}/owner"))
    assert marked["metadata"]["deletionTimestamp"]
    assert (await kube.get(f"{CM}/child")).status == 200  # owner still exists (finalizer)
    await kube.patch(f"{CM}/owner", json={"metadata": {"finalizers": None}})
    assert (await kube.get(f"{CM}/owner")).status == 404
    assert (await kube.get(f"{CM}/child")).status == 404
    held = await _json(await kube.get(f"{CM}/held"))
    assert held["metadata"]["deletionTimestamp"]


async def test_it_holds_thousands_of_objects_no_history_and_an_indexed_collection(kube):
    """kmock compared every request with every request it had served, and the collection scanned every
    object after each patch: both grew with the cluster. Requests cost the same at the end as at the
    start, and deleting an owner visits its dependents only."""
    owner = await _json(await kube.post(CM, json={"metadata": {"name": "owner"}}))
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}

    async def batch(first: int) -> float:
        started = asyncio.get_running_loop().time()
        for i in range(first, first + 200):
            body = {"metadata": {"name": f"c{i}", "ownerReferences": [ref] if i % 2 else []}}
            assert (await kube.post(CM, json=body)).status == 201
            assert (await kube.patch(f"{CM}/c{i}", json={"data": {"k": "v"}})).status == 200
        return asyncio.get_running_loop().time() - started

    first = await batch(0)
    for start in range(200, 1200, 200):
        last = await batch(start)
    assert not kube._requests  # only requests in flight are kept
    assert last < 3 * first + 0.5, (first, last)
    assert (await kube.delete(f"{CM}/owner")).status == 200
    names = {o["metadata"]["name"] for o in (await _json(await kube.get(CM)))["items"]}
    assert names == {f"c{i}" for i in range(0, 1200, 2)}


async def test_kubernetes_client_round_trip(kube_with_crds):
    cfg = kubernetes.client.Configuration(host=str(kube_with_crds.url).rstrip("/"))
    api = kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(cfg))
    body = {
        "apiVersion": "tierckpt.io/v1alpha1",
        "kind": "CheckpointJob",
        "metadata": {"name": "j"},
        "spec": {"jobSetName": "j", "jobSetUID": "u", "jobId": "x"},
    }

    def create():
        return api.create_namespaced_custom_object("tierckpt.io", "v1alpha1", "ns1", "checkpointjobs", body)

    created = await asyncio.to_thread(create)
    assert created["metadata"]["namespace"] == "ns1"
    with pytest.raises(kubernetes.client.ApiException) as exc:
        await asyncio.to_thread(create)
    assert exc.value.status == 409


async def test_token_review_answers_for_registered_tokens_only(kube):
    """As kube-apiserver does for ServiceAccount tokens: authenticated for the audiences the token and
    the review share, with the user and extra the token carries; anything else not authenticated."""
    user = "system:serviceaccount:sys:replicator"
    extra = {"authentication.kubernetes.io/pod-name": ["p"], "authentication.kubernetes.io/pod-uid": ["u"]}
    kube.register_token("good", username=user, extra=extra, audiences=("tierckpt",))
    kube.register_token("old", username=user, audiences=("tierckpt",), expires=1.0)
    cfg = kubernetes.client.Configuration(host=str(kube.url).rstrip("/"))
    api = kubernetes.client.AuthenticationV1Api(kubernetes.client.ApiClient(cfg))

    def review(token: str, audiences: list[str] | None) -> dict:
        spec = {"token": token, **({"audiences": audiences} if audiences else {})}
        answer = api.create_token_review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec}
        )
        return api.api_client.sanitize_for_serialization(answer)["status"]

    ok = await asyncio.to_thread(review, "good", ["tierckpt"])
    assert ok["authenticated"] and ok["audiences"] == ["tierckpt"]
    assert ok["user"]["username"] == user and ok["user"]["extra"] == extra
    assert "system:serviceaccounts:sys" in ok["user"]["groups"]
    for token, audiences in (
        ("good", ["other"]),
        ("good", None),
        ("old", ["tierckpt"]),
        ("nope", ["tierckpt"]),
    ):
        status = await asyncio.to_thread(review, token, audiences)
        assert not status.get("authenticated") and status["error"], (token, audiences)
    kube.revoke_token("good")
    assert not (await asyncio.to_thread(review, "good", ["tierckpt"])).get("authenticated")
    resp = await kube.post("/apis/authentication.k8s.io/v1/tokenreviews", json={"spec": {"token": "good"}})
    assert resp.status == 201
    assert all("tokenreviews" not in str(key[0]) for key in kube.objects)  # reviews are never stored


def test_label_selector_parser_and_merge_diff():
    sel = LabelSelector("a in (1,2), b!=3 ,!c")
    assert sel.matches({"metadata": {"labels": {"a": "1"}}})
    assert not sel.matches({"metadata": {"labels": {"a": "1", "c": ""}}})
    assert not sel.matches({"metadata": {"labels": {"a": "1", "b": "3"}}})
    with pytest.raises(ValueError):
        LabelSelector("a in")
    assert merge_diff({"a": 1, "b": {"c": 1, "d": 2}}, {"b": {"c": 1, "d": 3}, "e": [1]}) == {
        "a": None,
        "b": {"d": 3},
        "e": [1],
    }
