"""tierckpt.protocol.safefs: nothing a tenant plants in its tree (symlinks, ``..``, absolute paths) makes a
daemon read, write or delete outside that tree; with openat2 and with the component-by-component
fallback alike."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierckpt.protocol import safefs
from tierckpt.protocol.errors import FormatError, UnsafePathError
from tierckpt.protocol.safefs import Beneath


@pytest.fixture(params=["openat2", "fallback"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "fallback":
        monkeypatch.setattr(safefs, "_has_openat2", lambda: False)
    elif not safefs._has_openat2():
        pytest.skip("this kernel has no openat2")
    return str(request.param)


@pytest.fixture
def trees(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """Two job trees side by side: ``a`` (the tenant's) and ``b`` (the victim's, with a secret)."""
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "rank-00000").mkdir(parents=True)
    (b / "rank-00000").mkdir(parents=True)
    (b / "rank-00000" / "secret").write_bytes(b"weights of job b")
    yield a, b


def test_reads_writes_and_lists_inside_the_tree(mode: str, trees: tuple[Path, Path]) -> None:
    a, _ = trees
    with Beneath.open(a.parent, "a") as tree:
        tree.makedirs("control/deep")
        tree.write_atomic("control/deep/x.json", b"{}")
        assert tree.read_bytes("control/deep/x.json", limit=10) == b"{}"
        assert sorted(tree.listdir("")) == ["control", "rank-00000"]
        assert tree.exists("control/deep/x.json") and not tree.exists("control/nope")
        tree.rename("control/deep/x.json", "control/y.json")
        assert (a / "control" / "y.json").read_bytes() == b"{}"
        tree.remove_tree("control")
        assert not (a / "control").exists()


def test_a_symlinked_directory_is_refused_everywhere(mode: str, trees: tuple[Path, Path]) -> None:
    a, b = trees
    (a / "rank-00001").symlink_to(b / "rank-00000")  # job a's "rank 1" is job b's rank 0
    with Beneath.open(a.parent, "a") as tree:
        with pytest.raises(UnsafePathError):
            tree.read_bytes("rank-00001/secret", limit=100)
        with pytest.raises(UnsafePathError):
            tree.sub("rank-00001")
        with pytest.raises(UnsafePathError):
            tree.write_atomic("rank-00001/planted", b"x")
        with pytest.raises(UnsafePathError):
            tree.listdir("rank-00001")
        with pytest.raises(UnsafePathError):
            tree.open_fd("rank-00001", os.O_RDONLY | os.O_DIRECTORY)
        tree.remove_tree("rank-00001")  # removes the link itself
    assert (b / "rank-00000" / "secret").read_bytes() == b"weights of job b", "the victim is untouched"
    assert not (a / "rank-00001").exists() and not (b / "rank-00000" / "planted").exists()


def test_a_symlinked_file_and_a_planted_temporary_file_are_not_followed(
    mode: str, trees: tuple[Path, Path]
) -> None:
    a, b = trees
    victim = b / "rank-00000" / "secret"
    (a / "manifest.json").symlink_to(victim)
    (a / "policy.json.tmp").symlink_to(victim)  # the name write_atomic writes through first
    with Beneath.open(a.parent, "a") as tree:
        with pytest.raises(UnsafePathError):
            tree.read_bytes("manifest.json", limit=100)
        tree.write_atomic("policy.json", b"new")
    assert victim.read_bytes() == b"weights of job b"
    assert (a / "policy.json").read_bytes() == b"new" and not (a / "policy.json").is_symlink()


def test_absolute_and_climbing_paths_are_refused(mode: str, trees: tuple[Path, Path]) -> None:
    a, _ = trees
    with Beneath.open(a.parent, "a") as tree:
        for bad in ("/etc/passwd", "../b/rank-00000/secret", "rank-00000/../../b/rank-00000/secret"):
            with pytest.raises(UnsafePathError):
                tree.read_bytes(bad, limit=100)
        with pytest.raises(UnsafePathError):
            tree.remove_tree("")


def test_the_job_directory_itself_must_not_be_a_link(mode: str, trees: tuple[Path, Path]) -> None:
    a, b = trees
    (a.parent / "c").symlink_to(b)
    with pytest.raises(UnsafePathError):
        Beneath.open(a.parent, "c")


def test_reads_are_bounded_and_only_regular_files(mode: str, trees: tuple[Path, Path]) -> None:
    a, _ = trees
    (a / "big").write_bytes(b"x" * 1000)
    os.mkfifo(a / "fifo")
    with Beneath.open(a.parent, "a") as tree:
        with pytest.raises(FormatError, match="exceeds"):
            tree.read_bytes("big", limit=999)
        with pytest.raises(UnsafePathError, match="not a regular file"):
            tree.read_bytes("fifo", limit=10)


def test_the_python_310_removal_path_removes_links_not_their_targets(
    trees: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = trees
    (a / "rank-00000" / "nested").mkdir()
    (a / "rank-00000" / "nested" / "f").write_bytes(b"x")
    (a / "rank-00000" / "to-b").symlink_to(b / "rank-00000")
    monkeypatch.setattr(safefs.sys, "version_info", (3, 10, 0))
    with Beneath.open(a.parent, "a") as tree:
        tree.remove_tree("rank-00000")
    assert not (a / "rank-00000").exists()
    assert (b / "rank-00000" / "secret").read_bytes() == b"weights of job b"
