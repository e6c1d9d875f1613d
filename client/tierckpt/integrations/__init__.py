"""Adapters for training frameworks; each imports its own framework only when used.

* ``tierckpt.integrations.lightning``: ``TierckptCallback`` (PyTorch Lightning; ``tierckpt[lightning]``)
* ``tierckpt.integrations.hf``: ``TierckptTrainer`` / ``TierckptTrainerMixin`` (``transformers.Trainer``;
  ``tierckpt[hf]``)
* ``tierckpt.integrations.accelerate``: ``TierckptAccelerator`` / ``TierckptAcceleratorMixin``
  (``accelerate.Accelerator``; ``tierckpt[hf]``)
* ``tierckpt.integrations.rng``: RNG states of a process, for frameworks that do not save them
* ``tierckpt.integrations.resume``: what the adapters say when a job resumes, or has nothing left to train

The rest of tierckpt never imports a framework (an import-linter contract in pyproject.toml).
"""

__all__: list[str] = []
