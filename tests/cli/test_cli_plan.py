"""``tierckpt plan``: the recommended settings and the goodput they give, and a soak run compared."""

from __future__ import annotations

from pathlib import Path

from tests.cli.cli_helpers import assert_clean_error, cli
from tierckpt.planning.goodput import SoakFailure, SoakResult

ARGS = (
    "plan",
    "--nodes", "4096",
    "--node-mtbf-hours", "8760",
    "--save-s", "2",
    "--restore-local-s", "15",
    "--restore-peer-s", "40",
    "--checkpoint-gib", "32768",
    "--bucket-gib-s", "50",
)  # fmt: skip


def test_it_recommends_the_intervals_and_the_factor_and_states_the_goodput() -> None:
    out = cli(*ARGS, "--json").json()
    rec = out["recommended"]
    assert rec["factor"] == 1 and 150 < rec["interval_s"] < 200 and rec["backup_interval_s"] >= 655
    assert 0.95 < rec["goodput"] < 0.98
    assert [row["factor"] for row in out["by_factor"]] == [0, 1, 2, 3]
    assert out["by_factor"][0]["goodput"] < rec["goodput"] - 0.05  # no peers: lost nodes from the bucket
    table = cli(*ARGS, "--step-s", "1.5", "--interval-s", "600", env={"COLUMNS": "200"})
    assert table.code == 0 and "replication factor 1" in table.stdout and "as given" in table.stdout


def test_a_soak_run_is_compared_with_the_model(tmp_path: Path) -> None:
    run = SoakResult(
        nodes=16,
        wall_s=36_000.0,
        useful_s=33_500.0,
        interval_s=120.0,
        backup_interval_s=1200.0,
        factor=1,
        saves=290,
        save_s=1.5,
        upload_s=200.0,
        failures=(SoakFailure(tier="peer", lost_work_s=60.0, restart_s=60.0, restore_s=20.0),) * 8,
    )
    path = tmp_path / "soak.json"
    path.write_bytes(run.to_bytes())
    soak = cli(*ARGS, "--soak", str(path), "--json").json()["soak"]
    assert soak["observed"] == 33_500.0 / 36_000.0 and 0.9 < soak["predicted"] < 1.0
    assert_clean_error(cli(*ARGS, "--soak", str(tmp_path / "missing.json")), 1, "missing.json")
    no_bucket = ("--nodes", "4", "--node-mtbf-hours", "1", "--save-s", "1", "--restore-local-s", "1")
    assert_clean_error(cli("plan", *no_bucket, "--restore-peer-s", "1"), 2, "restore_bucket_s")
