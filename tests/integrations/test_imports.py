"""The core library never imports a framework; each adapter imports its own framework, when used."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
frameworks = ("lightning", "pytorch_lightning", "transformers", "accelerate")
seen = {}
def after(stage):
    seen[stage] = [m for m in frameworks if m in sys.modules]
import tierckpt, tierckpt.checkpointer, tierckpt.dcp, tierckpt.integrations
after("core")
import tierckpt.integrations.hf, tierckpt.integrations.accelerate
after("hf modules")
from tierckpt.integrations.hf import TierckptTrainer
after("TierckptTrainer")
from tierckpt.integrations.accelerate import TierckptAccelerator
after("TierckptAccelerator")
print(json.dumps(seen))
"""


def test_frameworks_are_imported_only_by_their_adapter_on_first_use():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    seen = json.loads(out)
    assert seen["core"] == [] and seen["hf modules"] == []
    assert "transformers" in seen["TierckptTrainer"] and "lightning" not in seen["TierckptTrainer"]
    assert "accelerate" in seen["TierckptAccelerator"] and "lightning" not in seen["TierckptAccelerator"]
