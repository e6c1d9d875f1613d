"""The core library never imports a framework; each adapter imports its own framework, when used."""

from __future__ import annotations

import json
import subprocess
import sys

FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate")


def imported_after(code: str) -> list[str]:
    probe = f"import json, sys; {code}; print(json.dumps([m for m in {FRAMEWORKS!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_the_core_library_imports_no_framework():
    assert imported_after("import tierckpt, tierckpt.checkpointer, tierckpt.dcp, tierckpt.integrations") == []


def test_the_hugging_face_adapters_import_their_framework_on_first_use():
    assert imported_after("import tierckpt.integrations.hf, tierckpt.integrations.accelerate") == []
    assert "transformers" in imported_after("from tierckpt.integrations.hf import TierckptTrainer")
    assert "accelerate" in imported_after("from tierckpt.integrations.accelerate import TierckptAccelerator")
    assert "lightning" not in imported_after("from tierckpt.integrations.hf import TierckptTrainer")
