"""Start the demo's training processes fast: one pre-imported launcher per node that forks them.

Importing torch takes seconds of CPU; four ranks importing it at once on a small machine take half
a minute, and the demo restarts its ranks four times. So each node runs one launcher process
(``python -m tierckpt_demo.launcher``, inside the node's network namespace) that imports torch and
tierckpt once, then forks a fresh training process (``tierckpt_demo.training``, or with ``--module``
the DCP demo's ``tierckpt_demo.dcp_training``; ``--module`` given twice serves both, each request naming
its own) on request. A forked
process shares nothing with earlier ones but the imported code: its state, its process group and its
torch.distributed connections are its own, and killing it is a real crash (SIGKILL).

The launcher reads ``LaunchRequest`` lines on stdin and writes ``LauncherEvent`` lines on stdout
(``started``, then ``exited`` with the status). It kills its children and exits when stdin closes
(the orchestrator went away), and its children die with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import importlib
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from tierckpt.protocol.codec import Message
from tierckpt.protocol.errors import FormatError

__all__ = ["LaunchRequest", "Launcher", "LauncherEvent", "kill_process_group", "main", "node_files_prefix"]

_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class LaunchRequest(Message):
    KIND = "tierckpt_demo-launch"
    VERSION = 1

    argv: tuple[str, ...]
    """Arguments of ``tierckpt_demo.training``."""
    env: dict[str, str]
    """The whole environment of the new process."""
    log: str
    """File that receives the process's stdout and stderr."""
    module: str = ""
    """The trainer to run, one the launcher imported ("": its first)."""


@dataclasses.dataclass(frozen=True)
class LauncherEvent(Message):
    KIND = "tierckpt_demo-launcher-event"
    VERSION = 1

    event: Literal["ready", "started", "exited"]
    pid: int = 0
    status: int = 0
    """``exited``: the exit status, or minus the signal number that killed it."""


# ------------------------------------------------------------------------------------- the launcher


_MODULES = ("tierckpt_demo.training", "tierckpt_demo.dcp_training")
"""What a launcher may run (``--module``): the native demo's trainer, or the DCP demo's."""


