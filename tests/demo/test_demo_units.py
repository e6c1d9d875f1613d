"""The demo's pure parts: the timeline, the failure plans, the checks, model sizes, state hashes, the
report and the command's exit status. No processes here (test_demo_e2e.py runs the real thing)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from tierckpt.planning.placement import plan_node_peers
from tierckpt_cli.app import app
from tierckpt_demo import launch
from tierckpt_demo import run as demo_run
from tierckpt_demo import scenarios as sc
from tierckpt_demo.report import Check, DemoConfig, DemoReport, RankResult, ScenarioResult, render_report
from tierckpt_demo.training import MODEL_PRESETS, build_state, parse_model_size, state_sha256

# ------------------------------------------------------------------------------------- timeline


@pytest.mark.parametrize(
    ("steps", "every", "names"),
    [
        (40, 5, ("local", "peer", "gcs")),
        (16, 4, ("local", "peer", "gcs")),
        (9, 3, ("gcs",)),
        (100, 7, ("peer", "local")),
    ],
)
def test_segments_end_past_a_fresh_checkpoint(steps: int, every: int, names: tuple[str, ...]) -> None:
    segments = sc.plan_segments(steps, every, names)
    assert [s.scenario for s in segments] == [*names, None]
    assert segments[-1].until == steps and segments[-1].expected_restore is None
    previous_kill = 0
    for s in segments[:-1]:
        assert s.expected_restore is not None and s.expected_restore % every == 0
        assert previous_kill < s.expected_restore < s.until < steps  # a new checkpoint, then steps to replay
        assert s.until - s.expected_restore < every  # so the newest checkpoint is the expected one
        previous_kill = s.until


def test_segments_refuse_impossible_timelines() -> None:
    with pytest.raises(ValueError, match="too few"):
        sc.plan_segments(10, 5, ("local", "peer", "gcs"))
    with pytest.raises(ValueError, match="unknown scenario"):
        sc.plan_segments(40, 5, ("local", "meteor"))


# ------------------------------------------------------------------------------------- failures


def test_expected_tiers_follow_the_peer_plan() -> None:
    names = [f"node-{i}" for i in range(4)]
    peers = plan_node_peers({n: f"zone-{i % 2}" for i, n in enumerate(names)}, 1)
    ranks = dict(enumerate(names))
    assert sc.expected_tiers(ranks, peers, sc.lost_nodes("local", "node-1", peers)) == dict.fromkeys(
        range(4), "local"
    )
    lost = sc.lost_nodes("peer", "node-1", peers)
    assert lost == ("node-1",)
    assert sc.expected_tiers(ranks, peers, lost) == {0: "local", 1: "peer", 2: "local", 3: "local"}
    lost = sc.lost_nodes("gcs", "node-0", peers)
    assert lost == tuple(sorted({"node-0", *peers["node-0"]}))
    tiers = sc.expected_tiers(ranks, peers, lost)
    assert tiers[0] == "gcs"  # its node and every holder of its replica are gone
    for rank, node in ranks.items():
        if node not in lost:
            assert tiers[rank] == "local"
        elif rank != 0:
            assert tiers[rank] == ("gcs" if set(peers[node]) <= set(lost) else "peer")


def test_a_whole_cluster_lost_restores_everything_from_gcs() -> None:
    peers = {"a": ("b",), "b": ("a",)}
    lost = sc.lost_nodes("gcs", "a", peers)
    assert sc.expected_tiers({0: "a", 1: "b"}, peers, lost) == {0: "gcs", 1: "gcs"}


# ------------------------------------------------------------------------------------- checks


def _rank(
    rank: int, tier: str = "local", step: int | None = 10, sha: str = "aa", ref: str = "aa"
) -> RankResult:
    return RankResult(rank, f"node-{rank}", tier, "local", step, 100, 0.1, 0.05, 0.05, sha, ref)


def _checks(ranks: list[RankResult], replayed: dict[int, float]) -> dict[str, Check]:
    ref = sc.Reference(losses={11: 0.5, 12: 0.25}, saved={})
    checks, _ = sc.check_recovery(expected_step=10, ranks=ranks, reference=ref, replayed=replayed)
    return {c.name: c for c in checks}


def test_checks_pass_on_an_exact_recovery() -> None:
    checks = _checks([_rank(0), _rank(1)], {11: 0.5, 12: 0.25})
    assert all(c.ok for c in checks.values()), checks


def test_checks_catch_every_kind_of_wrong_recovery() -> None:
    checks = _checks([_rank(0), _rank(1, step=5)], {11: 0.5, 12: 0.25})
    assert not checks["step"].ok and "[5, 10]" in checks["step"].detail
    checks = _checks([_rank(0), _rank(1, tier="gcs")], {11: 0.5, 12: 0.25})
    assert not checks["tier"].ok and "rank 1: gcs (expected local)" in checks["tier"].detail
    checks = _checks([_rank(0), _rank(1, sha="ab")], {11: 0.5, 12: 0.25})
    assert not checks["state"].ok and "rank 1" in checks["state"].detail
    checks = _checks([_rank(0, ref="")], {11: 0.5, 12: 0.25})
    assert not checks["state"].ok  # no recorded hash is a failure, not a pass
    checks = _checks([_rank(0)], {11: 0.5, 12: 0.25000001})
    assert not checks["loss"].ok and "first at step 12" in checks["loss"].detail
    checks = _checks([_rank(0)], {})
    assert not checks["loss"].ok and "no replayed step" in checks["loss"].detail


def test_run_checks() -> None:
    good = sc.check_run(steps=3, losses={1: 0.5, 2: 0.4, 3: 0.3}, final_models={0: "x", 1: "x"}, world_size=2)
    assert [(c.name, c.ok) for c in good] == [("curve", True), ("in-sync", True)]
    bad = {
        c.name: c for c in sc.check_run(steps=3, losses={1: 0.5}, final_models={0: "x", 1: "y"}, world_size=2)
    }
    assert not bad["curve"].ok and "[2, 3]" in bad["curve"].detail
    assert not bad["in-sync"].ok and "2 different models" in bad["in-sync"].detail
    missing = sc.check_run(steps=1, losses={1: 0.5}, final_models={0: "x"}, world_size=2)
    assert not missing[1].ok


def test_reference_keeps_the_first_value() -> None:
    ref = sc.Reference()
    ref.record({1: 0.5}, {(0, 5): "x"})
    ref.record({1: 0.9, 2: 0.4}, {(0, 5): "y"})
    assert ref.losses == {1: 0.5, 2: 0.4} and ref.saved == {(0, 5): "x"}


# ------------------------------------------------------------------------------------- model and state


def test_model_sizes() -> None:
    for name, params in MODEL_PRESETS.items():
        assert abs(parse_model_size(name).params - params) / params < 0.02
    assert abs(parse_model_size("5M").params - 5_000_000) < 20_000
    assert abs(parse_model_size("250k").params - 250_000) < 2_000
    assert abs(parse_model_size("64MB").params - 16_000_000) < 40_000  # fp32 weights
    assert abs(parse_model_size("1GiB").params - (1 << 30) // 4) < 200_000
    for bad in ("huge", "12 parsecs", "-5M", "10"):
        with pytest.raises(ValueError):
            parse_model_size(bad)


def test_state_hash_sees_one_flipped_bit() -> None:
    _, _, a = build_state(parse_model_size("tiny"), seed=3)
    _, _, b = build_state(parse_model_size("tiny"), seed=3)
    assert state_sha256(a) == state_sha256(b)
    weight = b["model"]["layers.0.weight"]
    weight.view(torch.int32)[0, 0] ^= 1
    assert state_sha256(a) != state_sha256(b)
    _, _, c = build_state(parse_model_size("tiny"), seed=4)
    assert state_sha256(a) != state_sha256(c)


def test_optimizer_state_exists_before_the_first_step() -> None:
    """Adam's state is created eagerly, so Checkpointer.load can fill it in place."""
    net, opt, state = build_state(parse_model_size("tiny"), seed=0)
    saved = state["optim"]["state"]
    for i, p in enumerate(net.parameters()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert saved[i][key] is opt.state[p][key]  # the very tensors the optimizer updates


# ------------------------------------------------------------------------------------- report and exit status


def _report(ok: bool) -> DemoReport:
    checks = (Check("step", True, "ok"), Check("state", ok, "ok" if ok else "rank 1: sha256 differs"))
    result = ScenarioResult(
        "peer",
        "node lost",
        ok,
        22,
        20,
        20,
        ("node-1",),
        (_rank(0), _rank(1, tier="peer")),
        200,
        0.01,
        0.02,
        0.4,
        2,
        checks,
    )
    config = DemoConfig(4, 4, "netns", 1000, 12000, 40, 5, ("peer",), 1234, {"node-0": ("node-1",)})
    return DemoReport(
        ok=ok, config=config, scenarios=(result,), losses={1: 0.5, 2: 0.25}, timings={"total_s": 3.0}
    )


def test_report_round_trips_and_renders() -> None:
    from rich.console import Console

    report = _report(False)
    assert DemoReport.from_bytes(report.to_bytes()) == report
    assert report.to_dict()["kind"] == "tierckpt_demo-report" and report.to_dict()["version"] == 1
    console = Console(record=True, width=100)
    render_report(report, console)
    text = console.export_text()
    assert "node lost" in text and "SOME CHECKS FAILED" in text and "rank 1: sha256 differs" in text
    assert [name for name, _ in report.failed_checks] == ["peer"]


@pytest.mark.parametrize(("ok", "code"), [(True, 0), (False, 1)])
def test_demo_command_exit_status_and_json(monkeypatch: pytest.MonkeyPatch, ok: bool, code: int) -> None:
    seen = {}

    def fake_run(options: demo_run.DemoOptions, console: object) -> DemoReport:
        seen["options"] = options
        return _report(ok)

    monkeypatch.setattr(launch, "run_demo", fake_run)
    result = CliRunner().invoke(
        app,
        ["demo", "--nodes", "3", "--scenarios", "peer", "--steps", "20", "--json"],
        catch_exceptions=False,
    )
    assert result.exit_code == code
    assert DemoReport.from_bytes(result.stdout).ok is ok
    assert seen["options"].nodes == 3 and seen["options"].scenarios == ("peer",)


def test_demo_command_rejects_bad_options_cleanly() -> None:
    for args, needle in (
        (["--scenarios", "local,meteor"], "unknown"),
        (["--steps", "5"], "too few"),
        (["--model-size", "huge"], "model size"),
        (["--nodes", "1"], "at least 2 nodes"),
    ):
        result = CliRunner().invoke(app, ["demo", *args], catch_exceptions=False)
        assert result.exit_code == 2, (args, result.output)
        assert needle in result.stderr and "Traceback" not in result.output


def test_rank_ranges_and_tier_groups() -> None:
    from tierckpt.protocol.text import rank_ranges
    from tierckpt_demo.report import tier_groups

    assert rank_ranges([7, 0, 2, 3, 4]) == "0 2-4 7"
    assert rank_ranges([1, 2, 3, 9, 10, 12]) == "1-3 9-10 12"
    ranks = [_rank(0, tier="gcs"), _rank(1, tier="peer"), _rank(2), _rank(3)]
    assert [(t, [r.rank for r in rs]) for t, rs in tier_groups(ranks)] == [
        ("local", [2, 3]),
        ("peer", [1]),
        ("gcs", [0]),
    ]


def test_quickstart_documents_every_report_field() -> None:
    """docs/quickstart.md, "The JSON report", names every field of the report's messages."""
    import dataclasses
    import re
    from pathlib import Path

    from tierckpt_demo import report

    text = Path(__file__).resolve().parents[2].joinpath("docs", "quickstart.md").read_text()
    section = text[text.index("### The JSON report") : text.index("## 2. Change your training script")]
    documented = set(re.findall(r"`([a-z_0-9]+)(?:\[\])?`", section))
    for cls in (report.DemoReport, report.DemoConfig, report.ScenarioResult, report.RankResult, report.Check):
        missing = {f.name for f in dataclasses.fields(cls)} - documented
        assert not missing, f"{cls.__name__}: {sorted(missing)} not documented"
