"""The on-disk and namespace layout both sides share: names in the backing tree and in the
mount that are kvfs's own, and the reserved inode numbers.

Imported by the daemon (store, fsck, tiers, the FUSE layer) and by the client; it imports
nothing of kvfs, so it can never be a cycle.
"""

from __future__ import annotations

import re

#: What a tenant's name may be (a directory at the mount's root; what a user name or a DNS
#: label may be): 1 to 64 letters, digits and ``_ . @ -``, the first a letter, digit or
#: ``_`` (so never a dot name of kvfs's own). The daemon and the command line check it.
TENANT_NAME = re.compile(rb"^[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}$")
#: Where the daemon keeps its own state inside the backing root (index, lock, log,
#: quarantine, staging). Never a tenant: tenant names cannot start with a dot. The mount
#: shows a virtual directory of the same name at its root (stats.json, version).
STATE_DIR = b".kvfs"
#: The daemon's handout socket in the backing root (kvfs.daemon.handout), a directory tier's block
#: files handed to the clients granted them. Never a tenant (a dot name, and not a directory).
HANDOUT_SOCKET = b".kvfs.sock"
#: Prefix of temporaries that the direct path writes before renaming into place.
TEMP_PREFIX = b".kvfs-tmp."
#: Bad files are moved here, below STATE_DIR.
QUARANTINE = b"quarantine"
#: Fetched blocks are received and verified here, below STATE_DIR (root's alone), then
#: renamed into their verified directory: never through a path a tenant can redirect.
STAGING = b"staging"
#: The file the client keeps in each model namespace: the model's spec, written once.
MANIFEST = b"manifest.json"
#: On a backing directory: some file in it is (or was) pinned (a trusted xattr: root's).
PINS_MARK = b"trusted.kvfs.pins"