def _child(request: LaunchRequest, module: str) -> None:
    """In the forked process: become the training process described by ``request``; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.environ.clear()
        os.environ.update(request.env)
        importlib.import_module(module).main(list(request.argv))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _emit(event: LauncherEvent) -> None:
    sys.stdout.write(event.to_bytes().decode() + "\n")
    sys.stdout.flush()


def _reap(children: set[int]) -> None:
    for pid in list(children):
        with contextlib.suppress(ChildProcessError):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                _emit(LauncherEvent("exited", pid=pid, status=code))


def _serve(modules: Sequence[str]) -> None:
    children: set[int] = set()
    _emit(LauncherEvent("ready", pid=os.getpid()))
    buffered = b""
    try:
        while True:
            readable, _, _ = select.select([0], [], [], 0.1)
            _reap(children)
            if not readable:
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return  # the orchestrator is gone
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                request = LaunchRequest.from_bytes(line)
                module = request.module or modules[0]
                if module not in modules:
                    raise ValueError(f"this launcher runs {', '.join(modules)}, not {module}")
                pid = os.fork()
                if pid == 0:
                    _child(request, module)
                children.add(pid)
                _emit(LauncherEvent("started", pid=pid))
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    """Pre-import what the training processes need, then serve launch requests."""
    parser = argparse.ArgumentParser(prog="python -m tierckpt_demo.launcher")
    parser.add_argument(
        "--module", choices=_MODULES, action="append", help="a trainer to run (repeat for several)"
    )
    modules = parser.parse_args(argv).module or [_MODULES[0]]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator decides when we stop
    import torch
    import torch.distributed

    for module in modules:
        importlib.import_module(module)
    # Its first call imports torch's compiler stack (seconds of CPU): pay that once, here.
    torch.use_deterministic_algorithms(True)
    _serve(modules)


# ------------------------------------------------------------------------------------- the client side


class Launcher:
    """The orchestrator's handle on one node's launcher process."""

    def __init__(
        self, popen: Any, argv_prefix: Sequence[str] = (), module: str | Sequence[str] = _MODULES[0]
    ) -> None:
        """``popen(cmd, **kwargs)`` starts a process where the training processes must run (a node);
        ``module``: the trainer it runs (``tierckpt_demo.training`` or ``tierckpt_demo.dcp_training``), or
        several (each ``launch`` then names its own)."""
        modules = [module] if isinstance(module, str) else list(module)
        flags = [arg for m in modules for arg in ("--module", m)]
        cmd = [*argv_prefix, sys.executable, "-m", "tierckpt_demo.launcher", *flags]
        self.proc: subprocess.Popen[bytes] = popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._lock = threading.Condition()
        self._started: list[int] = []
        self._exited: dict[int, int] = {}
        self._ready = False
        self._reader = threading.Thread(target=self._read, name="launcher-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = LauncherEvent.from_bytes(line)
            except FormatError:
                continue
            with self._lock:
                if ev.event == "ready":
                    self._ready = True
                elif ev.event == "started":
                    self._started.append(ev.pid)
                    self._exited.pop(ev.pid, None)  # a pid used again: not the process that exited
                else:
                    self._exited[ev.pid] = ev.status
                self._lock.notify_all()
        with self._lock:
            self._lock.notify_all()

    def _wait_for(self, what: str, predicate: Any, timeout: float) -> None:
        with self._lock:
            if not self._lock.wait_for(lambda: predicate() or self.proc.poll() is not None, timeout):
                raise TimeoutError(f"the training launcher did not report {what} within {timeout:.0f} s")
            if not predicate():
                raise RuntimeError(f"the training launcher exited with status {self.proc.returncode}")

    def wait_ready(self, timeout: float = 120.0) -> None:
        self._wait_for("ready", lambda: self._ready, timeout)

    def launch(
        self, argv: Sequence[str], env: dict[str, str], log: str, timeout: float = 30.0, module: str = ""
    ) -> int:
        """Fork a training process (``module``: which of the launcher's trainers); returns its pid."""
        assert self.proc.stdin is not None
        with self._lock:
            before = len(self._started)
        self.proc.stdin.write(LaunchRequest(tuple(argv), dict(env), log, module).to_bytes() + b"\n")
        self.proc.stdin.flush()
        self._wait_for("the new process", lambda: len(self._started) > before, timeout)
        return self._started[before]

    def status(self, pid: int) -> int | None:
        """The exit status of a process it started, or None while it runs."""
        with self._lock:
            return self._exited.get(pid)

    def close(self) -> None:
        """Stop the launcher (it kills whatever it still runs)."""
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def node_files_prefix(workdir: Path, nodes: Sequence[Any]) -> list[str]:
    """A command prefix giving the training processes the nodes' own /etc/hosts and resolv.conf
    (``nodes``: the cluster's, each with ``ip`` and ``name``); [] without ``unshare``.

    Inside a namespace the host's DNS server is unreachable, and every reverse lookup that
    torch.distributed makes of a peer address would wait 10 s for it. Like a pod, each node gets
    an /etc/hosts naming every node, and a resolver that fails at once; in a private mount
    namespace, so the host's files are untouched.
    """
    if shutil.which("unshare") is None:
        return []
    hosts = workdir / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{n.ip} {n.name}\n" for n in nodes))
    resolv = workdir / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    script = 'mount --bind "$1" /etc/hosts && mount --bind "$2" /etc/resolv.conf && shift 2 && exec "$@"'
    return [
        "unshare",
        "--mount",
        "--propagation",
        "slave",
        "sh",
        "-c",
        script,
        "node-files",
        str(hosts),
        str(resolv),
    ]


def kill_process_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
