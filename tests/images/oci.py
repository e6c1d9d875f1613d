"""Containers of a built image: umoci unpacks the OCI image into a runtime bundle, crun runs it.

The bundle is the image's root filesystem and the OCI runtime config that umoci derives from the
image's own config (its user, environment, working directory and command), with the defaults of a
container runtime: a read-only root (as the chart's ``readOnlyRootFilesystem``), no new privileges,
a handful of capabilities, /proc, /dev and /sys of the container's own. A container here differs in
three ways, each for the test's sake:

- it shares the caller's network namespace (a node of the netns cluster), as a ``hostNetwork`` pod;
- host directories the test names are bind-mounted at the same path (the cluster's ramdisks and
  credentials), as the chart's ``hostPath`` volumes, and /tmp is a tmpfs (the chart's ``emptyDir``);
- no cgroups and no rlimits: the machines here run cgroups in hybrid mode, which crun refuses, and
  their root lacks CAP_SYS_RESOURCE, which podman's default rlimits need (so podman cannot run
  containers here at all, and crun, the OCI runtime podman itself uses, runs them instead).

Each container runs in a PID namespace of its own under ``unshare --kill-child``, in the process group
of the command: SIGTERM to that group reaches the container's process (as a runtime's stop signal),
and SIGKILL to it (the cluster kills a replicator's process group so) ends every process of the
container.
"""

from __future__ import annotations

import copy
import itertools
import json
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["UnpackedImage", "tools_missing"]

_names = itertools.count()


def tools_missing() -> list[str]:
    """The programs these containers need that this machine lacks."""
    return [tool for tool in ("umoci", "crun", "unshare") if shutil.which(tool) is None]


class UnpackedImage:
    """Image ``tag`` of the OCI layout ``layout``, unpacked under ``where``; ``command()`` runs it."""

    def __init__(self, layout: Path, tag: str, where: Path) -> None:
        self.where = where
        bundle = where / "bundle"
        subprocess.run(
            ["umoci", "unpack", "--image", f"{layout}:{tag}", str(bundle)],
            check=True,
            capture_output=True,
        )
        self.rootfs = bundle / "rootfs"
        self.spec: dict[str, Any] = json.loads((bundle / "config.json").read_text())
        self.state = where / "crun"
        self.state.mkdir()

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.spec.get("annotations", {}))

    def command(
        self,
        args: Sequence[str],
        *,
        user: tuple[int, int] | None = None,
        capabilities: Sequence[str] | None = None,
        binds: Sequence[Path] = (),
        env: Mapping[str, str] | None = None,
    ) -> list[str]:
        """The command line that runs ``args`` in a new container of the image: as ``user`` (uid, gid;
        default the image's), with ``capabilities`` (names as ``CAP_CHOWN``; default the runtime's),
        the host directories ``binds`` mounted at their own paths, and ``env`` on top of the image's."""
        name = f"c{next(_names)}"
        bundle = self.where / name
        bundle.mkdir()
        spec = copy.deepcopy(self.spec)
        spec["root"] = {"path": str(self.rootfs), "readonly": True}
        process = spec["process"]
        process.update(terminal=False, args=list(args))
        process.pop("rlimits", None)
        if user is not None:
            process["user"] = {"uid": user[0], "gid": user[1]}
        if capabilities is not None:
            process["capabilities"] = {key: list(capabilities) for key in process["capabilities"]}
        if env:
            names = set(env)
            process["env"] = [e for e in process["env"] if e.split("=", 1)[0] not in names]
            process["env"] += [f"{k}={v}" for k, v in env.items()]
        linux = spec["linux"]
        linux["namespaces"] = [ns for ns in linux["namespaces"] if ns["type"] != "network"]
        linux.pop("resources", None)
        spec["mounts"] = [m for m in spec["mounts"] if m["destination"] != "/sys/fs/cgroup"]
        # a writable /tmp, as the chart's emptyDir volumes give the daemons
        tmp = {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=1777"]}
        spec["mounts"] += [tmp] + [
            {"destination": str(path), "type": "bind", "source": str(path), "options": ["rbind", "rw"]}
            for path in binds
        ]
        (bundle / "config.json").write_text(json.dumps(spec))
        crun = f"crun --root {self.state} --cgroup-manager=disabled run --bundle {bundle} {name}"
        # crun needs to see a cgroup2 hierarchy (it refuses hybrid mode), in this mount namespace only.
        # The shell is the PID namespace's init: it ignores SIGTERM and SIGINT (crun, in the same
        # process group, gets them and passes them on to the container) and exits as crun does.
        script = (
            f"mount -t cgroup2 none /sys/fs/cgroup || exit 125; trap '' TERM INT; {crun} & pid=$!; "
            "wait $pid; rc=$?; while kill -0 $pid 2>/dev/null; do wait $pid; rc=$?; done; exit $rc"
        )
        namespaces = ["--pid", "--fork", "--kill-child", "--mount-proc", "--propagation", "private"]
        return ["unshare", *namespaces, "sh", "-c", script]

    def run(self, args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``args`` in a new container to the end (``command()``'s keywords)."""
        return subprocess.run(self.command(args, **kwargs), capture_output=True, text=True, timeout=120)
