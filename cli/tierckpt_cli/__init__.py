"""The ``tierckpt`` command line: inspect and maintain ramdisks and buckets, and run the local demo.

Each command lives in its own module as a thin shell over library functions; ``app`` wires them up.
Heavy or optional dependencies (torch for the demo, google-cloud-storage, kubernetes) are imported
only inside the commands that need them, so ``tierckpt --help`` stays fast.
"""

__all__: list[str] = []
