"""The images' names and locks, checked without building them (scripts/build-images.sh builds them,
tests/images runs them): the chart's default image and the example JobSet's training image name what
the build produces, and the locks the images install are what pyproject.toml and constraints.txt give."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tierckpt import __version__

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tierckpt"


def test_the_chart_and_the_example_name_the_images_the_build_produces() -> None:
    """build-images.sh tags <name>-<version> and <name>-training-<version>, <name> being the last part of
    the chart's image.repository, for <registry>/<name>:<version> and <registry>/<name>-training:<version>."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == __version__ and values["image"]["tag"] == ""
    repository = values["image"]["repository"]
    assert repository.rsplit("/", 1)[1] == "tierckpt"
    docs = [d for d in yaml.safe_load_all((REPO / "deploy" / "examples" / "jobset.yaml").read_text()) if d]
    jobset = next(d for d in docs if d["kind"] == "JobSet")
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert {c["image"] for c in pod["containers"]} == {f"{repository}-training:{__version__}"}
    script = (REPO / "scripts" / "build-images.sh").read_text()
    assert "DAEMON=$NAME-$VERSION" in script and "TRAIN=$NAME-training-$VERSION" in script


def test_the_image_locks_are_current() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "lock-images.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
