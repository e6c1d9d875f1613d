"""``tierckpt-replicator``: parse flags and environment, set up logging, run the daemon on uvloop."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Sequence

from tierckpt_replicator.settings import parse_settings

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = parse_settings(argv)
        settings.check_credentials()
    except ValueError as exc:
        print(f"tierckpt-replicator: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [{settings.node_name}] %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per peer request is noise
    import uvloop

    from tierckpt_replicator.daemon import serve
    from tierckpt_replicator.identity import IdentityRefused

    try:
        uvloop.run(serve(settings))  # asyncio.Runner with uvloop's loop (and Python 3.10's equivalent)
    except IdentityRefused as exc:  # another node's certificate, a foreign CA's, the operator's: peers
        # would refuse it, so the node would only look alive
        print(f"tierckpt-replicator: {exc}", file=sys.stderr)
        return 2
    _exit_past_stuck_threads()
    return 0


def _exit_past_stuck_threads() -> None:
    """Exit now if threads the shutdown abandoned still run (an upload to a bucket that does not answer,
    its client retrying for minutes): the interpreter would wait for them at exit, and a replicator
    given SIGTERM must exit within its grace period. What they leave is what a SIGKILL leaves."""
    stuck = [
        t.name
        for t in threading.enumerate()
        if t.is_alive() and not t.daemon and t is not threading.main_thread()
    ]
    if stuck:
        logging.getLogger("tierckpt_replicator").warning(
            "exiting with %d thread(s) still at work (%s): abandoned",
            len(stuck),
            ", ".join(sorted(stuck)[:8]),
        )
        logging.shutdown()
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
