"""``retire`` on a real data server: a surplus replica is dropped, unless the published restore plan
names its step (a load may be reading it), which keeps it until the sender asks again."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.replicator.test_api import JOB, TOKEN
from tests.replicator.test_validation import data_port
from tierckpt.protocol.control import RestorePlan, Tier, write_control
from tierckpt.protocol.format import read_commit, replica_rank_dir, step_dir
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.replication.wire import DataReply, DataRequest, Status, recv_frame, send_frame

__all__ = ["data_port"]  # the fixture, re-exported for pytest


def retire(port: int, step: int) -> DataReply:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        send_frame(sock, DataRequest(op="retire", token=TOKEN, job=JOB, rank=1, step=step, node="node-b"))
        return recv_frame(sock, DataReply)


def test_a_surplus_replica_is_retired_unless_the_restore_plan_names_it(
    data_port: int, tmp_path: Path
) -> None:
    root = tmp_path / "ramdisk"
    for step in (10, 20):
        write_step(root, JOB, 1, step, world_size=2, sizes=(4096,), parent=replica_rank_dir(root, JOB, 1))
    plan = RestorePlan(job=JOB, step=20, world_size=2, sources={0: Tier.LOCAL, 1: Tier.REPLICA}, generation=1)
    write_control(root, JOB, RestorePlan.FILE, plan)
    reply = retire(data_port, 20)
    assert reply.status == Status.CONFLICT and "[20] kept" in reply.message
    assert read_commit(step_dir(replica_rank_dir(root, JOB, 1), 20)) is not None  # pinned: still there
    assert read_commit(step_dir(replica_rank_dir(root, JOB, 1), 10)) is None  # the older one went
    write_control(
        root, JOB, RestorePlan.FILE, RestorePlan(job=JOB, step=None, world_size=2, sources={}, generation=2)
    )
    assert retire(data_port, 20).status == Status.OK
    assert read_commit(step_dir(replica_rank_dir(root, JOB, 1), 20)) is None
    assert retire(data_port, 20) == DataReply(status=Status.OK, message="no replica held")
