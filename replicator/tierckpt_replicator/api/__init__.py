"""The control API: thin routes (``routes``) over the daemon, and request guards (``auth``)."""
