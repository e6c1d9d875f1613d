"""Warm from the first save: slots are prepared in the background, and a save never sees a half-prepared one.

The warm-up thread is held inside the pre-fault of a chosen slot (a gate on the real pre-fault), so a
save arrives exactly while that slot is half-prepared.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from tests.client.client_helpers import assert_same
from tierckpt import Checkpointer, save_plan
from tierckpt.protocol.format import rank_dir, step_dir
from tierckpt.save_plan import SavePlanner
from tierckpt.settings import resolve
from tierckpt.snapshot import shardfile
from tierckpt.snapshot.flatten import flatten
from tierckpt.snapshot.layout import plan_layout
from tierckpt.snapshot.pool import SPARE_DIR, SlotPool
from tierckpt.snapshot.shardfile import MappedFile


def state_of(value: float) -> dict:
    return {
        "w": torch.full((2 << 20,), value),
        "b": [torch.full((100,), value) for _ in range(5)],
        "n": value,
    }


class WarmGate:
    """Holds the warm-up thread in the pre-fault of its ``hold``-th slot until ``release``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold: int) -> None:
        self.hold = hold
        self.slots_started = 0
        self.holding = threading.Event()
        self.released = threading.Event()
        real = shardfile._populate

        def populate(mm, address, start, length, *, write):
            if threading.current_thread().name.startswith("tierckpt-warm"):
                self.slots_started += 1
                if self.slots_started == self.hold:
                    self.holding.set()
                    assert self.released.wait(30)
            real(mm, address, start, length, write=write)

        monkeypatch.setattr(shardfile, "_populate", populate)

    def release(self) -> None:
        self.released.set()


def files_of(ck: Checkpointer, step: int) -> list[MappedFile]:
    slot = ck._pool.slot_of(step)
    assert slot is not None
    return slot.files


def test_prepare_without_blocking_returns_at_once_and_a_save_takes_a_ready_slot(root, job, monkeypatch):
    gate = WarmGate(monkeypatch, hold=2)  # the first slot gets ready, the second stays half-prepared
    state = state_of(1.0)
    with Checkpointer(root=root, job=job, keep=2) as ck:
        future = ck.prepare(state, blocking=False)
        assert gate.holding.wait(30) and not future.done()
        assert ck._pool.ready_spares == 1
        start = time.perf_counter()
        ck.save(1, state, blocking=True)  # takes the ready slot; never waits for the held one
        assert time.perf_counter() - start < 10 and not future.done()
        assert all(f.populated and f.size == f.disk_size() for f in files_of(ck, 1))
        half = [d for d in (ck.rank_path / SPARE_DIR).iterdir() if d.name.endswith("-new")]
        assert half, "the half-prepared slot stays a spare"
        gate.release()
        future.result(30)
        dest = {}
        assert ck.load(dest) == 1
    assert_same(state, dest)


def test_a_save_during_warm_up_waits_for_the_slot_being_prepared_not_a_half_one(root, job, monkeypatch):
    gate = WarmGate(monkeypatch, hold=1)  # nothing is ready: the first slot is half-prepared
    state = state_of(2.0)
    with Checkpointer(root=root, job=job, keep=2) as ck:
        future = ck.prepare(state, blocking=False)
        assert gate.holding.wait(30)
        created = []
        real_create = MappedFile.create

        def create(cls, path, size, **options):
            created.append(path)
            return real_create(path, size, **options)

        monkeypatch.setattr(MappedFile, "create", classmethod(create))
        saver = threading.Thread(target=lambda: ck.save(1, state, blocking=True))
        saver.start()
        saver.join(0.5)
        assert saver.is_alive(), "the save must not take the half-prepared slot"
        gate.release()
        saver.join(30)
        assert not saver.is_alive()
        future.result(30)
        assert all(f.populated for f in files_of(ck, 1))
        assert not [p for p in created if p.parent == step_dir(ck.rank_path, 1)], "it used the warmed slot"
        dest = {}
        assert ck.load(dest) == 1
    assert_same(state, dest)


