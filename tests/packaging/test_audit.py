"""The vulnerability scan's verdict (scripts/audit-images.py) on pip-audit's report: a finding fails the
scan unless images/audit-ignore.toml accepts it until a date not yet past; a package the service could
not answer for fails it unless allowed; the accepted findings' file says why for each."""

from __future__ import annotations

import datetime
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
TODAY = datetime.date(2026, 11, 28)


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("audit_images", REPO / "scripts" / "audit-images.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["audit_images"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


audit = _script()

REPORT = {
    "dependencies": [
        {
            "name": "requests",
            "version": "2.30.0",
            "vulns": [
                {"id": "GHSA-9wx4-h78v-vm56", "aliases": ["CVE-2024-35195"], "fix_versions": ["2.32.0"]},
            ],
        },
        {"name": "idna", "version": "3.20", "vulns": []},
        {
            "name": "mystery",
            "skip_reason": "Dependency not found on PyPI and could not be audited: mystery (1.0)",
        },
    ],
}


def test_a_finding_fails_the_scan() -> None:
    verdict = audit.judge(REPORT, [], TODAY)
    assert verdict.findings == ["requests 2.30.0: GHSA-9wx4-h78v-vm56 (fixed in 2.32.0)"]
    assert verdict.audited == 2 and len(verdict.unaudited) == 1
    assert verdict.failed(allow_unaudited=True)


def test_an_accepted_finding_passes_until_its_date_then_fails(tmp_path: Path) -> None:
    ignore = tmp_path / "audit-ignore.toml"
    ignore.write_text(
        '[[accept]]\nid = "CVE-2024-35195"\npackage = "requests"\nuntil = 2026-12-31\n'
        'reason = "the images never send requests with verify=False after verify=True"\n'
    )
    accepted = audit.load_accepted(ignore)
    now = audit.judge(REPORT, accepted, TODAY)
    assert now.findings == [] and len(now.accepted) == 1 and not now.failed(allow_unaudited=True)
    later = audit.judge(REPORT, accepted, datetime.date(2027, 1, 1))
    assert later.findings == [] and len(later.expired) == 1 and later.failed(allow_unaudited=True)


def test_an_entry_for_another_package_does_not_cover_the_finding(tmp_path: Path) -> None:
    ignore = tmp_path / "audit-ignore.toml"
    ignore.write_text(
        '[[accept]]\nid = "CVE-2024-35195"\npackage = "urllib3"\nuntil = 2027-01-01\nreason = "x"\n'
    )
    assert audit.judge(REPORT, audit.load_accepted(ignore), TODAY).findings != []


def test_unaudited_packages_fail_unless_allowed() -> None:
    clean = {"dependencies": [d for d in REPORT["dependencies"] if d["name"] != "requests"]}
    verdict = audit.judge(clean, [], TODAY)
    assert verdict.failed(allow_unaudited=False) and not verdict.failed(allow_unaudited=True)


def test_an_entry_without_a_reason_is_refused(tmp_path: Path) -> None:
    ignore = tmp_path / "audit-ignore.toml"
    ignore.write_text('[[accept]]\nid = "X"\npackage = "*"\nuntil = 2027-01-01\nreason = " "\n')
    with pytest.raises(SystemExit, match="reason"):
        audit.load_accepted(ignore)


def test_the_projects_accepted_findings_file_is_valid() -> None:
    for entry in audit.load_accepted(REPO / "images" / "audit-ignore.toml"):
        assert entry.until > TODAY - datetime.timedelta(days=365), entry
