"""Running the framework examples (tests/integrations/examples) as real training jobs under torchrun.

``Run`` starts ``torchrun --nproc-per-node N example.py`` (or, with ``torchrun=False``, plain
``python example.py``) in its own session with the tierckpt environment, optionally holds it at a step
(the example's ``PAUSE_AT``) and ends it the way a node or a pod ends: ``SIGKILL`` to torchrun and every
worker at once (the node is gone), or ``SIGTERM`` to torchrun alone (Kubernetes deleting the pod;
torchrun forwards it to the workers).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

from tierckpt_demo.ports import free_port

__all__ = ["EXAMPLES", "Run", "free_port", "same_tensors"]

EXAMPLES = Path(__file__).parent / "examples"
_TIMEOUT = 120.0


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit: the same keys, dtypes, shapes and bytes."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


class Run:
    """One torchrun launch of an example; ``result`` is the file rank 0 writes at the end."""

    def __init__(
        self,
        example: str,
        workdir: Path,
        name: str,
        *,
        env: dict[str, str],
        nproc: int = 2,
        torchrun_args: Sequence[str] = (),
        pause_at: int | str | None = None,
        launcher: Sequence[str] = (),
        torchrun: bool = True,
    ) -> None:
        self.result = workdir / f"{name}.pt"
        self.log = workdir / f"{name}.log"
        self.marker = Path(f"{self.result}.paused")
        self.nproc = nproc if torchrun else 1
        full_env = {
            **os.environ,
            **env,
            "RESULT": str(self.result),
            "PYTHONWARNINGS": "ignore",
            "OMP_NUM_THREADS": "1",
        }
        full_env.pop("PAUSE_AT", None)
        if pause_at is not None:
            full_env["PAUSE_AT"] = str(pause_at)
        if torchrun:
            cmd = [
                *launcher,
                str(Path(sys.executable).parent / "torchrun"),
                "--nproc-per-node",
                str(nproc),
                *(torchrun_args or ("--master-port", str(free_port()))),
                str(EXAMPLES / example),
            ]
        else:
            cmd = [*launcher, sys.executable, str(EXAMPLES / example)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=workdir,
            )

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def wait_paused(self, ranks: Sequence[int] | None = None, index: int = 0) -> list[str]:
        """Until every rank reached pause step ``index`` of ``PAUSE_AT`` (each rank writes
        ``<marker>.<index>.<rank>``); what the ranks wrote there."""
        ranks = range(self.nproc) if ranks is None else ranks
        deadline = time.monotonic() + _TIMEOUT
        while not all(Path(f"{self.marker}.{index}.{r}").exists() for r in ranks):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the run ended or hung before pausing:\n{self.log_text()}")
            time.sleep(0.05)
        return [Path(f"{self.marker}.{index}.{r}").read_text() for r in ranks]

    def kill(self) -> None:
        """SIGKILL torchrun and every worker (workers run in sessions of their own)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(procs, timeout=10)
        self.proc.wait()

    def kill_worker(self, local_rank: int) -> None:
        """SIGKILL one worker process (a crashed rank); torchrun notices and ends or restarts the rest."""
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.environ().get("LOCAL_RANK") == str(local_rank):
                    p.kill()
                    p.wait(10)
                    return
        raise AssertionError(f"no worker with local rank {local_rank}")

    def terminate(self) -> int:
        """SIGTERM to torchrun, as Kubernetes sends it to the container; the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.wait()

    def wait(self) -> int:
        try:
            return self.proc.wait(_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the run did not end:\n{self.log_text()}") from None

    def finish(self) -> dict[str, Any]:
        """Wait for a successful end and return what rank 0 wrote."""
        code = self.wait()
        assert code == 0 and self.result.exists(), f"exit code {code}:\n{self.log_text()}"
        return torch.load(self.result, weights_only=False)
