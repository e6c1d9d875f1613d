"""The public surface of ``tierckpt`` is exactly what we intend."""

from __future__ import annotations

import subprocess
import sys

import tierckpt

EXPECTED = {
    "Checkpointer",
    "ContractError",
    "CorruptShardError",
    "FormatError",
    "MissingCheckpointError",
    "RamdiskFullError",
    "ReplicaDivergenceError",
    "ReplicaGroup",
    "RetryableError",
    "SaveHandle",
    "SaveInProgressError",
    "StateMismatchError",
    "TierckptError",
    "WorldSizeMismatchError",
    "__version__",
    "replica_group_from_mesh",
}


def test_exported_names_are_exactly_the_intended_ones():
    assert set(tierckpt.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(tierckpt, name) is not None
    from tierckpt.checkpointer import Checkpointer
    from tierckpt.snapshot.handle import SaveHandle

    assert tierckpt.Checkpointer is Checkpointer and tierckpt.SaveHandle is SaveHandle


def test_importing_the_format_does_not_import_torch():
    code = (
        "import sys, tierckpt.protocol.format, tierckpt.protocol.contract, tierckpt.protocol.control,"
        " tierckpt.protocol.leases, tierckpt.protocol.replica; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
