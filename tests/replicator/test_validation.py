"""Validation at the replicator's boundaries (issue 10, defect 9): identifiers matched whole and ASCII
only, numbers finite and bounded, endpoints that are endpoints. Every refusal is a 4xx (a clean reply on
the data port), nothing is written, and the node keeps serving."""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.replicator.test_api import AUTH, JOB, TOKEN, assignment, policy
from tierckpt.protocol.control import NodeInventory, RankHoldings, RestorePlan, Tier
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import Lease, check_job_id, state_dir
from tierckpt_replicator.daemon import Daemon
from tierckpt_replicator.replication.context import DataContext
from tierckpt_replicator.replication.data_server import DataServer
from tierckpt_replicator.replication.ipc import WorkerConfig
from tierckpt_replicator.replication.wire import MAGIC, DataReply, DataRequest, Status, recv_frame, send_frame
from tierckpt_replicator.settings import Settings, TransferSettings

HUGE = b"9" * 401
"""A 401-digit integer: valid JSON, far outside every field's range."""


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Daemon]]:
    """The control API of a daemon with default limits (1 MiB bodies), over ASGI."""
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "ramdisk").mkdir()
    daemon = Daemon(
        Settings(
            node_name="node-a",
            root=tmp_path / "ramdisk",
            auth="token",  # the legacy bearer token: these tests are about validation, not identity
            token_file=tmp_path / "token",
            advertise_host="127.0.0.1",
        )
    )
    transport = httpx.ASGITransport(app=daemon.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replicator") as client:
        yield client, daemon
    await daemon.shutdown()


@pytest.mark.parametrize("job", ["job%0A", "%2Etierckpt", ".tierckpt", "j%D9%A1b", "a%2Fb", "job%00"])
async def test_job_ids_are_matched_whole_and_ascii(api, job):
    client, daemon = api
    body = assignment().to_bytes().replace(JOB.encode(), job.encode())
    resp = await client.put(f"/v1/jobs/{job}/peers", headers=AUTH, content=body)
    assert resp.status_code in (400, 404), resp.text  # 404: a path the router does not even match
    assert list(daemon.settings.root.iterdir()) == []  # nothing created, no state either
    assert (await client.get("/healthz")).status_code == 200


def test_the_state_directory_can_never_be_a_job():
    for job in (".tierckpt", "job\n", "j\u0661", "x" * 254):
        with pytest.raises(FormatError):
            check_job_id(job)


def _peers(**changes: object) -> bytes:
    return assignment().to_bytes().replace(b'"generation":1', b'"generation":' + changes.get("gen", b"1"))


def _plan(generation: bytes = b"1", step: bytes = b"40") -> bytes:
    plan = RestorePlan(job=JOB, step=40, world_size=4, sources={0: Tier.LOCAL}, generation=1)
    return (
        plan.to_bytes()
        .replace(b'"generation":1', b'"generation":' + generation)
        .replace(b'"step":40', b'"step":' + step)
    )


BAD_BODIES = {
    "policy: 401-digit generation": (
        "policy",
        policy().to_bytes().replace(b'"generation":1', b'"generation":' + HUGE),
    ),
    "policy: generation 2**53": (
        "policy",
        policy().to_bytes().replace(b'"generation":1', b'"generation":9007199254740992'),
    ),
    "policy: 401-digit float": (
        "policy",
        policy().to_bytes().replace(b'"backup_interval_minutes":30.0', b'"backup_interval_minutes":' + HUGE),
    ),
    "policy: NaN": (
        "policy",
        policy().to_bytes().replace(b'"backup_interval_minutes":30.0', b'"backup_interval_minutes":NaN'),
    ),
    "policy: keep_every 2**63": (
        "policy",
        policy().to_bytes().replace(b'"keep_every":1000', b'"keep_every":9223372036854775808'),
    ),
    "policy: nested 200000 deep": ("policy", b"[" * 200_000),
    "peers: 401-digit generation": ("peers", _peers(gen=HUGE)),
    "peers: generation 2**53": ("peers", _peers(gen=b"9007199254740992")),
    "peers: node rank 2**64": (
        "peers",
        assignment().to_bytes().replace(b'"node-b":1}', b'"node-b":18446744073709551616}'),
    ),
    "peers: endpoint without a port": (
        "peers",
        assignment().to_bytes().replace(b"http://10.0.0.2:8470", b"http://10.0.0.2"),
    ),
    "peers: endpoint with a path": (
        "peers",
        assignment().to_bytes().replace(b"http://10.0.0.2:8470", b"http://10.0.0.2:8470/steal"),
    ),
    "peers: endpoint with credentials": (
        "peers",
        assignment().to_bytes().replace(b"http://10.0.0.2:8470", b"http://u:p@10.0.0.2:8470"),
    ),
    "peers: endpoint not http": (
        "peers",
        assignment().to_bytes().replace(b"http://10.0.0.2:8470", b"file:///etc/passwd"),
    ),
    "peers: endpoint host not a name": (
        "peers",
        assignment().to_bytes().replace(b"http://10.0.0.2:8470", b"http://a_b!:8470"),
    ),
    "peers: newline in endpoint": (
        "peers",
        assignment().to_bytes().replace(b"http://10.0.0.2:8470", b"http://10.0.0.2:8470\\n"),
    ),
    "peers: nested 200000 deep": ("peers", b'{"kind":"tierckpt.peers","version":1,"nodes":' + b"[" * 200_000),
    "restore plan: generation 2**60": ("restore-plan", _plan(generation=b"1152921504606846976")),
    "restore plan: 401-digit step": ("restore-plan", _plan(step=HUGE)),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
async def test_out_of_range_numbers_and_bad_endpoints_are_refused(api, case):
    client, daemon = api
    route, body = BAD_BODIES[case]
    resp = await client.put(f"/v1/jobs/{JOB}/{route}", headers=AUTH, content=body)
    assert resp.status_code == 400, resp.text
    assert not state_dir(daemon.settings.root, JOB).exists() and not (daemon.settings.root / JOB).exists()
    assert (await client.get("/healthz")).status_code == 200


def test_integers_are_bounded_in_every_message_keys_included():
    inventory = NodeInventory(
        job=JOB, node="n", endpoint="", updated_at=0.0, ranks={0: RankHoldings(local=(5,))}
    )
    assert NodeInventory.from_bytes(inventory.to_bytes()) == inventory
    held = b'"ranks":{"0":{"local":[5],"replica":[],"fragments":{}}}'
    assert held in inventory.to_bytes()
    bads = (
        b'"ranks":{"%s":{}}' % HUGE,
        b'"ranks":{"0":{"local":[%s]}}' % HUGE,
        b'"ranks":{"0":{"fragments":{"%s":[0,2]}}}' % HUGE,
        b'"ranks":{"0":{"fragments":{"5":[%s,2]}}}' % HUGE,
    )
    for bad in bads:
        with pytest.raises(FormatError, match="64-bit"):
            NodeInventory.from_bytes(inventory.to_bytes().replace(held, bad))
    with pytest.raises(FormatError, match="64-bit"):
        Lease.from_bytes(
            Lease(step=1, holder="h", pid=1, host="x", expires_at=0.0)
            .to_bytes()
            .replace(b'"pid":1', b'"pid":' + HUGE)
        )


# ------------------------------------------------------------------------------------------ data port


@pytest.fixture
def data_port(tmp_path: Path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "ramdisk").mkdir()
    cfg = WorkerConfig(
        node="node-a",
        root=str(tmp_path / "ramdisk"),
        auth="token",
        token_file=str(tmp_path / "token"),
        listen_host="127.0.0.1",
        data_port=0,
        holder="replicator-node-a",
        transfer=TransferSettings(transfer_timeout=5.0),
    )
    server = DataServer(DataContext.from_config(cfg, emit=lambda event: None))
    server.start()
    yield server.port
    server.stop()


def _exchange(port: int, frame: bytes) -> DataReply:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(MAGIC + struct.pack("!I", len(frame)) + frame)
        return recv_frame(sock, DataReply)


@pytest.mark.parametrize(
    "frame",
    [
        b'{"kind":"tierckpt.data-request","version":1,"op":"get","token":"%s","job":"j","rank":%s,"step":1}'
        % (TOKEN.encode(), HUGE),
        b'{"kind":"tierckpt.data-request","version":1,"op":"get","token":"x","job":"j","rank":0,"step":%s}'
        % HUGE,
        b'{"kind":"tierckpt.data-request","version":1,"op":"put","token":"%s","job":"j","rank":0,"step":1,'
        b'"commit_size":%s,"manifest_size":1}' % (TOKEN.encode(), HUGE),
        b'{"kind":"tierckpt.data-request","version":1,"op":"get","token":"%s","job":"j\\n","rank":0,"step":1}'
        % TOKEN.encode(),
        b"[" * 60_000,
        b'{"kind":"tierckpt.data-request","version":1,"op":"get","token":NaN}',
    ],
)
def test_the_data_port_refuses_cleanly_and_keeps_serving(data_port, frame, caplog):
    caplog.set_level(logging.WARNING)
    reply = _exchange(data_port, frame)
    assert reply.status in (Status.BAD_REQUEST, Status.TOO_LARGE), reply
    assert "unexpected error" not in caplog.text and "Traceback" not in caplog.text
    with socket.create_connection(("127.0.0.1", data_port), timeout=5) as sock:  # still serving
        send_frame(sock, DataRequest(op="get", token=TOKEN, job=JOB, rank=0, step=1))
        assert recv_frame(sock, DataReply).status == Status.NOT_FOUND
