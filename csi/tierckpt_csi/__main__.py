"""``python -m tierckpt_csi``: the same as the ``tierckpt-csi`` console script."""

from tierckpt_csi.cli import main

if __name__ == "__main__":
    main()
