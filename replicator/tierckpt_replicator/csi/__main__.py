"""``python -m tierckpt_replicator.csi``: the same as the ``tierckpt-csi`` console script."""

from tierckpt_replicator.csi.cli import main

if __name__ == "__main__":
    main()
