"""Two operator replicas with leader election (the chart's default): both answer the webhooks, only the
Lease holder reconciles, and the standby takes over when the leader stops."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tests.operator.operator_harness import (
    Cluster,
    OperatorThread,
    eventually,
    jobset_body,
    operator_settings,
    port_open,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NS = "team"
POD_GVR = ("", "v1", "pods")


async def test_standby_serves_webhooks_and_takes_over(env, tmp_path, webhook_tls, tierckpt_ca):
    await env.cluster.config()
    base = dict(leader_election=True, lease_name="tierckpt-operator", lease_duration=4.0)
    first = dataclasses.replace(env.settings, pod_name="operator-a", **base)
    second = operator_settings(
        env.kube, tmp_path / "b", webhook_tls, tierckpt_ca, pod_name="operator-b", **base
    )
    a, b = OperatorThread(first), OperatorThread(second)
    a.start()
    await eventually(lambda: env.lease_holder() == "operator-a", 20, "operator-a leads")
    await asyncio.sleep(1)
    await eventually(
        lambda: port_open(first.webhook_port), 30, "the leader's webhook (kopf restarted as leader)"
    )
    b.start()
    try:
        await env.cluster.create_jobset(NS, jobset_body("one", [("w", 1, 2)]))
        await eventually(lambda: env.cluster.checkpoint_job(NS, "one"), 20, "the leader reconciles")
        # the standby's webhook answers too (it watches the same indices)
        standby = dataclasses.replace(env.cluster.api, webhook=f"https://127.0.0.1:{second.webhook_port}")
        pod = (await env.cluster.create_pods(NS, "one"))[0]
        pod["metadata"].pop("annotations")
        review = await eventually(
            lambda: standby.review("/mutate-pods", pod, POD_GVR, "Pod", NS), 20, "the standby's webhook"
        )
        assert review["allowed"]
        await asyncio.to_thread(a.stop)  # a clean stop releases the Lease
        await eventually(lambda: env.lease_holder() == "operator-b", 20, "operator-b takes over")
        # the promoted replica restarts kopf with every handler (a few seconds without its webhook;
        # the apiserver's caller retries, as the Job controller does)
        await eventually(
            lambda: Cluster(env.kube, standby).create_jobset(NS, jobset_body("two", [("w", 1, 1)])),
            30,
            "the new leader's webhook",
        )
        await eventually(lambda: env.cluster.checkpoint_job(NS, "two"), 30, "the new leader reconciles")
    finally:  # in threads: the API emulator serves from this test's event loop
        await asyncio.to_thread(a.stop)
        await asyncio.to_thread(b.stop)
    assert a.error is None and b.error is None and a.exit_code == 0
