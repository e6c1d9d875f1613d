"""A process's random number generator states, for integrations whose framework does not save them."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["collect_rng_states", "set_rng_states"]


def collect_rng_states() -> dict[str, Any]:
    """torch (CPU, and CUDA once initialised), numpy and python states of this process."""
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Set what ``collect_rng_states`` returned (after a round trip through a checkpoint)."""
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
