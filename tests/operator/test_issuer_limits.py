"""The signing endpoint's bounds (``tierckpt_operator.issuer_limits``) on a fake clock: requests per
source, reviews reused while fresh (never the token kept), both tables bounded, slots in flight."""

from __future__ import annotations

import hashlib

import pytest

from tierckpt_operator.issuer_limits import InFlight, ReviewCache, SourceRate


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_source_gets_its_burst_then_its_rate_and_others_are_not_slowed():
    clock = Clock()
    rate = SourceRate(0.5, 3, clock=clock)
    assert [rate.wait("a") for _ in range(3)] == [0, 0, 0]
    assert rate.wait("a") == pytest.approx(2.0)  # one more in 1/rate seconds
    assert rate.wait("b") == 0
    clock.now += 2.0
    assert rate.wait("a") == 0 and rate.wait("a") > 0
    clock.now += 60
    waits = [rate.wait("a") for _ in range(4)]
    assert waits[:3] == [0, 0, 0] and waits[3] > 0  # refilled to the burst, not beyond


def test_the_source_table_is_bounded():
    clock = Clock()
    rate = SourceRate(1.0, 1, clock=clock, size=10)
    for i in range(100):
        rate.wait(f"10.0.{i}.1")
    assert len(rate._buckets) == 10


async def test_a_review_is_reused_while_fresh_and_kept_by_its_hash():
    clock = Clock()
    cache = ReviewCache(10.0, clock=clock)
    asked: list[str] = []

    def ask(answer: str):
        async def call() -> dict:
            asked.append(answer)
            return {"authenticated": answer == "yes"}

        return call

    assert await cache.review("tok", ask("yes")) == {"authenticated": True}
    assert await cache.review("tok", ask("no")) == {"authenticated": True}  # fresh: reused
    clock.now += 10.0
    assert await cache.review("tok", ask("no")) == {"authenticated": False}  # stale: asked again
    assert asked == ["yes", "no"]
    assert list(cache._answers) == [hashlib.sha256(b"tok").digest()]  # never the token itself


async def test_errors_are_not_kept_and_the_review_table_is_bounded():
    clock = Clock()
    cache = ReviewCache(10.0, clock=clock, size=5)

    async def fail() -> dict:
        raise RuntimeError("the API server is away")

    async def ok() -> dict:
        return {"authenticated": False}

    with pytest.raises(RuntimeError):
        await cache.review("tok", fail)
    assert await cache.review("tok", ok) == {"authenticated": False}
    for i in range(50):
        await cache.review(f"guess-{i}", ok)
    assert len(cache._answers) == 5
    clock.now += 11
    await cache.review("last", ok)
    assert len(cache._answers) == 1  # the expired ones went with the next answer kept


def test_slots_in_flight_are_bounded_and_given_back():
    calls = InFlight(2)
    with calls.slot() as first, calls.slot() as second, calls.slot() as third:
        assert (first, second, third) == (True, True, False)
        assert calls.taken == 2
    assert calls.taken == 0
