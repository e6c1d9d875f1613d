"""The whole demo, as a user runs it (``tierckpt demo``), at small sizes: real replicator processes,
tmpfs ramdisks and network namespaces (root) or loopback ports, fake-gcs-server, gloo training.

Each run's JSON report must show every scenario restored from the expected tier with a bit-exact
state and identical replayed losses; and nothing the run started may be left behind: no process,
namespace or mount of its cluster, also after Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tierckpt_demo.report import DemoReport

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SMALL = [
    "--nodes",
    "4",
    "--model-size",
    "tiny",
    "--steps",
    "16",
    "--checkpoint-every",
    "4",
    "--timeout",
    "120",
]
TIERCKPT = str(Path(sys.executable).parent / "tierckpt")


def _leftovers(pid: int) -> list[str]:
    """Anything still around from the cluster of the demo process ``pid``: processes, mounts, namespaces."""
    tag = f"tierckpt-cluster-{pid}-"
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if tag in cmd:
            found.append(f"process {proc.info['pid']}: {cmd[:120]}")
    found += [f"mount {line}" for line in Path("/proc/mounts").read_text().splitlines() if tag in line]
    if os.geteuid() == 0:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        found += [f"netns {n}" for n in names if n.startswith(f"tck{pid % 100000}")]
    return found


def _run_demo(*args: str, timeout: float = 280) -> tuple[subprocess.CompletedProcess[str], int]:
    proc = subprocess.Popen(
        [TIERCKPT, "demo", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"the demo did not finish in {timeout} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.pid


def _check_report(report: DemoReport, network: str) -> None:
    assert report.ok, [(w, c.name, c.detail) for w, c in report.failed_checks] or report.error
    assert report.config.network == network
    by_name = {s.name: s for s in report.scenarios}
    assert list(by_name) == ["local", "peer", "gcs"]
    for s in report.scenarios:
        assert s.restored_step == s.expected_step and s.restored_step is not None
        assert all(r.step == s.restored_step and r.state_sha256 == r.reference_sha256 for r in s.ranks)
        assert all(r.tier == r.expected_tier for r in s.ranks)
        assert s.replayed_steps >= 1 and s.bytes > 0
        assert {c.name for c in s.checks} == {"step", "tier", "state", "loss"} and all(c.ok for c in s.checks)
    assert {r.tier for r in by_name["local"].ranks} == {"local"}
    peer = by_name["peer"]
    assert len(peer.lost_nodes) == 1
    assert [r.tier for r in peer.ranks if r.lost] == ["peer"]
    assert {r.tier for r in peer.ranks if not r.lost} == {"local"}
    gcs = by_name["gcs"]
    assert len(gcs.lost_nodes) >= 2
    assert "gcs" in {r.tier for r in gcs.ranks if r.lost}
    assert {r.tier for r in gcs.ranks if not r.lost} == {"local"}
    assert sorted(report.losses) == list(range(1, report.config.steps + 1))
    assert [(c.name, c.ok) for c in report.checks] == [("curve", True), ("in-sync", True)]


@pytest.mark.root
def test_demo_on_network_namespaces() -> None:
    result, pid = _run_demo(*SMALL, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    _check_report(DemoReport.from_bytes(result.stdout), "netns")
    assert "ALL CHECKS PASSED" in result.stderr and "Traceback" not in result.stderr
    assert _leftovers(pid) == []


def test_demo_on_loopback_ports() -> None:
    """The path that works without root: loopback ports and plain directories as ramdisks."""
    result, pid = _run_demo(*SMALL, "--loopback", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    _check_report(DemoReport.from_bytes(result.stdout), "loopback")
    assert _leftovers(pid) == []


@pytest.mark.root
def test_demo_with_a_replica_group_shows_the_bytes_saved() -> None:
    """Data-parallel ranks saved as one replica group: every recovery still bit-exact, and the report
    counts what the replicators did not send (each replica linked to the identical copy of another
    member that its peer already holds)."""
    result, pid = _run_demo(*SMALL, "--replica-group", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = DemoReport.from_bytes(result.stdout)
    _check_report(report, "netns")
    d = report.dedup
    assert d["written"] == d["written_logical"] > 0  # one member per node: each node writes its copy
    # Without dedup every byte would be sent (replicated == replicated_logical). With it most replicas
    # are links; what is still sent is the restores' peer fetches and a copy made before a member's
    # identical step was known.
    assert d["replicated_logical"] > 0 and d["replicated"] < d["replicated_logical"] // 2
    assert "replica group: " in result.stderr and "saved" in result.stderr
    assert _leftovers(pid) == []


@pytest.mark.root
def test_ctrl_c_twice_cleans_up_everything() -> None:
    proc = subprocess.Popen(
        [TIERCKPT, "demo", *SMALL], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        seen.append(line)
        if "segment 1:" in line or time.monotonic() > deadline:
            break
    assert any("segment 1:" in line for line in seen), "".join(seen)[-3000:]
    assert _leftovers(proc.pid), "the cluster should be running now"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)  # an impatient second Ctrl-C must not cut the cleanup short
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, rest[-3000:]
    assert "interrupted" in rest and "Traceback" not in rest
    deadline = time.monotonic() + 10
    while _leftovers(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _leftovers(proc.pid) == []


def test_a_wrong_restore_fails_the_demo() -> None:
    """Negative control: rank 0 flips one bit of its state after the first restore; the demo must say so
    (the state check names the rank) and exit 1."""
    result, pid = _run_demo(*SMALL, "--loopback", "--scenarios", "local", "--flip-restored-bit", "--json")
    assert result.returncode == 1, result.stderr[-3000:]
    report = DemoReport.from_bytes(result.stdout)
    assert not report.ok and not report.error
    (local,) = report.scenarios
    failed = {c.name: c for c in local.checks if not c.ok}
    assert (
        "state" in failed and "rank 0:" in failed["state"].detail and "rank 1" not in failed["state"].detail
    )
    assert [r.rank for r in local.ranks if r.state_sha256 != r.reference_sha256] == [0]
    assert "SOME CHECKS FAILED" in result.stderr and "Traceback" not in result.stderr
    assert _leftovers(pid) == []
