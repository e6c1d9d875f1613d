"""Scan the images' locked Python packages for known vulnerabilities (pip-audit), with the findings the
project has accepted listed, each with its reason and an expiry date.

    python scripts/audit-images.py                 # every images/*.lock; exit 1 on a finding
    python scripts/audit-images.py images/daemon.lock

pip-audit reads each lock (``--require-hashes --disable-pip``: no resolution, no virtualenv) and asks
its vulnerability service (PyPI's JSON API; ``--vulnerability-service osv`` through PIP_AUDIT_ARGS) about
every package. The scan fails on

- a vulnerability that images/audit-ignore.toml does not list;
- an entry of that file whose ``until`` date has passed (look again: fix it or extend it, with a reason);
- a package the service could not answer for (``--allow-unaudited`` to accept that, say on a machine that
  reaches no vulnerability service: then the scan says it audited nothing).

A finding is handled by upgrading the package (constraints.txt, then scripts/lock-images.py, then a new
image), or, when no fixed release exists or the vulnerable code is not used, by an entry in
images/audit-ignore.toml. docs/install.md ("Vulnerability scan") says more.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent
IGNORE_FILE = REPO / "images" / "audit-ignore.toml"


@dataclass(frozen=True)
class Accepted:
    """A finding the project accepted: a vulnerability id, for one package or any, until a date."""

    id: str
    package: str
    until: datetime.date
    reason: str


@dataclass(frozen=True)
class Verdict:
    findings: list[str]
    """Vulnerabilities no accepted entry covers."""
    accepted: list[str]
    expired: list[str]
    unaudited: list[str]
    audited: int

    def failed(self, *, allow_unaudited: bool) -> bool:
        return bool(self.findings or self.expired or (self.unaudited and not allow_unaudited))


def load_accepted(path: Path) -> list[Accepted]:
    """The ``[[accept]]`` entries of ``path`` (``id``, ``package``, ``until``, ``reason``; all required)."""
    if not path.exists():
        return []
    out = []
    for entry in tomllib.loads(path.read_text()).get("accept", []):
        missing = {"id", "package", "until", "reason"} - entry.keys()
        if missing or not str(entry["reason"]).strip():
            lacks = sorted(missing) or ["a reason"]
            raise SystemExit(f"audit-images: {path}: an entry lacks {lacks}: {entry}")
        until = entry["until"]
        if not isinstance(until, datetime.date):
            until = datetime.date.fromisoformat(str(until))
        out.append(Accepted(entry["id"], entry["package"], until, entry["reason"]))
    return out


def judge(report: dict[str, Any], accepted: list[Accepted], today: datetime.date) -> Verdict:
    """What pip-audit's JSON ``report`` means under the accepted findings, on ``today``."""
    findings, kept, expired, unaudited, audited = [], [], [], [], 0
    for dep in report.get("dependencies", []):
        name, version = dep["name"], dep.get("version", "?")
        if "skip_reason" in dep:
            unaudited.append(dep["skip_reason"])
            continue
        audited += 1
        for vuln in dep.get("vulns", []):
            ids = {vuln["id"], *vuln.get("aliases", [])}
            fixed = ", ".join(vuln.get("fix_versions", [])) or "no fixed release"
            what = f"{name} {version}: {vuln['id']} (fixed in {fixed})"
            match = next((a for a in accepted if a.id in ids and a.package in (name, "*")), None)
            if match is None:
                findings.append(what)
            elif match.until < today:
                expired.append(f"{what}: accepted until {match.until}, which has passed ({match.reason})")
            else:
                kept.append(f"{what}: accepted until {match.until} ({match.reason})")
    return Verdict(findings, kept, expired, unaudited, audited)


def audit(lock: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pip_audit", "--requirement", str(lock), "--require-hashes", "--disable-pip"]
    cmd += ["--progress-spinner", "off", "--format", "json"]
    cmd += shlex.split(os.environ.get("PIP_AUDIT_ARGS", ""))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode not in (0, 1) or not done.stdout.strip():  # 1: vulnerabilities found
        raise SystemExit(f"audit-images: pip-audit failed on {lock}:\n{done.stderr}")
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("locks", nargs="*", type=Path, help="default: images/*.lock")
    parser.add_argument(
        "--allow-unaudited", action="store_true", help="pass packages the service did not answer for"
    )
    args = parser.parse_args()
    accepted = load_accepted(IGNORE_FILE)
    failed = False
    for lock in args.locks or sorted((REPO / "images").glob("*.lock")):
        if lock.name.startswith("debian"):
            continue  # Debian's packages: not Python's; see docs/install.md
        verdict = judge(audit(lock), accepted, datetime.date.today())
        total = verdict.audited + len(verdict.unaudited)
        found = len(verdict.findings)
        print(f"== {lock.name}: {verdict.audited} of {total} packages audited, {found} findings")
        unaudited = verdict.unaudited
        if unaudited and not verdict.audited:  # the service answered for none: say so once
            unaudited = [f"every package; the first: {unaudited[0]}"]
        for title, lines in (
            ("vulnerable", verdict.findings),
            ("accepted, expired", verdict.expired),
            ("accepted", verdict.accepted),
            ("not audited", unaudited),
        ):
            for line in lines:
                print(f"  {title}: {line}")
        failed |= verdict.failed(allow_unaudited=args.allow_unaudited)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
