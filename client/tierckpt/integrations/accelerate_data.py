"""The data loaders ``TierckptAccelerator`` prepares: their position is part of every saved step.

An exact resume in the middle of an epoch needs three things that ``Accelerator.save_state`` does not
keep for a plain ``DataLoader(shuffle=True)``, and this module supplies them:

* **a generator of the loader's own** (``own_generator``, before Accelerate prepares the loader): a
  ``DataLoader`` without one draws a seed from the global RNG each time an iterator is made, so the
  first pass after a resume (whose global RNG was just restored) would shift every later random number,
  dropout included; and a ``RandomSampler`` without one draws its permutation from the global RNG. The
  loader's (and so its sampler's) generator is seeded with ``torch.initial_seed()``.
* **the epoch**: Accelerate's loader sets its sampler's epoch from its own ``iteration`` at each pass,
  so setting the sampler's epoch after a load is undone by the next pass.
* **the batches already handed out in the epoch**, and the states its generators had when the epoch's
  pass began, so that the pass after a load draws the same permutation (and the same worker seeds) and
  skips, with Accelerate's ``skip_first_batches`` (at the sampler, so nothing is read for them), what the
  saved run had already trained on.

``ResumableLoader`` wraps the prepared loader to count the batches of each pass. A pass left before its
end (a ``break``) ends there: the next pass starts the same epoch over, as Accelerate's own loader
does. Loaders of ``torchdata``'s ``StatefulDataLoader`` (``use_stateful_dataloader=True``) keep their
own position (their ``state_dict``) and are only given their epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ResumableLoader", "own_generator"]


def own_generator(loader: Any) -> None:
    """Give a plain ``DataLoader`` (and its ``RandomSampler``) a generator of its own if it has none."""
    if not isinstance(loader, torch.utils.data.DataLoader) or getattr(
        loader, "_is_accelerate_prepared", False
    ):
        return
    if loader.generator is None:
        loader.generator = torch.Generator().manual_seed(torch.initial_seed())
    sampler = loader.sampler
    if isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is None:
        sampler.generator = loader.generator


class ResumableLoader:
    """An Accelerate data loader (``DataLoaderShard``, ``DataLoaderDispatcher``) whose position
    ``state_dict`` returns and whose next pass after ``load_state_dict`` continues from it.

    Everything else is the wrapped loader's: attributes, ``len``, and ``isinstance`` checks (as
    Accelerate's own loaders present themselves as the ``DataLoader`` they wrap).
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.epoch: int = getattr(loader, "iteration", 0)
        self.position = 0
        """Batches handed out by the running pass (0 when none runs)."""
        self._pass_start: dict[str, torch.Tensor] | None = None
        """The generators' states when the running pass began (None when none runs)."""
        self._resume: dict[str, Any] | None = None

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return self.loader.__class__  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def stateful(self) -> bool:
        return bool(getattr(self.loader, "use_stateful_dataloader", False))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        _set_epoch(self.loader, epoch)

    def __iter__(self) -> Iterator[Any]:
        from accelerate import skip_first_batches

        resume, self._resume = self._resume, None
        generators = self._generators()
        skip = 0
        if resume is not None:
            for role, saved in resume["generators"].items():
                if role in generators:
                    generators[role].set_state(saved)
            skip = resume["position"]
        self.set_epoch(self.epoch)
        self._pass_start = {role: g.get_state() for role, g in generators.items()}
        self.position = skip
        finished = False
        try:
            for batch in skip_first_batches(self.loader, skip) if skip else self.loader:
                self.position += 1
                yield batch
            finished = True
        finally:
            self._pass_start, self.position = None, 0
            if finished:
                self.set_epoch(self.epoch + 1)

    def _generators(self) -> dict[str, torch.Generator]:
        """The generators a pass may draw from: Accelerate's synchronized one (the sampler's, without a
        seedable sampler), the loader's (worker seeds) and the sampler's (some may be one object)."""
        sampler = getattr(self.loader, "get_sampler", lambda: None)()
        candidates = {
            "synchronized_generator": getattr(self.loader, "synchronized_generator", None),
            "generator": getattr(self.loader, "generator", None),
            "sampler": getattr(sampler, "generator", None),
        }
        return {role: g for role, g in candidates.items() if isinstance(g, torch.Generator)}

    def skip_pending_resume(self) -> bool:
        """Forget the position a load gave the next pass; whether there was one."""
        pending, self._resume = self._resume is not None, None
        return pending

    def state_dict(self) -> dict[str, Any]:
        if self.stateful:
            return {"epoch": self.epoch, "position": 0, "generators": {}, "state": self.loader.state_dict()}
        if self._pass_start is not None:
            generators = self._pass_start
        else:
            generators = {role: g.get_state() for role, g in self._generators().items()}
        return {"epoch": self.epoch, "position": self.position, "generators": generators, "state": None}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Set the epoch now; the next pass restores the generators and skips the batches handed out.
        (Steps saved before the position was kept hold only the sampler's epoch.)"""
        if saved.get("epoch") is not None:
            self.set_epoch(saved["epoch"])
        if saved.get("state") is not None:
            self.loader.load_state_dict(saved["state"])
        if not self.stateful:
            self._resume = {"position": saved.get("position", 0), "generators": saved.get("generators", {})}


def _set_epoch(loader: Any, epoch: int) -> None:
    """The epoch of Accelerate's loader (its ``iteration``) and of its sampler: Accelerate's
    ``set_epoch`` does not reach a sampler inside its ``BatchSamplerShard``."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    sampler: Any = getattr(loader, "get_sampler", lambda: None)()
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
