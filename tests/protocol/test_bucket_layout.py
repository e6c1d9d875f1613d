"""The bucket layout: every key is built and parsed by tierckpt.protocol.bucket_layout, jobs never collide."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt.protocol.bucket_layout import (
    BucketLayout,
    RankBackup,
    RankRef,
    StepBackup,
    job_from_prefix,
    job_prefix,
    parse_gs_url,
    save_name,
    split_job_id,
)
from tierckpt.protocol.contract import job_id_for
from tierckpt.protocol.errors import FormatError

dns = st.from_regex(r"\A[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?\Z")
uid = st.from_regex(r"\A[a-f0-9]{8}[a-f0-9-]{0,20}\Z")
local_job = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,40}\Z").filter(lambda j: j not in (".", ".."))
steps = st.integers(0, 10**12 - 1)
ranks = st.integers(0, 99_999)


def test_kubernetes_job_keys_hold_namespace_jobset_and_uid() -> None:
    job = job_id_for("team-a", "llama.train", "0123ABCD-ffff")
    layout = BucketLayout("ckpt/prod")
    assert split_job_id(job) == ("team-a", "llama.train", "0123abcd")
    assert layout.job(job) == "ckpt/prod/jobs/team-a/llama.train/0123abcd/"
    assert (
        layout.complete_key(job, 7) == "ckpt/prod/jobs/team-a/llama.train/0123abcd/complete/000000000007.json"
    )
    key = layout.rank_file_key(job, 7, 3, "data-00001.bin", save_name(0xBEEF))
    assert key == (
        "ckpt/prod/jobs/team-a/llama.train/0123abcd/steps/000000000007/rank-00003/0000beef/data-00001.bin"
    )
    assert layout.rank_file_key(job, 7, 3, "COMMIT", None).endswith("/rank-00003/COMMIT")  # layouts 1-3
    assert layout.chunk_list_key(job, 7, 3, "0000beef").endswith("/chunklists/00003-0000beef.json")


def test_local_ids_live_under_local() -> None:
    assert job_prefix("", "demo") == "local/demo/"
    assert job_prefix("p", "my_run") == "p/local/my_run/"


def test_a_namespace_called_local_cannot_collide_with_a_local_job() -> None:
    k8s = job_id_for("local", "x", "abcdefgh")
    assert not job_prefix("p", k8s).startswith(job_prefix("p", "x"))
    assert not job_prefix("p", "x").startswith(job_prefix("p", k8s))


@settings(deadline=None)
@given(ns=dns, name=dns, u=uid, other=local_job)
def test_job_prefixes_are_prefix_free(ns: str, name: str, u: str, other: str) -> None:
    a, b = job_prefix("t", job_id_for(ns, name, u)), job_prefix("t", other)
    if job_id_for(ns, name, u) != other:
        assert not a.startswith(b) and not b.startswith(a)


@settings(deadline=None)
@given(
    job=st.one_of(local_job, st.builds(job_id_for, dns, dns, uid)),
    step=steps,
    rank=ranks,
    save=st.one_of(st.none(), st.builds(save_name, st.integers(0, 2**32 - 1))),
)
def test_every_key_parses_back(job: str, step: int, rank: int, save: str | None) -> None:
    layout = BucketLayout("a/b")
    cases = {
        layout.complete_key(job, step): ("complete", None, None, None, None),
        layout.started_key(job, step): ("started", None, None, None, None),
        layout.rank_commit_key(job, step, rank): ("rank_commit", rank, None, None, None),
        layout.rank_file_key(job, step, rank, "data-00002.bin", save): (
            "rank_file",
            rank,
            "data-00002.bin",
            None,
            save,
        ),
        layout.rank_file_key(job, step, rank, "COMMIT", save): ("rank_file", rank, "COMMIT", None, save),
        layout.part_key(job, step, rank, "objects.pkl", 31, save): ("part", rank, "objects.pkl", 31, save),
        layout.chunk_list_key(job, step, rank, save): ("chunk_list", rank, None, None, save),
        layout.writer_key(job, step, "node-a.0123abcd"): ("writer", None, None, None, None),
    }
    for key, (kind, r, f, part, s) in cases.items():
        parsed = layout.parse(key)
        assert parsed is not None and parsed.job == job, key
        assert (parsed.kind, parsed.step, parsed.rank, parsed.file, parsed.part, parsed.save) == (
            kind,
            step,
            r,
            f,
            part,
            s,
        )
    assert layout.chunk_list_key(job, step, rank, save).startswith(layout.chunk_lists_of(job, step, rank))
    assert layout.step_of_dir(job, layout.step_dir(job, step)) == step
    assert layout.step_of_complete(job, layout.complete_key(job, step)) == step
    assert layout.rank_of_commit(job, step, layout.rank_commit_key(job, step, rank)) == rank
    assert layout.step_of_writer(job, layout.writer_key(job, step, "n.1")) == step
    fence = layout.parse(layout.purge_fence_key(job))
    assert fence is not None and (fence.job, fence.kind, fence.step) == (job, "fence", None)


def test_keys_outside_the_prefix_or_malformed_are_not_ours() -> None:
    layout = BucketLayout("t")
    assert layout.parse("other/local/demo/complete/000000000001.json") is None
    assert layout.parse("t/jobs/ns/name") is None
    assert job_from_prefix("t", "t/jobs/NS/name/abcdefgh/x") is None  # not a DNS name: not a k8s job id
    parsed = layout.parse("t/local/demo/steps/000000000001/rank-00000/../../x")
    assert parsed is not None and parsed.kind == "other"


@pytest.mark.parametrize("bad", ["../x", "a//b", "a/./b", "a b", "x/.."])
def test_bad_prefixes_are_refused(bad: str) -> None:
    with pytest.raises(FormatError):
        BucketLayout(bad)


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".hidden", "x" * 161])
def test_writer_names_are_one_safe_key_segment(bad: str) -> None:
    with pytest.raises(FormatError):
        BucketLayout("t").writer_key("demo", 1, bad)


@pytest.mark.parametrize("bad", ["../evil", "a/b", "", "data-1.bin"])
def test_file_names_cannot_escape_the_rank(bad: str) -> None:
    with pytest.raises(FormatError):
        BucketLayout("t").rank_file_key("demo", 1, 0, bad, None)


@pytest.mark.parametrize("bad", ["..", "0000BEEF", "beef", "0000beef/x", "", "0000beeg"])
def test_save_names_are_eight_hex_digits(bad: str) -> None:
    with pytest.raises(FormatError):
        BucketLayout("t").rank_file_key("demo", 1, 0, "COMMIT", bad)
    with pytest.raises(FormatError):
        BucketLayout("t").chunk_list_key("demo", 1, 0, bad)


def test_a_rank_commit_names_the_save_of_its_own_manifest() -> None:
    fields: dict[str, Any] = dict(
        job="demo",
        step=1,
        rank=0,
        world_size=1,
        commit_size=10,
        commit_crc32c=1,
        manifest_size=20,
        manifest_crc32c=0xBEEF,
        total_bytes=0,
        saved_at=0.0,
        uploaded_by="n",
        uploaded_at=0.0,
    )
    assert RankBackup(**fields, save="0000beef").save == "0000beef"
    with pytest.raises(FormatError, match="not its manifest"):
        RankBackup(**fields, save="0000beee")


def test_gs_urls() -> None:
    assert parse_gs_url("gs://my-bucket/some/prefix/") == ("my-bucket", "some/prefix")
    assert parse_gs_url("gs://my-bucket") == ("my-bucket", "")
    for bad in ("s3://b/x", "gs://B/x", "gs://a"):
        with pytest.raises(FormatError):
            parse_gs_url(bad)


def test_a_completion_must_list_every_rank_exactly_once() -> None:
    ref = RankRef(size=10, crc32c=1, manifest_crc32c=2, total_bytes=3)
    done = StepBackup(
        job="demo", step=5, world_size=2, ranks={0: ref, 1: ref}, completed_by="n", completed_at=1.0
    )
    assert StepBackup.from_bytes(done.to_bytes()) == done
    assert done.total_bytes == 6
    for ranks in ({0: ref}, {0: ref, 2: ref}, {0: ref, 1: ref, 2: ref}):
        with pytest.raises(FormatError):
            StepBackup(job="demo", step=5, world_size=2, ranks=ranks, completed_by="n", completed_at=1.0)