def test_after_the_first_save_the_spares_are_prepared_in_the_background(root, job, monkeypatch):
    state = state_of(3.0)
    with Checkpointer(root=root, job=job, keep=2) as ck:
        ck.save(1, state, blocking=True)
        ck._registering.result(30)
        assert ck._pool.ready_spares == 2  # keep + 1 slots: the committed one and two spares
        on_training_thread = []
        real_create = MappedFile.create

        def create(cls, path, size, **options):
            if threading.current_thread() is threading.main_thread():
                on_training_thread.append(path)
            return real_create(path, size, **options)

        monkeypatch.setattr(MappedFile, "create", classmethod(create))
        for step in range(2, 6):
            ck.save(step, state_of(float(step)), blocking=True)
        assert on_training_thread == [], "no save after the first creates or faults a data file"
        dest = {}
        assert ck.load(dest) == 5
    assert_same(state_of(5.0), dest)


def test_a_restarted_writer_reuses_the_slots_on_the_ramdisk_without_faulting_new_pages(root, job):
    state = state_of(4.0)
    with Checkpointer(root=root, job=job, keep=2) as ck:
        for step in range(1, 5):
            ck.save(step, state, blocking=True)
        spare = next((ck.rank_path / SPARE_DIR).iterdir()) / "data-00000.bin"
        spare_inode = os.stat(spare).st_ino
    with Checkpointer(root=root, job=job, keep=2) as ck:
        ck._registering.result(30)  # the adopted spare was prepared in the background
        assert ck._pool.ready_spares == 1
        ck.save(5, state, blocking=True)
        assert os.stat(step_dir(ck.rank_path, 5) / "data-00000.bin").st_ino == spare_inode
        dest = {}
        assert ck.load(dest) == 5
    assert_same(state, dest)


def test_close_during_warm_up_stops_it_and_keeps_what_is_committed(root, job, monkeypatch):
    gate = WarmGate(monkeypatch, hold=2)
    state = state_of(5.0)
    ck = Checkpointer(root=root, job=job, keep=2)
    ck.save(1, state, blocking=True)
    assert gate.holding.wait(30)
    threading.Timer(0.2, gate.release).start()
    ck.close()  # waits for the slot being prepared, then stops
    with Checkpointer(root=root, job=job, keep=2) as again:
        dest = {}
        assert again.load(dest) == 1
    assert_same(state, dest)


def test_a_load_prepares_the_slots_of_the_state_it_loads_so_no_save_creates_one(root, job, monkeypatch):
    """The README's flow: ``load`` first (fresh, or a restart), then saves. The slots are prepared in the
    background from the load on, so not even the first save creates or faults a data file."""
    on_training_thread = []
    real_create = MappedFile.create

    def create(cls, path, size, **options):
        if threading.current_thread() is threading.main_thread():
            on_training_thread.append(path)
        return real_create(path, size, **options)

    monkeypatch.setattr(MappedFile, "create", classmethod(create))
    state = state_of(6.0)
    with Checkpointer(root=root, job=job, keep=2) as ck:
        assert ck.load(state, allow_missing=True) is None  # a fresh job: nothing to load
        ck._registering.result(30)
        assert ck._pool.ready_spares == 3  # keep + 1 slots, before the first save
        for step in (1, 2):
            ck.save(step, state_of(float(step)), blocking=True)
    with Checkpointer(root=root, job=job, keep=2) as ck:  # a restart
        dest = state_of(0.0)
        assert ck.load(dest) == 2
        ck._registering.result(30)
        ck.save(3, state_of(3.0), blocking=True)
    assert on_training_thread == [], "no save created or faulted a data file"
    assert_same(state_of(2.0), dest)


