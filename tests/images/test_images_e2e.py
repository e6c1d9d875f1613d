"""The daemon image that scripts/build-images.sh built, run: every daemon starts from it, as the chart
runs it, and does its job.

- two replicators, each a container of the image on a node of the netns cluster (its own network
  namespace and tmpfs), root with the chart's three capabilities: a step committed on one node is
  replicated to the other, byte for byte;
- the operator, a container of the image as its default non-root user, on a node of the cluster
  with the API emulator beside it: it ranks a JobSet's pods and answers its probes, metrics and
  signing endpoint (tests/operator/test_operator_smoke.py's scenario), and exits 0 on SIGTERM;
- the CSI plugin, a container of the image: it mounts its ramdisk and answers the CSI Identity and
  Node services on its socket, and the image's ``tierckpt-csi probe`` (the DaemonSet's exec probe,
  another container) finds it ready;
- the CLI in the image (no torch) verifies a committed step and names a corrupt file;
- the example training image (if built: ``--training``) saves and loads with the training library as
  its non-root user, and has what the example JobSet's launch script runs.

Run by scripts/images-smoke.sh (the scheduled CI job), which builds the image and sets
``TIERCKPT_IMAGE_LAYOUT``; skipped without it. tests/images/oci.py says how a container runs here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import grpc
import pytest

import tierckpt
from tests.csi.csi_helpers import connect
from tests.fixtures.cluster import committed, new_job, replica_path
from tests.fixtures.ramdisk import fresh_ramdisk_dir
from tests.images.oci import UnpackedImage, tools_missing
from tests.operator.test_operator_smoke import check_operator_process
from tests.packaging.test_fresh_install import SAVE_AND_LOAD
from tierckpt.protocol.contract import Csi
from tierckpt_csi._proto import csi_pb2
from tierckpt_demo.cluster import LocalCluster, Node
from tierckpt_demo.step_writer import step_files, write_step

pytestmark = [pytest.mark.images, pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

TESTS = Path(__file__).resolve().parents[1]
REPLICATOR_CAPABILITIES = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER")
"""The chart's replicator container: root, these capabilities only."""
CSI_CAPABILITIES = ("CAP_SYS_ADMIN", *REPLICATOR_CAPABILITIES)
"""The chart's CSI container is privileged; these are the capabilities it uses."""


def _unpacked(tag: str, where: Path) -> UnpackedImage:
    layout = os.environ.get("TIERCKPT_IMAGE_LAYOUT")
    if not layout:
        pytest.skip("no built image: scripts/images-smoke.sh builds it and runs these tests")
    missing = tools_missing()
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (scripts/build-images.sh installs them)")
    tags = subprocess.run(["umoci", "ls", "--layout", layout], capture_output=True, text=True, check=True)
    if tag not in tags.stdout.split():
        pytest.skip(f"{layout} has no {tag} (scripts/build-images.sh --training builds it)")
    return UnpackedImage(Path(layout), tag, where)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> UnpackedImage:
    return _unpacked(f"tierckpt-{tierckpt.__version__}", tmp_path_factory.mktemp("image"))


@pytest.fixture(scope="module")
def training_image(tmp_path_factory: pytest.TempPathFactory) -> UnpackedImage:
    return _unpacked(f"tierckpt-training-{tierckpt.__version__}", tmp_path_factory.mktemp("training"))


def test_the_image_is_the_lean_daemon_image(image: UnpackedImage) -> None:
    site = image.rootfs / "opt/tierckpt/lib/python3.11/site-packages"
    assert (site / "tierckpt_replicator").is_dir() and (site / "kopf").is_dir() and (site / "grpc").is_dir()
    assert not (site / "torch").exists() and not (site / "numpy").exists()
    for tool in ("pip", "setuptools", "wheel"):
        assert not list(site.glob(f"{tool}-*.dist-info")), tool
    for program in ("usr/bin/dpkg", "usr/bin/apt", "usr/bin/gcc", "bin/sh", "usr/bin/tar"):
        assert not (image.rootfs / program).exists(), program
    assert image.spec["process"]["user"] == {"uid": 65532, "gid": 65532}
    assert image.labels["org.opencontainers.image.version"] == tierckpt.__version__


def replicator_in(image: UnpackedImage) -> Callable[[Node, list[str]], list[str]]:
    """A node's replicator as the chart runs it: a container of the image, root with three capabilities,
    its ramdisk and credentials (under the cluster's workdir) mounted from the host."""

    def command(node: Node, args: list[str]) -> list[str]:
        return image.command(
            ["tierckpt-replicator", *args],
            user=(0, 0),
            capabilities=REPLICATOR_CAPABILITIES,
            binds=[node.cluster.workdir],
        )

    return command


def test_replicators_from_the_image_replicate(image: UnpackedImage) -> None:
    job = new_job("image")
    with LocalCluster(nodes=2, job=job, k=1, replicator_command=replicator_in(image)) as cluster:
        a, b = cluster.nodes
        source = write_step(a.root, job, 0, 7, world_size=2, sizes=(3 << 20, 1000), files=2, seed=7)
        replica = replica_path(b, job, 0, 7)
        try:
            cluster.wait_for(lambda: committed(replica), timeout=60, what="the replica on node-1")
        except TimeoutError:
            raise AssertionError("\n".join(n.log_text()[-3000:] for n in cluster.nodes)) from None
        assert step_files(replica) == step_files(source)


