"""tierckpt.protocol.options: flags win over environment variables, which win over defaults; bad values
are named."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tierckpt.protocol.options import merge_settings


@dataclasses.dataclass(frozen=True)
class _Settings:
    port: int = 8080
    ratio: float = 0.5
    verbose: bool = False
    root: Path = Path("/tmp")
    name: str = "x"


def test_flag_beats_environment_beats_default() -> None:
    environ = {"T_PORT": "9000", "T_VERBOSE": "yes", "T_ROOT": "/srv", "T_RATIO": "0.25"}
    s = merge_settings(_Settings, {"port": 7000, "name": None}, environ, prefix="T_")
    assert s == _Settings(port=7000, ratio=0.25, verbose=True, root=Path("/srv"), name="x")


@pytest.mark.parametrize(("raw", "message"), [("maybe", "T_VERBOSE='maybe' is not a boolean")])
def test_bad_boolean_is_named(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        merge_settings(_Settings, {}, {"T_VERBOSE": raw}, prefix="T_")


def test_bad_number_is_named() -> None:
    with pytest.raises(ValueError, match="T_PORT='eighty'"):
        merge_settings(_Settings, {}, {"T_PORT": "eighty"}, prefix="T_")