def test_once_the_pool_knows_the_layout_a_load_does_not_plan_the_slots_again(root, job, monkeypatch):
    """Preparing the slots after a load flattens and plans the whole state (milliseconds on the restore
    path): it is done for the first load only; later loads find the pool keeping its slots itself."""
    state = state_of(1.0)
    with Checkpointer(root=root, job=job, keep=2) as ck:
        ck.save(1, state, blocking=True)
        planned = []
        real_plan = ck._planner.layout
        monkeypatch.setattr(ck._planner, "layout", lambda *a, **k: planned.append(1) or real_plan(*a, **k))
        dest = state_of(0.0)
        for _ in range(3):
            assert ck.load(dest) == 1
        assert planned == [], "a load after a save planned the slots again"
        assert_same(state, dest)
    with Checkpointer(root=root, job=job, keep=2) as ck:  # a restart: the first load prepares, once
        planned = []
        real_plan = ck._planner.layout
        monkeypatch.setattr(ck._planner, "layout", lambda *a, **k: planned.append(1) or real_plan(*a, **k))
        for _ in range(3):
            assert ck.load(dest) == 1
        assert planned == [1]
        ck._registering.result(30)
        assert ck._pool.ready_spares >= 1


def _fresh_job() -> tuple[torch.nn.Module, dict, Callable[[], None]]:
    """A model, its AdamW optimizer with no state yet (a brand-new job), the state to save, and a step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step() -> None:
        model(torch.randn(4, 512)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return model, {"model": model, "optim": opt}, train_step


def test_a_fresh_jobs_spares_are_refitted_in_the_background_once_its_optimizer_state_exists(
    root, job, monkeypatch
):
    """The README's flow in a brand-new job: ``load`` runs before the first step, when the optimizer has no
    state yet (torch creates it at the first step), so the slots prepared from ``load`` on fit the model
    alone. Once the whole layout is known (the first optimizer step, or at the latest the first save), the
    warm-up resizes (and pins) the spares itself: the saves that follow take slots that fit and resize
    nothing on the training thread."""
    model, state, train_step = _fresh_job()

    with Checkpointer(root=root, job=job, keep=2) as ck:
        assert ck.load(state, allow_missing=True) is None  # a fresh job; the optimizer has no state yet
        ck._registering.result(30)
        small = {slot.nbytes for slot in ck._pool._ready}
        train_step()  # AdamW's moments now exist: the state to save is about three times larger
        ck.save(1, state, blocking=True)
        ck._registering.result(30)
        assert ck._pool.ready_spares == 2
        fitted = ck._pool.slot_of(1).nbytes  # sized for the layout with the optimizer state
        assert fitted > 2 * max(small)
        assert [slot.nbytes for slot in ck._pool._ready] == [fitted, fitted], "the spares were refitted"
        resized = []
        real_resize = MappedFile.resize

        def resize(self, size, **options):
            if threading.current_thread() is threading.main_thread():
                resized.append((self.path.name, size))
            return real_resize(self, size, **options)

        monkeypatch.setattr(MappedFile, "resize", resize)
        for step in (2, 3):
            train_step()
            ck.save(step, state, blocking=True)
        assert resized == [], "a save resized a spare on the training thread"
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        assert ck.load(state) == 3
    assert_same(expected, dict(model.state_dict()))


def test_a_fresh_jobs_first_optimizer_step_refits_the_spares_before_its_first_save(root, job, monkeypatch):
    """The same brand-new job, one step earlier: once the optimizer has stepped (its state exists), the
    whole state is planned again on a thread of its own and the warm-up refits the spares, so not even
    the first save lays out the new state, resizes a slot or prepares one on the training thread."""
    model, state, train_step = _fresh_job()

    with Checkpointer(root=root, job=job, keep=2) as ck:
        assert ck.load(state, allow_missing=True) is None  # a fresh job; the optimizer has no state yet
        ck._registering.result(30)
        small = {slot.nbytes for slot in ck._pool._ready}
        assert ck._plan_ahead is not None and not ck._plan_ahead.done()  # waits for the first step
        train_step()
        ck._plan_ahead.result(30)
        ck._registering.result(30)
        fitted = {slot.nbytes for slot in ck._pool._ready}
        assert len(fitted) == 1 and min(fitted) > 2 * max(small), (small, fitted)
        assert ck._pool.ready_spares == 3
        on_training_thread = []
        for name in ("resize", "prepare"):
            real = getattr(MappedFile, name)

            def spy(self, *args, _real=real, _name=name, **options):
                if threading.current_thread() is threading.main_thread():
                    on_training_thread.append((_name, self.path.name))
                return _real(self, *args, **options)

            monkeypatch.setattr(MappedFile, name, spy)
        planned = []
        monkeypatch.setattr(
            save_plan, "plan_layout", lambda *a, **k: planned.append(1) or plan_layout(*a, **k)
        )
        for _ in range(3):  # the hook does nothing after the first step
            train_step()
        ck.save(1, state, blocking=True)
        assert on_training_thread == [], "the first save resized or prepared a slot on the training thread"
        assert planned == [], "the first save laid out a state the first step had planned already"
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        assert ck.load(state) == 1
    assert_same(expected, dict(model.state_dict()))


_FREEZE_CHECK = """
import gc, sys, weakref
import tierckpt

