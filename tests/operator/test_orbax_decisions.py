"""Orbax mode in the operator's pure parts (issue 24): the ``tierckpt.io/mode`` annotation, what the
webhook injects in that mode, and the sessions each node's replicator gets."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from tests.operator.test_operator_units import _info, _jobset, _pod, _workers
from tierckpt.protocol.contract import Annotations
from tierckpt.protocol.errors import ContractError
from tierckpt.protocol.orbax import OrbaxSession
from tierckpt_operator.decisions import JobState, decide_assignment, jax_coordinator, orbax_sessions
from tierckpt_operator.injection import ORBAX_RUN_ENV, Injection, inject
from tierckpt_operator.jobsets import parse_jobset


def test_the_mode_annotation_is_native_unless_orbax_and_anything_else_says_what_to_fix() -> None:
    assert parse_jobset(_jobset(**{Annotations.ENABLED: "true"})).mode == "native"
    assert parse_jobset(_jobset(**{Annotations.MODE: " Orbax "})).mode == "orbax"
    with pytest.raises(ContractError, match=r"tierckpt.io/mode='jax' is invalid: use 'native' or 'orbax'"):
        parse_jobset(_jobset(**{Annotations.MODE: "jax"}))


def test_orbax_mode_mounts_the_ramdisk_at_the_mount_root_and_names_the_run() -> None:
    plan = Injection(job_id="ns_j_01234567", mount_root="/local/", mode="orbax", jobset="llama")
    pod = _pod()
    inject(pod, plan)
    twice = copy.deepcopy(pod)
    inject(twice, plan)
    assert twice == pod
    (c,) = pod["spec"]["containers"]
    assert {"name": "tierckpt-ramdisk", "mountPath": "/local"} in c["volumeMounts"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[ORBAX_RUN_ENV] == "llama" and "TIERCKPT_ROOT" not in env
    native = _pod()
    inject(native, Injection(job_id="ns_j_01234567", mount_root="/local/", jobset="llama"))
    (c,) = native["spec"]["containers"]
    assert {"name": "tierckpt-ramdisk", "mountPath": "/local/ns_j_01234567"} in c["volumeMounts"]
    assert ORBAX_RUN_ENV not in {e["name"] for e in c["env"]}


def test_a_run_name_the_user_set_is_kept() -> None:
    pod = _pod()
    pod["spec"]["containers"][0]["env"].append({"name": ORBAX_RUN_ENV, "value": "mine"})
    inject(pod, Injection(job_id="ns_j_01234567", mode="orbax", jobset="llama"))
    assert [e["value"] for e in pod["spec"]["containers"][0]["env"] if e["name"] == ORBAX_RUN_ENV] == ["mine"]


def test_each_node_gets_its_rank_as_its_process_id() -> None:
    state = JobState(generation=3, nodes=("n2", "n0", "n1"))
    sessions = orbax_sessions("ns_j_01234567", state, "llama-0-0.llama:8476")
    assert sessions == {
        node: OrbaxSession("ns_j_01234567", node, 3, rank, 3, "llama-0-0.llama:8476")
        for rank, node in enumerate(("n2", "n0", "n1"))
    }


def test_the_coordinator_is_the_ip_of_the_pod_given_rank_0() -> None:
    nodes = [f"n{i}" for i in range(8)]
    first = decide_assignment(_info(), _workers(nodes), JobState(), {}).state
    # the restart: the pod of index 0 lands on n5, the one of index 5 on n0 (which holds rank 0)
    moved = [nodes[5], *nodes[1:5], nodes[0], *nodes[6:]]
    pods = [dataclasses.replace(w, ip=f"10.0.0.{i + 1}") for i, w in enumerate(_workers(moved, attempt=1))]
    d = decide_assignment(_info(restarts=1), pods, first, {})
    assert d.state.nodes == first.nodes
    assert d.coordinator_ip == "10.0.0.6", "the pod on n0, which keeps rank 0"
    unstarted = [dataclasses.replace(w, ip="") for w in pods]
    assert decide_assignment(_info(restarts=1), unstarted, first, {}).coordinator_ip == ""


@pytest.mark.parametrize(
    ("address", "port", "want"),
    [
        ("llama-slice-0-0.llama", 8476, "llama-slice-0-0.llama:8476"),
        ("10.4.0.7", 1234, "10.4.0.7:1234"),
        ("fd00::7", 8476, "[fd00::7]:8476"),
        ("", 8476, None),  # the pod has no address yet
        ("bad name!", 8476, None),
    ],
)
def test_the_jax_coordinator_is_the_rank_0_pods_address(address: str, port: int, want: str | None) -> None:
    assert jax_coordinator(address, port) == want