@pytest.fixture
def operator_node(image: UnpackedImage) -> Iterator[Node]:
    """A node of the netns cluster for the operator (its replicator, from the image too, stays up)."""

    with LocalCluster(nodes=1, job=new_job("op"), replicator_command=replicator_in(image)) as cluster:
        yield cluster.nodes[0]


def test_the_operator_from_the_image_answers(image: UnpackedImage, operator_node: Node) -> None:
    work = Path(tempfile.mkdtemp(prefix="tierckpt-image-op-"))
    port_file = work / "emulator.json"
    serve = [sys.executable, str(TESTS / "fixtures/k8s_emulator.py"), "--host", operator_node.ip]
    emulator = operator_node.popen_in_node(
        [*serve, "--port-file", str(port_file)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    started: list[subprocess.Popen[bytes]] = []

    def start(args: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
        # the chart mounts the CA Secret readable by the operator's user (fsGroup)
        for path in work.iterdir():
            os.chown(path, 65532, 65532)
        cmd = image.command(["tierckpt-operator", *args], binds=[work], env=env)
        with open(log, "wb") as out:
            started.append(operator_node.popen_in_node(cmd, stdout=out, stderr=out, start_new_session=True))
        return started[-1]

    try:
        LocalCluster.wait_for(port_file.exists, timeout=30, what="the API emulator")
        url = json.loads(port_file.read_text())["url"]
        os.chmod(work, 0o755)
        check_operator_process(url, work, start, host=operator_node.ip)
    finally:
        for proc in [*started, emulator]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


def test_the_csi_plugin_from_the_image_answers(image: UnpackedImage) -> None:
    base = Path(tempfile.mkdtemp(prefix="tcsi-img-"))  # unix socket paths are short
    (base / "pods").mkdir()
    (base / "csi").mkdir()
    endpoint = f"unix://{base}/csi/csi.sock"
    serve = ["tierckpt-csi", "serve", "--node-id", "node-a", "--endpoint", endpoint]
    serve += ["--ramdisk", str(base / "ramdisk"), "--ramdisk-size", "64Mi", "--huge", "never"]
    serve += ["--pods-dir", str(base / "pods"), "--health-address", ""]
    log = base / "plugin.log"
    with open(log, "wb") as out:
        plugin = subprocess.Popen(
            image.command(serve, user=(0, 0), capabilities=CSI_CAPABILITIES, binds=[base]),
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        with connect(endpoint) as client:
            while True:
                assert plugin.poll() is None, log.read_text()
                try:
                    if client.identity.Probe(csi_pb2.ProbeRequest(), timeout=1).ready.value:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            info = client.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
            assert (info.name, info.vendor_version) == (Csi.DRIVER, tierckpt.__version__)
            assert client.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest()).node_id == "node-a"
        probe = image.run(["tierckpt-csi", "probe", "--endpoint", endpoint], user=(0, 0), binds=[base])
        assert probe.returncode == 0, probe.stdout + probe.stderr
    finally:
        if plugin.poll() is None:
            plugin.kill()
            plugin.wait(10)
        shutil.rmtree(base, ignore_errors=True)


def test_the_cli_in_the_image_verifies_steps(image: UnpackedImage, tmp_path: Path) -> None:
    root = tmp_path / "ramdisk"
    step = write_step(root, "job_a", 0, 3, sizes=(1 << 20, 777), files=2, seed=3)
    os.chmod(tmp_path, 0o755)
    good = image.run(["tierckpt", "verify", str(root), "--json"], binds=[tmp_path])
    assert good.returncode == 0, good.stdout + good.stderr
    assert [s["verdict"] for s in json.loads(good.stdout)["steps"]] == ["ok"]
    data = next(iter(sorted(p for p in step.iterdir() if p.name.startswith("data-"))))
    with open(data, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    bad = image.run(["tierckpt", "verify", str(root), "--json"], binds=[tmp_path])
    assert bad.returncode != 0
    assert data.name in bad.stdout + bad.stderr


def test_the_training_image_saves_and_loads(training_image: UnpackedImage, tmp_path: Path) -> None:
    with fresh_ramdisk_dir(tmp_path, "image") as root:
        os.chmod(root, 0o777)
        env = {"TIERCKPT_ROOT": str(root / "not-yet")}
        done = training_image.run(["python", "-c", SAVE_AND_LOAD], binds=[root], env=env)
    assert done.returncode == 0 and "saved and loaded step 5" in done.stdout, done.stdout + done.stderr
    # what deploy/examples/jobset.yaml's launch script runs
    for program in ("bash", "sed", "torchrun", "tierckpt"):
        found = training_image.run(["bash", "-c", f"command -v {program}"])
        assert found.returncode == 0, (program, found.stderr)
