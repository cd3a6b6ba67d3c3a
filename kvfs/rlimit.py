"""The open-file limit of a kvfs process (the daemon and the client library both hold many
files open at once): its soft limit raised towards a wanted number, within the hard one."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def raise_open_files(limit: int) -> int:
    """Raise the soft RLIMIT_NOFILE to `limit` (or to the hard limit, if lower); never lower
    it. The soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = limit if hard == resource.RLIM_INFINITY else min(hard, limit)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError) as exc:
            log.warning("could not raise the open-file limit from %d: %s", soft, exc)
            return soft
        log.debug("raised the open-file limit from %d to %d", soft, want)
        return want
    return soft
