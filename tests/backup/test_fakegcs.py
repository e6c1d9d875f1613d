"""The demo/test GCS emulator launcher and the fault proxy, against the real fake-gcs-server."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest
import requests

from tierckpt_demo.fakegcs import (
    FakeGcsServer,
    FaultProxy,
    FaultRule,
    binary_path,
    gcs_behind_proxy,
)
from tierckpt_demo.ports import free_port

pytestmark = pytest.mark.e2e


def test_binary_is_found_in_the_wrapper_wheel() -> None:
    path = binary_path()
    assert path.is_file() and os.access(path, os.X_OK)


def test_server_starts_stops_and_enforces_create_only() -> None:
    with FakeGcsServer() as gcs:
        assert gcs.running and gcs.env() == {"STORAGE_EMULATOR_HOST": gcs.url}
        gcs.create_bucket("bkt-one")
        gcs.create_bucket("bkt-one")  # idempotent
        blob = gcs.client().bucket("bkt-one").blob("k")
        blob.upload_from_string(b"first", if_generation_match=0)
        from google.api_core.exceptions import PreconditionFailed

        with pytest.raises(PreconditionFailed):
            blob.upload_from_string(b"second", if_generation_match=0)
        assert blob.download_as_bytes() == b"first"
        port = gcs.port
    assert not gcs.running
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/storage/v1/b", timeout=2)


def test_a_server_that_cannot_start_says_why() -> None:
    port = free_port()
    with FakeGcsServer(port=port), pytest.raises(RuntimeError, match="in use"):
        FakeGcsServer(port=port, ready_timeout=5).start()  # the port is taken


def _get(url: str, **kw: object) -> requests.Response:
    return requests.get(f"{url}/storage/v1/b?project=x", timeout=kw.pop("timeout", 5), **kw)  # type: ignore[arg-type]


def test_proxy_rules_fire_per_request_then_pass() -> None:
    with gcs_behind_proxy() as (gcs, proxy):
        proxy.add_rule(FaultRule(action="status", status=503, method="GET", times=2))
        assert [_get(proxy.url).status_code for _ in range(3)] == [503, 503, 200]
        proxy.add_rule(FaultRule(action="status", status=429, path=r"project=y", skip=1))
        assert requests.get(f"{proxy.url}/storage/v1/b?project=y", timeout=5).status_code == 200
        assert requests.get(f"{proxy.url}/storage/v1/b?project=y", timeout=5).status_code == 429
        assert [h.action for h in proxy.hits] == ["status", "status", "forward", "forward", "status"]
        assert gcs.running


def test_proxy_reset_stall_delay_and_dropped_responses() -> None:
    with gcs_behind_proxy() as (gcs, proxy):
        gcs.create_bucket("bkt-two")
        proxy.add_rule(FaultRule(action="reset"))
        with pytest.raises(requests.ConnectionError):
            _get(proxy.url)
        proxy.add_rule(FaultRule(action="stall", seconds=5))
        with pytest.raises(requests.ReadTimeout):
            _get(proxy.url, timeout=0.3)
        proxy.add_rule(FaultRule(action="delay", seconds=0.2))
        start = time.monotonic()
        assert _get(proxy.url).status_code == 200
        assert time.monotonic() - start >= 0.2
        # The server acts on the request, but the client never learns it.
        client = gcs.client(url=proxy.url)
        proxy.add_rule(FaultRule(action="drop_response", method="POST", path="uploadType=multipart"))
        with pytest.raises(requests.ConnectionError):
            client.bucket("bkt-two").blob("k").upload_from_string(b"x", retry=None)
        assert client.bucket("bkt-two").blob("k").download_as_bytes() == b"x"


def test_proxy_resets_an_upload_midway_and_the_object_never_appears() -> None:
    with gcs_behind_proxy() as (gcs, proxy):
        gcs.create_bucket("bkt-three")
        client = gcs.client(url=proxy.url)
        proxy.add_rule(FaultRule(action="reset_midway", method="POST", after_bytes=100))
        with pytest.raises(requests.ConnectionError):
            client.bucket("bkt-three").blob("k").upload_from_string(os.urandom(4096), retry=None)
        assert client.bucket("bkt-three").get_blob("k") is None


@pytest.mark.root
def test_server_inside_a_network_namespace() -> None:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 is not installed")
    ns = f"tckgcs{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        with FakeGcsServer("127.0.0.1", 4443, netns=ns) as gcs:
            assert gcs.running
            code = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:4443/storage/v1/b').status)"
            out = subprocess.run(
                ["ip", "netns", "exec", ns, "python3", "-c", code], capture_output=True, text=True
            )
            assert out.stdout.strip() == "200"
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def test_proxy_close_ends_open_connections() -> None:
    with gcs_behind_proxy() as (_, proxy):
        proxy.add_rule(FaultRule(action="stall", seconds=60))
        start = time.monotonic()
        import threading

        errors: list[BaseException] = []

        def call() -> None:
            try:
                _get(proxy.url, timeout=30)
            except requests.RequestException as exc:
                errors.append(exc)

        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.2)
        proxy.close()
        t.join(10)
        assert not t.is_alive() and errors and time.monotonic() - start < 10
    assert isinstance(FaultProxy, type)
