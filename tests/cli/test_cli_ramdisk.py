"""``tierckpt ls``, ``verify`` and ``gc`` on real ramdisk directories written by the Checkpointer.

Covers: listing a root, a job, a rank, a replica and a step directory; committed, incomplete and
corrupt steps; verification of intact, bit-flipped, truncated and mismatched steps (naming the
damaged tensor); retention with --keep and --dry-run, leases, a live writer, stale leftovers; and
clean errors (exit code, one ``error:`` line, no traceback) for missing or unusable input.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.cli.cli_helpers import JOB, assert_clean_error, cli, cli_process, save_steps
from tierckpt.checkpointer import Checkpointer
from tierckpt.protocol import leases
from tierckpt.protocol.control import RestorePlan, Tier, write_control
from tierckpt.protocol.format import COMMIT_NAME, MANIFEST_NAME, read_commit, replica_rank_dir, step_dir

# ------------------------------------------------------------------------------------- ls


def test_ls_lists_every_committed_step_with_its_size(ramdisk: Path) -> None:
    result = cli("ls", str(ramdisk), "--json")
    assert result.code == 0, result.output
    steps = result.json()["steps"]
    assert sorted((s["rank"], s["step"]) for s in steps) == [(r, s) for r in (0, 1) for s in (10, 20, 30)]
    for s in steps:
        assert s["job"] == JOB and s["copy"] == "primary" and s["state"] == "committed"
        assert s["bytes"] == read_commit(s["path"]).total_bytes > 4096 * 4


def test_ls_table_names_jobs_ranks_and_states(ramdisk: Path) -> None:
    result = cli("ls", str(ramdisk))
    assert result.code == 0
    assert JOB in result.stdout and "committed" in result.stdout
    assert "1 job(s), 6 step(s) listed (6 committed)" in result.stdout


def test_ls_shows_incomplete_and_corrupt_steps(ramdisk: Path) -> None:
    rank0 = ramdisk / JOB / "rank-00000"
    leftover = step_dir(rank0, 40)
    leftover.mkdir()
    (leftover / "data-00000.bin").write_bytes(b"x" * 100)
    (step_dir(rank0, 30) / COMMIT_NAME).write_text("{not json")
    states = {s["step"]: s for s in cli("ls", str(rank0), "--json").json()["steps"]}
    assert states[40]["state"] == "incomplete" and states[40]["bytes"] == 100
    assert states[30]["state"] == "corrupt" and "commit marker" in states[30]["detail"]
    assert states[20]["state"] == states[10]["state"] == "committed"


def test_ls_accepts_job_rank_replica_and_step_directories(ramdisk: Path) -> None:
    src = step_dir(ramdisk / JOB / "rank-00001", 30)
    replica = step_dir(replica_rank_dir(ramdisk, JOB, 1), 30)
    shutil.copytree(src, replica)
    job = cli("ls", str(ramdisk / JOB), "--json").json()["steps"]
    assert len(job) == 7 and {s["copy"] for s in job} == {"primary", "replica"}
    rank = cli("ls", str(ramdisk / JOB / "rank-00000"), "--json").json()["steps"]
    assert {(s["rank"], s["step"]) for s in rank} == {(0, 10), (0, 20), (0, 30)}
    rep = cli("ls", str(replica.parent), "--json").json()["steps"]
    assert [(s["copy"], s["rank"], s["step"], s["state"]) for s in rep] == [("replica", 1, 30, "committed")]
    one = cli("ls", str(src), "--json").json()["steps"]
    assert [(s["rank"], s["step"]) for s in one] == [(1, 30)]


def test_ls_names_the_holders_of_leases(ramdisk: Path) -> None:
    rank0 = ramdisk / JOB / "rank-00000"
    leases.acquire(rank0, 20, "replicator-node-1", ttl=300)
    leases.acquire(rank0, 20, "client-42", ttl=300)
    expired = leases.acquire(rank0, 30, "gone", ttl=300)
    (rank0 / "leases" / f"{30:012d}.gone.json").write_bytes(
        dataclasses.replace(expired, expires_at=time.time() - 1).to_bytes()
    )
    steps = {s["step"]: s for s in cli("ls", str(rank0), "--json").json()["steps"]}
    assert steps[20]["leases"] == ["client-42", "replicator-node-1"]
    assert steps[30]["leases"] == [] and steps[10]["leases"] == []
    assert "client-42" in cli("ls", str(rank0)).stdout


def test_ls_job_filter_and_empty_directory(ramdisk: Path, tmp_path: Path) -> None:
    save_steps(ramdisk, job="other-job", steps=(5,))
    assert {s["job"] for s in cli("ls", str(ramdisk), "--json").json()["steps"]} == {JOB, "other-job"}
    only = cli("ls", str(ramdisk), "--job", "other-job", "--json").json()["steps"]
    assert [(s["job"], s["step"]) for s in only] == [("other-job", 5)]
    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli("ls", str(empty))
    assert result.code == 0 and "nothing found" in result.stdout


def test_ls_missing_path_and_file_are_clean_errors(tmp_path: Path) -> None:
    assert_clean_error(cli("ls", str(tmp_path / "nope")), 2, "no such file or directory")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert_clean_error(cli("ls", str(a_file)), 2, "not a directory")


# ------------------------------------------------------------------------------------- verify


def test_verify_intact_steps(ramdisk: Path) -> None:
    result = cli("verify", str(ramdisk), "--json")
    assert result.code == 0, result.output
    doc = result.json()
    assert doc["ok"] is True
    assert [v["verdict"] for v in doc["steps"]] == ["ok"] * 6
    assert [(c["step"], c["ranks"], c["world_size"], c["complete"]) for c in doc["coverage"]] == [
        (s, [0, 1], 2, True) for s in (10, 20, 30)
    ]
    one_rank = cli("verify", str(ramdisk / JOB / "rank-00001"), "--json").json()["coverage"]
    assert {(c["step"], c["complete"]) for c in one_rank} == {(10, False), (20, False), (30, False)}
    assert (
        "step 30: ranks 0-1 of 2 verified; complete here"
        in cli("verify", str(ramdisk), env={"COLUMNS": "200"}).stdout
    )


def test_ls_verify_and_gc_import_no_torch(ramdisk: Path) -> None:
    """The daemons' image has no torch: the ramdisk commands read file names and checksums from the
    torch-free kernel (``tierckpt.protocol.format``, ``tierckpt.verify``), never from the client."""
    code = (
        "import sys; from typer.testing import CliRunner; from tierckpt_cli.app import app\n"
        f"for args in (['ls', {str(ramdisk)!r}], ['verify', {str(ramdisk)!r}],"
        f" ['gc', {str(ramdisk)!r}, '--dry-run']):\n"
        "    assert CliRunner().invoke(app, args).exit_code == 0, args\n"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_verify_names_the_damaged_tensor_after_a_bit_flip(ramdisk: Path) -> None:
    path = step_dir(ramdisk / JOB / "rank-00001", 20)
    data = path / "data-00000.bin"
    with open(data, "r+b") as f:  # inside the first tensor ("w" comes first: 16 KiB of float32)
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x10]))
    result = cli("verify", str(ramdisk), "--json")
    assert result.code == 1
    bad = [v for v in result.json()["steps"] if v["verdict"] != "ok"]
    assert [(v["rank"], v["step"], v["verdict"]) for v in bad] == [(1, 20, "corrupt")]
    assert "'w'" in bad[0]["problems"][0] and "crc32c" in bad[0]["problems"][0]
    step20 = next(c for c in result.json()["coverage"] if c["step"] == 20)
    assert (step20["ranks"], step20["complete"]) == ([0], False)
    table = cli("verify", str(ramdisk))
    assert table.code == 1 and "corrupt" in table.stdout and "1 corrupt step(s)" in table.stderr


def test_verify_truncated_file_and_tampered_manifest(ramdisk: Path) -> None:
    rank0 = ramdisk / JOB / "rank-00000"
    data = step_dir(rank0, 10) / "data-00000.bin"
    os.truncate(data, data.stat().st_size - 256)
    manifest = step_dir(rank0, 20) / MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes().replace(b'"float32"', b'"float64"', 1))
    verdicts = {v["step"]: v for v in cli("verify", str(rank0), "--json").json()["steps"]}
    assert verdicts[10]["verdict"] == "corrupt" and "bytes, manifest says" in verdicts[10]["problems"][0]
    assert (
        verdicts[20]["verdict"] == "corrupt"
        and "does not match its commit marker" in verdicts[20]["problems"][0]
    )
    assert verdicts[30]["verdict"] == "ok"


def test_verify_skips_uncommitted_and_filters_by_step(ramdisk: Path) -> None:
    rank0 = ramdisk / JOB / "rank-00000"
    step_dir(rank0, 99).mkdir()
    doc = cli("verify", str(rank0), "--json").json()
    assert doc["ok"] is True and {v["step"]: v["verdict"] for v in doc["steps"]}[99] == "incomplete"
    one = cli("verify", str(ramdisk), "--step", "20", "--json").json()["steps"]
    assert sorted((v["rank"], v["step"]) for v in one) == [(0, 20), (1, 20)]


def test_verify_missing_path_is_a_clean_error(tmp_path: Path) -> None:
    assert_clean_error(cli("verify", str(tmp_path / "missing")), 2, "no such file or directory")


# ------------------------------------------------------------------------------------- gc


def _committed(rank_path: Path) -> list[int]:
    return sorted(
        int(p.name[5:])
        for p in rank_path.iterdir()
        if p.name.startswith("step-") and (p / COMMIT_NAME).exists()
    )


def test_gc_dry_run_changes_nothing(ramdisk: Path) -> None:
    result = cli("gc", str(ramdisk), "--keep", "1", "--dry-run", "--json")
    assert result.code == 0
    doc = result.json()
    assert [(r["rank"], r["kept"], r["removed"]) for r in doc["ranks"]] == [
        (0, [30], [10, 20]),
        (1, [30], [10, 20]),
    ]
    assert doc["freed_bytes"] > 0
    assert _committed(ramdisk / JOB / "rank-00000") == [10, 20, 30]


def test_gc_keeps_the_newest_and_leased_steps(ramdisk: Path) -> None:
    rank0 = ramdisk / JOB / "rank-00000"
    lease = leases.acquire(rank0, 10, "reader", ttl=300)
    result = cli("gc", str(ramdisk), "--keep", "1", "--json")
    assert result.code == 0, result.output
    by_rank = {r["rank"]: r for r in result.json()["ranks"]}
    assert (by_rank[0]["kept"], by_rank[0]["held"], by_rank[0]["removed"]) == ([30], [10], [20])
    assert by_rank[1]["removed"] == [10, 20]
    assert _committed(rank0) == [10, 30] and not step_dir(rank0, 20).exists()
    assert _committed(ramdisk / JOB / "rank-00001") == [30]
    leases.release(rank0, lease)
    assert cli("verify", str(ramdisk), "--json").json()["ok"] is True


def test_gc_keeps_the_step_of_the_replicators_restore_plan_and_ls_skips_its_state(ramdisk: Path) -> None:
    plan = RestorePlan(job=JOB, step=10, world_size=2, sources={0: Tier.LOCAL, 1: Tier.LOCAL}, generation=1)
    write_control(ramdisk, JOB, RestorePlan.FILE, plan)  # in <root>/.tierckpt/jobs/<job>/, not the job dir
    result = cli("gc", str(ramdisk), "--keep", "1", "--json")
    assert result.code == 0, result.output
    by_rank = {r["rank"]: r for r in result.json()["ranks"]}
    assert (by_rank[0]["kept"], by_rank[0]["held"], by_rank[0]["removed"]) == ([30], [10], [20])
    listed = cli("ls", str(ramdisk), "--json").json()
    assert {s["job"] for s in listed["steps"]} == {JOB}  # the state directory is not a job


def test_gc_leaves_a_live_writer_alone(tmp_path: Path) -> None:
    root = tmp_path / "rd"
    save_steps(root, steps=(1, 2, 3))
    with Checkpointer(root=root, job=JOB, rank=0, world_size=1, keep=3):
        result = cli("gc", str(root), "--keep", "1", "--json")
        rank = result.json()["ranks"][0]
        assert rank["removed"] == [] and "running Checkpointer" in rank["skipped"]
        assert _committed(root / JOB / "rank-00000") == [1, 2, 3]
    rank = cli("gc", str(root), "--keep", "1", "--json").json()["ranks"][0]
    assert rank["removed"] == [1, 2] and not rank["skipped"]
    assert rank["spare_bytes"] > 0  # the slot pool's spare files, left for a next writer, are reclaimed
    assert not (root / JOB / "rank-00000" / ".spare").exists()


def test_gc_removes_stale_leftovers_only(ramdisk: Path) -> None:
    rank1 = ramdisk / JOB / "rank-00001"
    old, fresh = step_dir(rank1, 31), step_dir(rank1, 32)
    for d in (old, fresh):
        d.mkdir()
        (d / "data-00000.bin").write_bytes(b"\0" * 4096)
    past = time.time() - 3600
    os.utime(old, (past, past))
    result = cli("gc", str(rank1), "--keep", "3", "--stale-after", "600", "--json")
    assert result.json()["ranks"][0]["removed"] == [31]
    assert not old.exists() and fresh.exists() and _committed(rank1) == [10, 20, 30]


def test_gc_missing_path_is_a_clean_error(tmp_path: Path) -> None:
    assert_clean_error(cli("gc", str(tmp_path / "missing"), "--keep", "1"), 2, "no such file or directory")


# ------------------------------------------------------------------------------------- the real script


def test_console_script_errors_never_show_a_traceback(tmp_path: Path, ramdisk: Path) -> None:
    """The installed ``tierckpt`` script, as a user runs it: missing and corrupt input."""
    assert_clean_error(cli_process("ls", str(tmp_path / "nope")), 2, "no such file or directory")
    manifest = step_dir(ramdisk / JOB / "rank-00000", 30) / MANIFEST_NAME
    manifest.write_bytes(b"\0" * 10)
    result = cli_process("verify", str(ramdisk))
    assert_clean_error(result, 1, "corrupt step")
    assert "does not match its commit marker" in result.stdout
    bad_option = cli_process("gc", str(tmp_path), "--keep", "0")
    assert bad_option.code == 2 and "Traceback" not in bad_option.output and "--keep" in bad_option.stderr
    usage = cli_process("ls")
    assert usage.code == 2 and "Traceback" not in usage.output and "Missing argument" in usage.stderr


def test_a_missing_optional_dependency_is_a_clean_error(tmp_path: Path) -> None:
    """Without google-cloud-storage (an optional extra) ``ls gs://`` says what to install."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'google.cloud' or name.startswith('google.cloud.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    result = cli_process("ls", "gs://bucket/prefix", env={"PYTHONPATH": str(blocker)})
    assert_clean_error(result, 2, "pip install 'tierckpt[replicator]'")
