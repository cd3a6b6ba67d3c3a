"""The virtual `.kvfs/` directory at the root of the mount: `stats.json` (kvfs.daemon.stats_json)
and `version`. Its inodes are in the range below index.FIRST_REAL_INODE that the index reserves;
nothing of it is in the index or the backing tree, and nothing in it can be changed.
"""

from __future__ import annotations

import stat

import pyfuse3

from ..format.layout import STATE_DIR

VDIR = 2
VSTATS = 3
VVERSION = 4
VDIR_NAME = STATE_DIR
VFILES = {b"stats.json": VSTATS, b"version": VVERSION}
#: Every virtual inode.
INODES = (VDIR, VSTATS, VVERSION)


def attrs(inode: int, started: float) -> pyfuse3.EntryAttributes:
    """The attributes of a virtual node; `started`: when the mount started (its times)."""
    a = pyfuse3.EntryAttributes()
    a.st_ino = inode
    a.entry_timeout = a.attr_timeout = 0
    a.st_mode = (stat.S_IFDIR | 0o555) if inode == VDIR else (stat.S_IFREG | 0o444)
    a.st_nlink = 2 if inode == VDIR else 1
    a.st_blksize = 4096
    t = int(started * 1e9)
    a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = t
    return a


def readdir(token: pyfuse3.ReaddirToken, start_id: int, started: float) -> None:
    """List `.kvfs/` from entry `start_id` on."""
    for i, (name, inode) in enumerate(VFILES.items(), start=1):
        if i > start_id and not pyfuse3.readdir_reply(token, name, attrs(inode, started), i):
            return
