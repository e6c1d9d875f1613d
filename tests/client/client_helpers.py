"""Shared helpers for the client tests: realistic state dicts and exact comparison."""

from __future__ import annotations

import collections
import random
from typing import Any

import numpy as np
import torch

__all__ = ["assert_same", "filled_state", "training_state"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes (so NaNs, -0.0 and fp8 compare bit for bit)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact equality: same types (dict vs OrderedDict, list vs tuple), dtypes, shapes and bits."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert torch.equal(_bits(a), _bits(b)), f"{path}: tensor bytes differ"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad differs"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (
            f"{path}: arrays differ"
        )
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, f"{path}: NaN became {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def training_state(seed: int = 0, width: int = 16) -> dict[str, Any]:
    """A model + Adam + RNG + assorted values state dict, as a training loop would save it."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(), torch.nn.Linear(width, 4)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
    rng = random.Random(seed)
    nrng = np.random.RandomState(seed)
    special = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45])
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": 1000 + seed,
        "lr": 1e-3 / 3,
        "rng": {"torch": torch.get_rng_state(), "python": rng.getstate(), "numpy": nrng.get_state()},
        "generator": np.random.default_rng(seed).bit_generator.state,
        "extras": {
            "bf16": torch.randn(33, generator=torch.Generator().manual_seed(seed)).bfloat16(),
            "fp8": torch.randn(17).to(torch.float8_e4m3fn),
            "fp8b": torch.randn(5).to(torch.float8_e5m2),
            "half": torch.randn(3, 2).half(),
            "ints": torch.arange(10, dtype=torch.int64) * (seed + 1),
            "bools": torch.tensor([True, False, True]),
            "complex": torch.randn(4, dtype=torch.complex64),
            "transposed": torch.randn(6, 4).t(),
            "strided": torch.arange(40.0)[::3],
            "scalar": torch.tensor(2.5 + seed),
            "empty": torch.empty(0, 7),
            "special": special,
            "param": torch.nn.Parameter(torch.ones(2)),
            "array": np.arange(12, dtype=np.float32).reshape(3, 4) + seed,
        },
        "numbers": [1, -(2**70), 0.1, float("inf"), float("-inf"), -0.0, True, None, "text ✓"],
        "tuple": (1, (2, "three"), [4.5]),
        "ordered": collections.OrderedDict([("b", 1), ("a", torch.zeros(2))]),
        7: "an int key",
        (1, "x"): "a tuple key",
        "object": {"bytes": b"\x00\xff", "set": {1, 2}, "dtype": torch.float16, "size": torch.Size([2, 3])},
    }


def filled_state(value: int, n: int = 4, numel: int = 4096) -> dict[str, Any]:
    """A state dict whose every tensor element and scalar is ``value`` (for torn-save detection)."""
    return {
        "tensors": [torch.full((numel * (i + 1),), value, dtype=torch.int32) for i in range(n)],
        "bf16": torch.full((numel,), float(value % 200), dtype=torch.bfloat16),
        "step": value,
        "meta": {"value": value, "pickled": {value}},
    }
