"""``tierckpt node-rank``: the pod's node rank from the downward-API annotations file.

Covers: an assigned rank, waiting until the operator writes it (the kubelet replaces the file
atomically), ``--env`` export lines, a timeout, and clean errors for a malformed or inconsistent
annotation and a missing volume.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import threading
import time
from pathlib import Path

from tests.cli.cli_helpers import assert_clean_error, cli
from tierckpt.protocol.contract import Annotations


def _write_podinfo(d: Path, **annotations: str) -> None:
    """Write the annotations file like the kubelet does: a new file renamed into place."""
    body = "".join(f'{k}="{v}"\n' for k, v in annotations.items())
    tmp = d / ".annotations.tmp"
    tmp.write_text(body)
    os.replace(tmp, d / "annotations")


def test_prints_the_assigned_rank(tmp_path: Path) -> None:
    _write_podinfo(tmp_path, **{Annotations.NODE_RANK: "3", Annotations.NUM_NODES: "8", "other": "x"})
    result = cli("node-rank", "--podinfo-dir", str(tmp_path))
    assert (result.code, result.stdout) == (0, "3\n")


def test_env_lines_evaluate_in_a_shell(tmp_path: Path) -> None:
    _write_podinfo(
        tmp_path,
        **{
            Annotations.NODE_RANK: "2",
            Annotations.NUM_NODES: "4",
            Annotations.ASSIGNMENT_GENERATION: "5",
            Annotations.JOB_ID: "ns_train_0123abcd",
        },
    )
    result = cli("node-rank", "--env", env={"TIERCKPT_PODINFO_DIR": str(tmp_path)})
    assert result.code == 0, result.output
    script = result.stdout + 'echo "$NODE_RANK $NNODES $TIERCKPT_ASSIGNMENT_GENERATION $TIERCKPT_JOB"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["2", "4", "5", "ns_train_0123abcd"]
    assert all(line.startswith("export ") and shlex.split(line) for line in result.stdout.splitlines())


def test_waits_until_the_operator_assigns_a_rank(tmp_path: Path) -> None:
    _write_podinfo(tmp_path, **{"jobset.sigs.k8s.io/jobset-name": "train"})

    def assign() -> None:
        time.sleep(0.5)
        _write_podinfo(tmp_path, **{"jobset.sigs.k8s.io/jobset-name": "train", Annotations.NODE_RANK: "1"})

    thread = threading.Thread(target=assign)
    thread.start()
    try:
        result = cli("node-rank", "--wait", "--interval", "0.05", "--podinfo-dir", str(tmp_path))
    finally:
        thread.join()
    assert (result.code, result.stdout) == (0, "1\n")
    assert "waiting for tierckpt.io/node-rank" in result.stderr


def test_attempt_waits_for_a_rank_of_that_restart_attempt(tmp_path: Path) -> None:
    _write_podinfo(
        tmp_path,
        **{
            Annotations.NODE_RANK: "0",
            Annotations.ASSIGNMENT_GENERATION: "1",
            Annotations.COORDINATOR: "train-0.train",
        },
    )
    stale = cli("node-rank", "--attempt", "2", "--podinfo-dir", str(tmp_path))
    assert_clean_error(stale, 1, "for attempt 2")

    def assign() -> None:
        time.sleep(0.3)
        _write_podinfo(
            tmp_path,
            **{
                Annotations.NODE_RANK: "5",
                Annotations.ASSIGNMENT_GENERATION: "2",
                Annotations.COORDINATOR: "train-3.train",
            },
        )

    thread = threading.Thread(target=assign)
    thread.start()
    try:
        result = cli(
            "node-rank",
            "--wait",
            "--attempt",
            "2",
            "--env",
            "--interval",
            "0.05",
            "--podinfo-dir",
            str(tmp_path),
        )
    finally:
        thread.join()
    assert result.code == 0, result.output
    assert "export NODE_RANK=5" in result.stdout and "export MASTER_ADDR=train-3.train" in result.stdout


def test_without_wait_an_unassigned_pod_fails_at_once(tmp_path: Path) -> None:
    (tmp_path / "annotations").write_text("")
    assert_clean_error(cli("node-rank", "--podinfo-dir", str(tmp_path)), 1, "use --wait")


def test_wait_gives_up_after_the_timeout(tmp_path: Path) -> None:
    result = cli(
        "node-rank", "--wait", "--timeout", "0.3", "--interval", "0.05", "--podinfo-dir", str(tmp_path)
    )
    assert_clean_error(result, 1, "after 0.3s")


def test_malformed_annotations_are_clean_errors(tmp_path: Path) -> None:
    _write_podinfo(tmp_path, **{Annotations.NODE_RANK: "three"})
    assert_clean_error(cli("node-rank", "--podinfo-dir", str(tmp_path)), 1, "is not an integer")
    _write_podinfo(tmp_path, **{Annotations.NODE_RANK: "-1"})
    assert_clean_error(cli("node-rank", "--podinfo-dir", str(tmp_path)), 1, "is negative")
    _write_podinfo(tmp_path, **{Annotations.NODE_RANK: "4", Annotations.NUM_NODES: "4"})
    assert_clean_error(cli("node-rank", "--podinfo-dir", str(tmp_path)), 1, "is not below")


def test_missing_volume_is_a_clean_error(tmp_path: Path) -> None:
    assert_clean_error(cli("node-rank", env={"TIERCKPT_PODINFO_DIR": ""}), 2, "TIERCKPT_PODINFO_DIR")
    assert_clean_error(cli("node-rank", "--podinfo-dir", str(tmp_path / "absent")), 2, "not a directory")
