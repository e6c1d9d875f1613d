"""Fixtures for the operator tests: the API emulator with our CRDs, and the end-to-end environment
(operator thread, real replicators, the apiserver's admission calls)."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import kmock
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: k8s_emulator and fixtures

from k8s_emulator import KubeEmulator
from operator_harness import (
    SYSTEM_NS,
    TOKEN,
    Apiserver,
    Cluster,
    Node,
    Replicators,
    eventually,
    free_port,
    load_crds,
    make_tls,
)
from tierckpt_operator.__main__ import run
from tierckpt_operator.runtime import Runtime
from tierckpt_operator.settings import Settings


@pytest.fixture
async def kube() -> AsyncIterator[KubeEmulator]:
    """A running emulator (HTTP on 127.0.0.1); ``kube.url`` is its address."""
    async with KubeEmulator() as emulator, kmock.Server(emulator):
        yield emulator


@pytest.fixture
async def kube_with_crds(kube: KubeEmulator) -> KubeEmulator:
    for crd in load_crds():
        resp = await kube.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd)
        assert resp.status == 201, await resp.text()
    return kube


# ------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="session")
def webhook_tls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tls(tmp_path_factory.mktemp("webhook-tls"))


class OperatorThread:
    """The operator in its own thread and event loop, as in production a process of its own.

    kopf cancels every task created after it started when it stops; in the test's loop that would
    include pytest's own fixture tasks, hence the thread (kopf's ``KopfRunner`` does the same).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.runtime: Runtime | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_event: asyncio.Event | None = None
        self.exit_code: int | None = None
        self.error: BaseException | None = None
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._main, name="operator", daemon=True)

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self.loop, self.stop_event = loop, asyncio.Event()
        self.runtime = Runtime(self.settings)
        self._started.set()
        try:
            self.exit_code = loop.run_until_complete(
                run(self.settings, self.stop_event, signals=False, runtime=self.runtime)
            )
        except BaseException as exc:  # reported by the test through .error
            self.error = exc
        finally:
            loop.close()

    def start(self) -> None:
        self.thread.start()
        self._started.wait(10)

    def stop(self, timeout: float = 30.0) -> None:
        if self.loop is not None and self.stop_event is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the operator did not stop"


@dataclasses.dataclass
class Env:
    kube: KubeEmulator
    cluster: Cluster
    replicators: Replicators
    settings: Settings
    operator: OperatorThread | None = None

    async def add_nodes(self, *spec: tuple[str, str]) -> list[Node]:
        nodes = [await self.replicators.start(name, zone) for name, zone in spec]
        await self.replicators.wait_ready(*(n.name for n in nodes))
        for node in nodes:
            await self.cluster.add_node(node)
        return nodes

    async def start_operator(self) -> None:
        self.operator = OperatorThread(self.settings)
        self.operator.start()
        await eventually(self._webhook_up, 20, "operator webhook listening")

    async def _webhook_up(self) -> bool:
        assert self.operator is not None
        if not self.operator.thread.is_alive():
            raise RuntimeError(f"operator exited: {self.operator.exit_code} {self.operator.error!r}")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", self.settings.webhook_port)
        except OSError:
            return False
        writer.close()
        return True

    async def stop_operator(self) -> None:
        if self.operator is not None:
            await asyncio.to_thread(self.operator.stop)
            error, self.operator = self.operator.error, None
            if error is not None:
                raise error


def operator_settings(kube: KubeEmulator, tmp: Path, tls: Path, **overrides: object) -> Settings:
    token = tmp / "token"
    token.write_text(TOKEN)
    values: dict[str, object] = dict(
        server=str(kube.url).rstrip("/"),
        namespace=SYSTEM_NS,
        token_file=str(token),
        webhook_port=free_port(),
        webhook_addr="127.0.0.1",
        webhook_cert_dir=str(tls),
        metrics_port=0,
        debounce=0.05,
        resync_interval=2.0,
        refresh_interval=1.0,
        restore_grace=3.0,
        config_status_interval=0.5,
        http_timeout=2.0,
        http_retries=2,
    )
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture
async def env(kube_with_crds: KubeEmulator, tmp_path: Path, webhook_tls: Path) -> AsyncIterator[Env]:
    settings = operator_settings(kube_with_crds, tmp_path, webhook_tls)
    replicators = Replicators(tmp_path / "nodes", Path(settings.token_file))
    apiserver = Apiserver(
        kube_with_crds, f"https://127.0.0.1:{settings.webhook_port}", webhook_tls / "ca.crt"
    )
    cluster = Cluster(kube_with_crds, apiserver)
    for ns in (SYSTEM_NS, "team"):
        await cluster.namespace(ns)
    e = Env(kube_with_crds, cluster, replicators, settings)
    try:
        yield e
    finally:
        await e.stop_operator()
        replicators.close()
