"""The CUDA path: D2H straight into registered ramdisk pages, H2D back, overlap with the optimizer hook.

Run on the device machine (``pytest -m gpu tests/client``); skipped where there is no GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.client.client_helpers import assert_same
from tierckpt import Checkpointer, CorruptShardError
from tierckpt.protocol.format import read_manifest, step_dir

pytestmark = pytest.mark.gpu


def cuda_state(seed: int = 0) -> tuple[dict, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8)
    ).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(16, 64, device="cuda")).pow(2).mean().backward()
        opt.step()
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "bf16": torch.randn(1000, device="cuda").bfloat16(),
        "fp8": torch.randn(100, device="cuda").to(torch.float8_e4m3fn),
        "transposed": torch.randn(32, 48, device="cuda").t(),
        "scalar": torch.tensor(3.0, device="cuda"),
        "empty": torch.empty(0, 3, device="cuda"),
        "cpu_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(),
        "step": 5,
    }
    return state, model, opt


def test_cuda_state_round_trips_bit_exact_in_place(root, job):
    state, _, _ = cuda_state(0)
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, state, blocking=True)
        dest, _, _ = cuda_state(1)
        weight = dest["model"]["0.weight"]
        assert ck.load(dest) == 1
        assert dest["model"]["0.weight"] is weight and weight.is_cuda
        assert_same(state, dest)
        fresh: dict = {}
        ck.load(fresh, device="cuda")
        assert fresh["bf16"].is_cuda and fresh["cpu_rng"].is_cuda  # new tensors go to ``device``
        assert torch.equal(fresh["bf16"].cpu(), state["bf16"].cpu())


def test_saves_use_registered_ramdisk_pages(root, job):
    state, _, _ = cuda_state(0)
    with Checkpointer(root=root, job=job) as ck:
        for step in range(1, 5):
            ck.save(step, state, blocking=True)
        for step in (3, 4):
            slot = ck._pool.slot_of(step)
            assert slot is not None and all(f.registered for f in slot.files)
            assert all(f.buffer.is_pinned() for f in slot.files)  # CUDA sees the mapping as pinned memory


def test_a_new_process_loads_through_a_registered_mapping_and_verifies(root, job):
    state, _, _ = cuda_state(0)
    with Checkpointer(root=root, job=job, keep=3) as ck:
        ck.save(1, state, blocking=True)
        ck.save(2, state, blocking=True)
    with Checkpointer(root=root, job=job, keep=3) as ck:  # nothing of step 2 is mapped yet
        dest, _, _ = cuda_state(1)
        assert ck.load(dest) == 2
        assert_same(state, dest)  # read through the pinned bounce buffers (nothing registered yet)
        ck._registering.result()  # then pinned in the background, for later saves and loads
        assert all(f.registered for f in ck._pool.slot_of(2).files)
        entry = next(t for t in read_manifest(step_dir(ck.rank_path, 2)).tensors if t.key == "bf16")
        with open(step_dir(ck.rank_path, 2) / entry.file, "r+b") as f:  # bit rot in place
            f.seek(entry.offset + 3)
            byte = f.read(1)[0]
            f.seek(entry.offset + 3)
            f.write(bytes([byte ^ 0x10]))
        with pytest.raises(CorruptShardError) as info:
            ck.load(dest)
        assert info.value.key == "bf16"
        assert ck.load(dest, fallback=True) == 1


def test_overlap_mode_orders_the_optimizer_step_after_the_copy(root, job):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(16)]).cuda()  # ~256 MiB
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with Checkpointer(root=root, job=job, overlap=True, device_staging=False) as ck:
        ck.register_optimizer(opt)
        ck.save(0, {"model": model.state_dict()}, blocking=True)  # warm the slots
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        handle = ck.save(1, {"model": model.state_dict()})
        opt.zero_grad()
        model(torch.randn(8, 2048, device="cuda")).sum().backward()
        opt.step()  # the pre-step hook orders these updates after the snapshot copy
        handle.wait()
        dest: dict = {}
        ck.load(dest, step=1)
    for key, value in expected.items():
        assert torch.equal(dest["model"][key], value.cpu()), key
    assert not torch.equal(model[0].weight.cpu(), expected["0.weight"].cpu())


def many_small_state() -> dict:
    torch.manual_seed(3)
    small = {f"s{i}": torch.randn(i % 97 + 1, device="cuda") for i in range(600)}
    small |= {f"h{i}": torch.randn(5, i % 13 + 1, device="cuda").half() for i in range(200)}
    small["strided"] = torch.randn(40, 30, device="cuda").t()
    small["scalar"] = torch.tensor(7, device="cuda")
    return {"small": small, "big": torch.randn(3 << 20, device="cuda"), "cpu": torch.randn(100)}


def test_packed_small_tensors_round_trip_bit_exact_and_reuse_their_staging(root, job):
    state = many_small_state()
    with Checkpointer(root=root, job=job, device_staging=False) as ck:
        ck.save(1, state, blocking=True)
        staged = ck.device_staging_bytes
        assert 0 < staged < 8 << 20  # the small tensors' region only
        for step in range(2, 5):
            ck.save(step, state, blocking=True)
        assert ck.device_staging_bytes == staged  # reused, nothing new
        dest = {
            "small": {k: torch.zeros_like(v) for k, v in state["small"].items()},
            "big": torch.zeros_like(state["big"]),
        }
        assert ck.load(dest) == 4
        assert_same(state, dest)
        assert ck.last_load_timings["total_s"] > 0
    with Checkpointer(root=root, job=job) as ck:  # cold: through bounce buffers
        dest = {
            "small": {k: torch.zeros_like(v) for k, v in state["small"].items()},
            "big": torch.zeros_like(state["big"]),
        }
        assert ck.load(dest) == 4
        assert_same(state, dest)


@pytest.mark.parametrize("which", ["small/s123", "big"])
def test_a_corrupt_byte_on_the_gpu_restore_path_names_the_tensor(root, job, which):
    state = many_small_state()
    with Checkpointer(root=root, job=job) as ck:
        ck.save(1, state, blocking=True)
        ck.save(2, state, blocking=True)
        dest = {
            "small": {k: torch.zeros_like(v) for k, v in state["small"].items()},
            "big": torch.zeros_like(state["big"]),
        }
        assert ck.load(dest) == 2  # warm: mapped and pinned
        entry = next(t for t in read_manifest(step_dir(ck.rank_path, 2)).tensors if t.key == which)
        with open(step_dir(ck.rank_path, 2) / entry.file, "r+b") as f:  # bit rot in place
            f.seek(entry.offset + entry.length - 1)
            byte = f.read(1)[0]
            f.seek(entry.offset + entry.length - 1)
            f.write(bytes([byte ^ 0x01]))
        with pytest.raises(CorruptShardError) as info:
            ck.load(dest)
        assert info.value.key == which
        assert ck.load(dest, fallback=True) == 1
        assert_same(state, dest)


def test_a_file_pinned_during_a_cold_restore_still_fills_its_packed_tensors(root, job, monkeypatch):
    """The pool pins a step's files in the background: a file that becomes registered while a cold
    restore copies its small tensors through the bounce buffers must still have them scattered (they
    were left at zero, found on an H100 with a 2-4 GiB state)."""
    from tierckpt import cuda
    from tierckpt.snapshot import upload

    state = {f"small{i}": torch.full((4096,), float(i) + 0.5, device="cuda") for i in range(64)}
    state["large"] = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    want = {k: v.clone() for k, v in state.items()}
    with Checkpointer(root=root, job=job, keep=2) as ck:
        ck.save(1, state).wait()
    real_bounce = cuda.copy_through_bounce
    pinned: list[str] = []

    def bounce_then_pin(items, memcpy):  # the background warm-up wins the race right after the copies
        real_bounce(items, memcpy)
        for f in files_seen:
            if f.register():
                pinned.append(f.path.name)

    files_seen: list = []
    real_to_device = upload.to_device

    def spy(manifest, files, *args, **kwargs):
        files_seen.extend(f for f in files.values() if not f.registered)
        return real_to_device(manifest, files, *args, **kwargs)

    monkeypatch.setattr(cuda, "copy_through_bounce", bounce_then_pin)
    monkeypatch.setattr("tierckpt.snapshot.restore.to_device", spy)
    for t in state.values():
        t.zero_()
    with Checkpointer(root=root, job=job, keep=2) as fresh:
        assert fresh.load(state) == 1
    assert pinned, "the scenario needs a file pinned mid-restore"
    assert_same(state, want)
