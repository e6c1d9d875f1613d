"""Bad input reaches the user as an Event and a status condition, never as a crash loop: a missing
configuration (and recovery once it is created), an invalid opt-in annotation, a JobSet without
Indexed Jobs. The webhooks say the same at admission time. Real operator, API emulator."""

from __future__ import annotations

import asyncio

import pytest

from tests.operator.operator_harness import AdmissionRefused, eventually, jobset_body

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NS = "team"


def ck_status(env, name):
    return (env.cluster.checkpoint_job(NS, name) or {}).get("status", {})


def cond(status, kind):
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def events_about(env, name, reason):
    return [e for e in env.cluster.events(reason) if e["involvedObject"]["name"] == name]


async def test_missing_configuration_then_recovery(env):
    await env.start_operator()
    await env.cluster.create_jobset(NS, jobset_body("nocfg", [("w", 1, 2)], config="absent"))
    review = env.cluster.api.reviews[-1]["response"]
    assert any("'absent' does not exist" in w for w in review.get("warnings", []))
    st = await eventually(
        lambda: (s := ck_status(env, "nocfg")).get("phase") == "Pending" and s, what="Pending"
    )
    c = cond(st, "ConfigResolved")
    assert c["status"] == "False" and c["reason"] == "ConfigNotFound" and "'absent'" in c["message"]
    await eventually(lambda: events_about(env, "nocfg", "ConfigNotFound"), what="ConfigNotFound event")
    with pytest.raises(AdmissionRefused, match="'absent' does not exist"):
        await env.cluster.create_pods(NS, "nocfg")
    # the event is not repeated every round: the operator is not looping on the error
    await asyncio.sleep(3 * env.settings.resync_interval)
    assert len(events_about(env, "nocfg", "ConfigNotFound")) == 1
    await env.cluster.config("absent")
    st = await eventually(
        lambda: (s := ck_status(env, "nocfg")).get("phase") == "Scheduling" and s, what="recovery"
    )
    assert cond(st, "ConfigResolved")["status"] == "True"
    pods = await env.cluster.create_pods(NS, "nocfg")  # now admitted and injected
    assert all(p["metadata"]["annotations"]["tierckpt.io/job-id"].startswith("team_nocfg_") for p in pods)


async def test_invalid_annotation_is_reported_once(env):
    await env.cluster.config()
    await env.start_operator()
    body = jobset_body("typo", [("w", 1, 1)], enabled="yes")
    resp = await env.kube.post(f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets", json=body)
    assert resp.status == 201
    ev = await eventually(lambda: events_about(env, "typo", "InvalidAnnotation"), what="InvalidAnnotation")
    assert '"true" or "false"' in ev[0]["message"] and ev[0]["type"] == "Warning"
    await asyncio.sleep(3 * env.settings.resync_interval)
    assert len(events_about(env, "typo", "InvalidAnnotation")) == 1  # PermanentError: no retries
    assert env.cluster.checkpoint_job(NS, "typo") is None
    assert env.operator.thread.is_alive()


async def test_jobset_without_indexed_jobs(env):
    await env.cluster.config()
    await env.start_operator()
    await env.cluster.create_jobset(NS, jobset_body("plain", [("w", 2, 2)], indexed=False))
    warnings = env.cluster.api.reviews[-1]["response"].get("warnings", [])
    assert any("not an Indexed Job" in w for w in warnings)
    st = await eventually(
        lambda: (s := ck_status(env, "plain")).get("phase") == "Invalid" and s, what="Invalid"
    )
    c = cond(st, "ConfigResolved")
    assert c["reason"] == "InvalidJobSet" and "completionMode: Indexed" in c["message"]
    ev = await eventually(lambda: events_about(env, "plain", "InvalidJobSet"), what="InvalidJobSet event")
    assert ev[0]["type"] == "Warning"
    with pytest.raises(AdmissionRefused, match="Indexed"):
        await env.cluster.create_pods(NS, "plain")
    await asyncio.sleep(3 * env.settings.resync_interval)
    assert len(events_about(env, "plain", "InvalidJobSet")) == 1
    assert env.operator.thread.is_alive()


@pytest.mark.parametrize(
    ("spec", "what"),
    [
        (
            {"tolerations": [{"key": "gpu", "operator": "Exists", "value": "yes"}]},
            "spec.tolerations[0].value",
        ),
        ({"tolerations": [{"key": "bad key", "operator": "Exists"}]}, "spec.tolerations[0].key"),
        ({"tolerations": [{"key": "k", "operator": "Exists", "tolerationSeconds": 9}]}, "NoExecute"),
        ({"nodeSelector": {"a/b/c": "x"}}, "spec.nodeSelector"),
        ({"ramdisk": {"size": "0"}}, "spec.ramdisk.size"),
    ],
)
async def test_an_invalid_configuration_is_reported_and_copied_nowhere(env, spec, what):
    """A CheckpointConfiguration the CRD would refuse (the emulator stores it anyway, as an older CRD
    or an object stored before the schema tightened would): the operator re-checks it, says why on
    the configuration's status, and no pod gets anything of it (the webhook refuses the pods)."""
    await env.cluster.config("shady", **spec)
    await env.start_operator()
    await env.cluster.create_jobset(NS, jobset_body("shady", [("w", 1, 1)], config="shady"))

    def ready_condition():
        config = env.cluster.obj("tierckpt.io/v1alpha1/checkpointconfigurations", None, "shady") or {}
        return cond(config.get("status", {}), "Ready")

    c = await eventually(
        lambda: (c := ready_condition()) and c.get("reason") == "InvalidSpec" and c, what="status"
    )
    assert c["status"] == "False" and what in c["message"]
    st = await eventually(
        lambda: (s := ck_status(env, "shady")).get("phase") == "Pending" and s, what="Pending"
    )
    assert cond(st, "ConfigResolved")["status"] == "False" and what in cond(st, "ConfigResolved")["message"]
    with pytest.raises(AdmissionRefused, match="is invalid"):
        await env.cluster.create_pods(NS, "shady")
    assert env.cluster.objs("v1/pods", NS) == []
    assert env.operator.thread.is_alive()