class Node:
    pass

before = [Node() for _ in range(1000)]  # the set-up's objects
for a, b in zip(before, before[1:]):
    a.next, b.prev = b, a
with tierckpt.Checkpointer(root=sys.argv[1], job="gc", freeze_gc=sys.argv[2] == "1"):
    frozen = gc.get_freeze_count()
    cycle = Node()  # garbage made after the freeze is still collected
    cycle.me = cycle
    gone = weakref.ref(cycle)
    del cycle
    gc.collect()
    print(frozen, gone() is None)
"""


@pytest.mark.parametrize("freeze", [True, False])
def test_the_first_checkpointer_moves_the_set_ups_objects_out_of_the_collectors_generations(root, freeze):
    """``freeze_gc`` (the default): the objects alive when the process makes its first ``Checkpointer``
    are frozen out of the garbage collector's generations, so its full passes no longer walk them while
    training waits; cyclic garbage made afterwards is still collected. In a process of its own: the
    collector's state is the whole process's."""
    done = subprocess.run(
        [sys.executable, "-c", _FREEZE_CHECK, str(root), "1" if freeze else "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    frozen, collected = done.stdout.split()
    assert collected == "True"
    assert (int(frozen) > 1000) if freeze else (int(frozen) == 0)


class _SlowRelease:
    """The pool's condition, with a pause after the warm-up thread's first release of it once ``armed``
    is set: whoever waits for the lock then gets it first."""

    def __init__(self, inner: threading.Condition) -> None:
        self.inner, self.armed, self.paused = inner, threading.Event(), False

    def __enter__(self) -> bool:
        return self.inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)
        if (
            self.armed.is_set()
            and not self.paused
            and threading.current_thread().name.startswith("tierckpt-warm")
        ):
            self.paused = True
            time.sleep(0.3)

    def __getattr__(self, name: str):  # wait, notify_all
        return getattr(self.inner, name)


def test_a_warm_up_asked_for_as_the_last_one_stops_builds_the_slots(root, job):
    """The race behind a flaky test: a ``Checkpointer`` starts a warm-up with no layout (adopted spares,
    none here) and ``load``'s ``prepare`` asks for one with the layout just as it decides there is
    nothing to do. That call used to join the stopping warm-up (still marked active until it took the lock
    again), which built nothing: no slot got ready. The decision now clears the mark in the same critical
    section, so the call starts a warm-up of its own."""
    settings = resolve(root=root, job=job, rank=0, world_size=1)
    layout = SavePlanner(settings).layout(flatten(state_of(1.0)))
    pool = SlotPool(rank_dir(root, job, 0), target=3)
    slow = _SlowRelease(pool._cond)
    pool._cond = slow  # type: ignore[assignment]
    deciding = threading.Event()
    real_misfit = pool._misfit_locked

    def misfit():  # called under the lock by the warm-up with no layout: it stops right after
        deciding.set()
        slow.armed.set()
        return real_misfit()

    pool._misfit_locked = misfit  # type: ignore[method-assign]
    try:
        pool.warm(None)
        assert deciding.wait(30)
        pool._misfit_locked = real_misfit  # type: ignore[method-assign]
        future = pool.warm(layout)  # waits for the lock the stopping warm-up holds
        future.result(30)
        assert pool.ready_spares == 3
    finally:
        pool.close()
