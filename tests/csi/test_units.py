"""Pure parts of the CSI plugin: quantities, admission rules, mountinfo parsing, target path checks."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.csi.csi_helpers import Node, publish_request
from tierckpt.protocol.contract import Csi
from tierckpt.protocol.quantity import MAX_BYTES, format_bytes, parse_quantity
from tierckpt_csi.admission import JobUse, admit
from tierckpt_csi.errors import CsiError
from tierckpt_csi.mounts import parse_mountinfo
from tierckpt_csi.requests import check_target, parse_publish

GiB = 1 << 30


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64Gi", 64 * GiB),
        ("1.5Gi", 3 * GiB // 2),
        ("500M", 500_000_000),
        ("1k", 1000),
        ("1e9", 10**9),
        ("1073741824", GiB),
        ("0.5Ki", 512),
        (".5Mi", 1 << 19),
        ("1.1", 2),
        ("1Ei", 1 << 60),
        ("1E", 10**18),
        (" 2Mi ", 2 << 20),
        (str(MAX_BYTES), MAX_BYTES),
    ],
)
def test_parse_quantity(text: str, expected: int) -> None:
    assert parse_quantity(text) == expected


MALFORMED = ["", "Gi", "-1Gi", "1GB", "1 Gi", "1e3Gi", "lots", "1.2.3", "1ki", "0x10"]
# Refused too, though the kubernetes client's parser alone accepts them (like most of the above).
LENIENT = ["NaN", "Infinity", "1_000", "\u0661\u0662", "+1", "1K", "100m", "5u"]


@pytest.mark.parametrize("text", [*MALFORMED, *LENIENT])
def test_parse_quantity_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError, match="invalid quantity"):
        parse_quantity(text)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("1e400", "larger than the largest size"),
        ("1e99999999999", "larger than the largest size"),
        ("9" * 40, "larger than the largest size"),
        ("8Ei", "larger than the largest size"),
        (str(MAX_BYTES + 1), "larger than the largest size"),
        ("-1", "cannot be negative"),
        ("-1e400", "cannot be negative"),
    ],
)
def test_parse_quantity_refuses_huge_and_negative_sizes_clearly(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"invalid quantity .*{why}"):
        parse_quantity(text)


@given(st.integers(0, MAX_BYTES), st.sampled_from([("", 1), ("k", 1000), ("Mi", 1 << 20), ("E", 10**18)]))
def test_parse_quantity_reads_whole_numbers_exactly(n: int, suffix: tuple[str, int]) -> None:
    text, unit = suffix
    if n * unit > MAX_BYTES:
        with pytest.raises(ValueError, match="larger than"):
            parse_quantity(f"{n}{text}")
    else:
        assert parse_quantity(f"{n}{text}") == n * unit


def test_a_huge_reservation_is_an_invalid_argument(tmp_path: Path) -> None:
    node = Node(tmp_path, tmp_path / "ramdisk", tmp_path / "pods", "unix://unused")
    req = publish_request(node, "team-a_job_0a1b2c3d", reservation="1e400")
    with pytest.raises(CsiError, match="larger than the largest size") as info:
        parse_publish(req, pods_dir=node.pods)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    req.volume_context[Csi.RESERVATION] = "64Mi"
    assert parse_publish(req, pods_dir=node.pods).reservation == 64 << 20


def test_format_bytes() -> None:
    got = [format_bytes(n) for n in (0, 1023, 1024, 64 * GiB, 3 << 50, MAX_BYTES)]
    assert got == ["0B", "1023B", "1.0Ki", "64.0Gi", "3.0Pi", "8192.0Pi"]


def _admit(
    job: str, new: JobUse, active: dict[str, JobUse], *, size=100 * GiB, used=0, avail=500 * GiB, headroom=GiB
):
    return admit(
        job, new, active, ramdisk_size=size, ramdisk_used=used, mem_available=avail, headroom=headroom
    )


def test_admission_rules() -> None:
    assert _admit("a", JobUse(60 * GiB, 0), {}).admitted
    refused = _admit("b", JobUse(50 * GiB, 0), {"a": JobUse(60 * GiB, 10 * GiB)})
    assert not refused.admitted
    assert "only 40.0Gi of 100.0Gi is unreserved (held by a (60.0Gi))" in refused.reason
    assert _admit("b", JobUse(40 * GiB, 0), {"a": JobUse(60 * GiB, 10 * GiB)}).admitted
    assert "only 100.0Gi" in _admit("a", JobUse(101 * GiB, 0), {}).reason
    # Memory: job a may still write 50Gi, b 40Gi: 90Gi of growth needs MemAvailable >= 91Gi (1Gi headroom).
    active = {"a": JobUse(60 * GiB, 10 * GiB)}
    assert not _admit("b", JobUse(40 * GiB, 0), active, used=10 * GiB, avail=90 * GiB).admitted
    assert _admit("b", JobUse(40 * GiB, 0), active, used=10 * GiB, avail=91 * GiB).admitted
    # Bytes already on the ramdisk are already out of MemAvailable; growth is capped by free ramdisk space.
    assert _admit("b", JobUse(40 * GiB, 0), active, used=95 * GiB, avail=7 * GiB).admitted


@given(st.lists(st.integers(1, 100), max_size=5), st.integers(1, 100), st.integers(100, 200))
def test_admitted_reservations_never_exceed_the_ramdisk(held: list[int], ask: int, size: int) -> None:
    active = {f"j{i}": JobUse(r * GiB, 0) for i, r in enumerate(held)}
    verdict = _admit("new", JobUse(ask * GiB, 0), active, size=size * GiB, avail=10**6 * GiB)
    assert verdict.admitted == (sum(held) + ask <= size)


def test_parse_mountinfo_unescapes_paths() -> None:
    text = (
        "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n"
        "600 25 0:77 /team-a_job_0a1b2c3d /var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/my\\040vol/mount "
        "rw,nosuid,nodev,noexec shared:300 - tmpfs tierckpt-ramdisk rw,size=65536k\n"
    )
    first, second = parse_mountinfo(text)
    assert (first.device, first.root, first.mount_point, first.fstype) == ("98:0", "/mnt1", "/mnt2", "ext3")
    assert second.mount_point == "/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/my vol/mount"
    assert (second.root, second.source) == ("/team-a_job_0a1b2c3d", "tierckpt-ramdisk")


def test_check_target_accepts_kubelet_paths_only(tmp_path: Path) -> None:
    pods = tmp_path / "pods"
    (pods / "uid-1" / "volumes" / "kubernetes.io~csi" / "ckpt").mkdir(parents=True)
    good = pods / "uid-1" / "volumes" / "kubernetes.io~csi" / "ckpt" / "mount"
    assert check_target(str(good), pods, "uid-1") == good
    for bad, uid in (
        (str(good), "uid-2"),
        (str(good), "../pods"),
        (f"{pods}/uid-1/../../etc/x", ""),
        ("/etc/passwd", ""),
        ("relative/path", ""),
        ("", ""),
        (str(pods), ""),
    ):
        with pytest.raises(CsiError) as info:
            check_target(bad, pods, uid)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
