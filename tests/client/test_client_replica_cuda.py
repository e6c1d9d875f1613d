"""Replica-group fingerprints on the device: the CUDA digest is the CPU digest of the same bytes (wrapping
integer sums, exact whatever the reduction order), sees a one-ulp change, and a fingerprint of CUDA
tensors tells identical states from drifted ones without copying them to the host.

Run on the device machine (``pytest -m gpu tests/client``); skipped where there is no GPU.
"""

from __future__ import annotations

import pytest
import torch

from tierckpt.snapshot.fingerprint import device_digest, fingerprint, tensor_digests

pytestmark = pytest.mark.gpu


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * (1 << 20) // 4 + 13, generator=g),  # > 1 MiB: digested alone
        "small": torch.randn(300, generator=g).bfloat16(),  # concatenated with the other small ones
        "ints": torch.randint(0, 1 << 30, (77,), generator=g),
        "odd_bytes": torch.randint(0, 255, (1001,), dtype=torch.uint8, generator=g),
    }


def test_the_cuda_digest_equals_the_cpu_digest_of_the_same_bytes() -> None:
    for name, t in _state(0).items():
        raw = t.view(torch.uint8)
        on_device = device_digest(raw.cuda())
        assert on_device.device.type == "cuda"
        assert torch.equal(on_device.cpu(), device_digest(raw)), name
        unaligned = raw.cuda()[3:]  # a view at an odd address digests like the same bytes aligned
        assert torch.equal(device_digest(unaligned).cpu(), device_digest(raw[3:].clone())), name


def test_cuda_fingerprints_tell_identical_states_from_a_drifted_one() -> None:
    base = {k: v.cuda() for k, v in _state(1).items()}
    keys = list(base)
    twin = fingerprint(keys, [t.clone() for t in base.values()])
    mine = fingerprint(keys, list(base.values()))
    assert mine.device is not None and mine.device.device.type == "cuda"
    assert torch.equal(mine.device, twin.device) and mine.structure == twin.structure
    drifted = [t.clone() for t in base.values()]
    drifted[0][12345] = torch.nextafter(drifted[0][12345], torch.tensor(1e9, device="cuda"))  # one ulp
    assert not torch.equal(fingerprint(keys, drifted).device, mine.device)
    rows = tensor_digests(drifted, torch.device("cuda"))
    same_rows = tensor_digests(list(base.values()), torch.device("cuda"))
    assert (rows != same_rows).any(dim=1).tolist() == [True, False, False, False]
