"""The metadata index: one SQLite database (WAL) beside the hot tier's files.

The index holds what POSIX and the policies need: inodes, names, attributes, sizes, access
times, tenant and model namespace, block hashes. It is an accelerator, not the truth: the
backing tree is the truth, and `kvfs.daemon.scanner` rebuilds the index from it.

All methods are synchronous and fast (indexed point queries). They are called from the
daemon's event-loop thread only: a run of statements between two awaits is atomic for the
other trio tasks. The connection runs in autocommit mode; multi-statement changes use
`transaction()`.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
#: `nodes.writing` of a file only passthrough writers hold, unchanged since they opened it.
WATCHED = 2

ROOT_INODE = 1
#: Inodes below this are reserved for virtual nodes (``.kvfs/`` and its files).
FIRST_REAL_INODE = 1000
#: The parent of nodes that have no name any more but are still known to the kernel.
ORPHAN_PARENT = 0


class NoSuchNode(LookupError):
    """The index has no node with that inode or name."""


#: A named regular file of the hot tier, as SQL (literals: partial indexes need them).
_HOT_FILE = (f"(mode & {0o170000}) = {stat.S_IFREG} AND parent != {ORPHAN_PARENT} "
             "AND tier = 0")


#: A directory, as SQL (a literal: the partial index nodes_subdirs needs it).
_DIR = f"(mode & {0o170000}) = {stat.S_IFDIR}"


def create_tables(db: sqlite3.Connection) -> None:
    """Create the schema. Every column is explained beside it."""
    db.executescript(
        f"""
        CREATE TABLE IF NOT EXISTS nodes (
            -- Never reused (AUTOINCREMENT). 1 is the root; 2..{FIRST_REAL_INODE - 1} are
            -- reserved for virtual nodes and never stored here.
            inode     INTEGER PRIMARY KEY AUTOINCREMENT,
            -- Inode of the containing directory. The root is its own parent.
            -- {ORPHAN_PARENT} (ORPHAN_PARENT): unlinked while the kernel still holds a
            -- lookup reference; purged in forget() or at the next mount.
            parent    INTEGER NOT NULL,
            -- Entry name as bytes (<= 255). Orphans get a unique placeholder name.
            name      BLOB NOT NULL,
            -- st_mode including the file type bits (S_IFREG, S_IFDIR, S_IFLNK).
            mode      INTEGER NOT NULL,
            uid       INTEGER NOT NULL,
            gid       INTEGER NOT NULL,
            -- Apparent size in bytes. Directories: 0. Symlinks: length of the target. While a
            -- file is open for writing, the daemon's in-memory size is newer than this one.
            size      INTEGER NOT NULL DEFAULT 0,
            -- Timestamps in ns. atime is the daemon's own access time (it drives LRU), not
            -- the backing filesystem's relatime.
            atime_ns  INTEGER NOT NULL,
            mtime_ns  INTEGER NOT NULL,
            ctime_ns  INTEGER NOT NULL,
            -- Symlink target; NULL for everything else.
            target    BLOB,
            -- Inode of the tenant directory (depth 1) above this node; the tenant directory
            -- itself carries its own inode; 0 for the root.
            tenant    INTEGER NOT NULL DEFAULT 0,
            -- Inode of the model-namespace directory (depth 2) above this node, itself for
            -- that directory; 0 above depth 2.
            ns        INTEGER NOT NULL DEFAULT 0,
            -- 1 while some process has the file open for writing. Persisted, so that after a
            -- crash a half-written file is recognised and removed, never served.
            -- 2 (WATCHED) while only passthrough writers hold it and the daemon has not seen
            -- it change: the kernel writes it without telling the daemon, so size, mtime_ns
            -- and ctime_ns are then the backing file's at their open, and a file that still
            -- matches them at the next mount was not written since (it is kept).
            writing   INTEGER NOT NULL DEFAULT 0,
            -- kvfs-native blocks only: the 16-byte block hash and its parent's, set once the
            -- file is complete and its header verified. NULL for every other file: such a
            -- file is never served as a block.
            block_hash  BLOB,
            parent_hash BLOB,
            -- 1: never evicted nor expired (user.kvfs.pin). Mirrored as trusted.kvfs.pin on
            -- the backing file, from which fsck restores it.
            pinned    INTEGER NOT NULL DEFAULT 0,
            -- Where the bytes are: 0 (HOT) in the backing directory; k > 0 only in the k-th
            -- configured lower tier (1 = the first below hot), the backing file gone. Such a
            -- node is listed with its size but takes no local blocks; opening it promotes it.
            tier      INTEGER NOT NULL DEFAULT 0,
            UNIQUE (parent, name)
        );
        -- Directory listing in inode order: readdir offsets are inodes, so they stay stable
        -- while entries are added and removed.
        CREATE INDEX IF NOT EXISTS nodes_by_parent ON nodes (parent, inode);
        -- Blocks that live only in a lower tier, for its use as this host knows it.
        CREATE INDEX IF NOT EXISTS nodes_by_tier ON nodes (tier) WHERE tier > 0;
        -- Blocks by namespace and hash: access records, chains, quarantine.
        CREATE INDEX IF NOT EXISTS nodes_by_block ON nodes (ns, block_hash)
            WHERE block_hash IS NOT NULL;
        -- A tenant's files in access order: the files whose eviction state is not held in
        -- memory are evicted from here, oldest first; retention scans the same order.
        CREATE INDEX IF NOT EXISTS nodes_by_atime ON nodes (tenant, atime_ns);
        -- Usage per namespace (hot, named regular files), read at every mount: scanning
        -- this covering index took 0.4 s against 6.3 s without it (1M files, page cache
        -- warm, 2-core VM).
        CREATE INDEX IF NOT EXISTS nodes_usage ON nodes (tenant, ns, size) WHERE {_HOT_FILE};
        -- Subdirectories by parent: a directory's link count is 2 + its subdirectories
        -- (what `find` and other POSIX tools rely on), one count over this index.
        CREATE INDEX IF NOT EXISTS nodes_subdirs ON nodes (parent) WHERE {_DIR};
        -- Directories whose entries the index does not hold yet: a tree adopted at its
        -- first mount is served at once and indexed a directory at a time, on demand (the
        -- first request that names something in it) and in the background.
        CREATE TABLE IF NOT EXISTS unlisted (
            inode INTEGER PRIMARY KEY
        );
        CREATE TABLE IF NOT EXISTS meta (
            key   TEXT PRIMARY KEY,
            value TEXT NOT NULL
        );
        """
    )


@dataclass(slots=True)
class Node:
    """One row of `nodes`."""

    inode: int
    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    target: bytes | None
    tenant: int
    ns: int
    writing: int
    block_hash: bytes | None
    parent_hash: bytes | None
    pinned: int = 0
    tier: int = 0

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)


_COLUMNS = (
    "inode, parent, name, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns, target, "
    "tenant, ns, writing, block_hash, parent_hash, pinned, tier"
)


#: The columns of the table aliased ``c`` in a join.
_CHILD_COLUMNS = ", ".join(f"c.{c.strip()}" for c in _COLUMNS.split(","))


def _node(row: tuple) -> Node:
    return Node(*row)


#: Write-ahead log pages (4 KiB) at which a commit checkpoints on its own, if the background
#: checkpoints (`Index.checkpoint`) have not let the log start over.
WAL_BACKSTOP_PAGES = 10_000


class Index:
    """Typed access to the index database."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        # A 16 MiB page cache, bounded: a million-file index is ~110 MiB on disk, and what
        # this cache misses the kernel's page cache mostly holds.
        self.db.execute("PRAGMA cache_size=-16384")
        self.db.execute("PRAGMA temp_store=MEMORY")
        # Checkpoints (the write-ahead log copied into the database, which is then synced)
        # run in a worker thread (`checkpoint`, once a second), not inside whichever commit
        # passes SQLite's 1,000 pages on the event loop; this backstop only bounds the log
        # under writes that never pause (a commit that finds it this long checkpoints).
        self.db.execute(f"PRAGMA wal_autocheckpoint={WAL_BACKSTOP_PAGES}")
        self.db.execute("PRAGMA journal_size_limit=16777216")  # the log's file, once reset
        self._checkpointer: sqlite3.Connection | None = None
        # Told of every node whose row changes, before the change (None: any node): the
        # mount's request thread stops answering for it (kvfs.daemon.passthrough `revoke`).
        self.changed: Callable[[int | None], None] = lambda inode: None
        # Told of every node taken out of the namespace (deleted or orphaned): the request
        # thread stops answering for the directory (kvfs.daemon.passthrough `take_dir`).
        self.gone: Callable[[int], None] = lambda inode: None
        create_tables(self.db)
        if self.get_meta("schema_version") is None:
            self.set_meta("schema_version", str(SCHEMA_VERSION))
            # Real inodes start above the reserved range.
            self.db.execute(
                "INSERT INTO sqlite_sequence (name, seq) VALUES ('nodes', ?)",
                (FIRST_REAL_INODE - 1,),
            )
        elif int(self.get_meta("schema_version") or 0) != SCHEMA_VERSION:
            raise RuntimeError(
                f"index {path} has schema version {self.get_meta('schema_version')}, "
                f"this kvfs reads {SCHEMA_VERSION}: run `kvfs fsck` to rebuild it"
            )

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
        self.db.close()

    def checkpoint(self) -> tuple[int, int]:
        """Thread: copy the write-ahead log into the database and sync it, on a connection of
        its own, without waiting for the event loop's reads and commits (SQLite's PASSIVE
        checkpoint), so that they never pay for it. One caller at a time. Returns the log's
        pages and how many of them are in the database now."""
        if self._checkpointer is None:
            self._checkpointer = sqlite3.connect(self.path, isolation_level=None,
                                                 check_same_thread=False)
            self._checkpointer.execute("PRAGMA synchronous=NORMAL")
        _, log, done = self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return log, done

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException:
            # (A COMMIT that fails, the disk full, may leave the transaction open: it is
            # rolled back too, or every later BEGIN would fail.)
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            self.changed(None)  # what was said of rows within it no longer holds
            raise

    #: Indexes a bulk load goes without, and rebuilds once at its end.
    SECONDARY = ("nodes_by_parent", "nodes_by_block", "nodes_by_atime", "nodes_usage",
                 "nodes_subdirs")

    def has_entries(self) -> bool:
        """Whether anything but the root is indexed."""
        return bool(self.db.execute("SELECT EXISTS (SELECT 1 FROM nodes WHERE inode > ?)",
                                    (ROOT_INODE,)).fetchone()[0])

    @contextlib.contextmanager
    def bulk_load(self) -> Iterator[None]:
        """Fill an empty index fast: without the secondary indexes, which are built once at
        the end (sorted, instead of a million random B-tree inserts)."""
        for name in self.SECONDARY:
            self.db.execute(f"DROP INDEX IF EXISTS {name}")
        try:
            yield
        finally:
            # Their sorts spill to temporary files, not to this process's memory.
            self.db.execute("PRAGMA temp_store=FILE")
            create_tables(self.db)
            self.db.execute("PRAGMA temp_store=MEMORY")

    # -- meta ---------------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    # -- nodes ----------------------------------------------------------------------------

    def get(self, inode: int) -> Node:
        row = self.db.execute(f"SELECT {_COLUMNS} FROM nodes WHERE inode=?", (inode,)).fetchone()
        if row is None:
            raise NoSuchNode(inode)
        return _node(row)

    def find(self, inode: int) -> Node | None:
        row = self.db.execute(f"SELECT {_COLUMNS} FROM nodes WHERE inode=?", (inode,)).fetchone()
        return _node(row) if row else None

    def lookup(self, parent: int, name: bytes) -> Node | None:
        row = self.db.execute(
            f"SELECT {_COLUMNS} FROM nodes WHERE parent=? AND name=?", (parent, name)
        ).fetchone()
        return _node(row) if row else None

    def present(self, parent: int, names: Iterable[bytes]) -> set[bytes]:
        """Which of ``names`` a directory holds."""
        names = list(names)
        out: set[bytes] = set()
        for k in range(0, len(names), 500):  # SQLite's limit on a statement's parameters
            part = names[k:k + 500]
            out.update(r[0] for r in self.db.execute(
                f"SELECT name FROM nodes WHERE parent=? AND name IN "
                f"({','.join('?' * len(part))})", (parent, *part)))
        return out

    def lookup_in(self, parent: int, name: bytes, child: bytes) -> Node | None:
        """``lookup(lookup(parent, name).inode, child)`` in one query."""
        row = self.db.execute(
            f"SELECT {_CHILD_COLUMNS} "
            "FROM nodes AS d JOIN nodes AS c ON c.parent = d.inode "
            "WHERE d.parent=? AND d.name=? AND c.name=?", (parent, name, child)).fetchone()
        return _node(row) if row else None

    def lookup_blocks(self, parent: int, names: Iterable[tuple[bytes, bytes]]
                      ) -> dict[tuple[bytes, bytes], Node]:
        """``lookup_in`` of many (directory name, child name) pairs below `parent`, in one
        query: the nodes found, by pair."""
        want = set(names)
        if not want:
            return {}
        dirs, kids = sorted({d for d, _ in want}), sorted({c for _, c in want})
        rows = self.db.execute(
            f"SELECT d.name, {_CHILD_COLUMNS} "
            "FROM nodes AS d JOIN nodes AS c ON c.parent = d.inode "
            f"WHERE d.parent=? AND d.name IN ({','.join('?' * len(dirs))}) "
            f"AND c.name IN ({','.join('?' * len(kids))})", (parent, *dirs, *kids)).fetchall()
        return {(r[0], r[3]): _node(r[1:]) for r in rows if (r[0], r[3]) in want}

    def children(self, parent: int, after: int = 0, limit: int = 1000) -> list[Node]:
        """Entries of a directory with inode > `after`, in inode order."""
        rows = self.db.execute(
            f"SELECT {_COLUMNS} FROM nodes WHERE parent=? AND inode>? AND inode!=? "
            "ORDER BY inode LIMIT ?",
            (parent, after, ROOT_INODE, limit),
        ).fetchall()
        return [_node(r) for r in rows]

    def child_names(self, parent: int) -> dict[bytes, int]:
        return dict(
            self.db.execute(
                "SELECT name, inode FROM nodes WHERE parent=? AND inode!=?", (parent, ROOT_INODE)
            )
        )

    def subdirs(self, parent: int) -> int:
        """How many directories a directory holds (named ones: orphans have parent 0)."""
        return self.db.execute(  # a literal, not a parameter: so that nodes_subdirs serves it
            f"SELECT COUNT(*) FROM nodes WHERE parent=? AND inode!=? AND {_DIR}",
            (parent, ROOT_INODE)).fetchone()[0]

    def has_children(self, parent: int) -> bool:
        return (
            self.db.execute(
                "SELECT 1 FROM nodes WHERE parent=? AND inode!=? LIMIT 1", (parent, ROOT_INODE)
            ).fetchone()
            is not None
        )

    def insert(
        self,
        *,
        parent: int,
        name: bytes,
        mode: int,
        uid: int,
        gid: int,
        size: int = 0,
        target: bytes | None = None,
        tenant: int = 0,
        ns: int = 0,
        writing: int = 0,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
        inode: int | None = None,
        block_hash: bytes | None = None,
        parent_hash: bytes | None = None,
    ) -> Node:
        now = time.time_ns()
        mtime = now if mtime_ns is None else mtime_ns
        atime = now if atime_ns is None else atime_ns
        self.changed(parent)  # its link count and times
        cur = self.db.execute(
            "INSERT INTO nodes (inode, parent, name, mode, uid, gid, size, atime_ns, mtime_ns, "
            "ctime_ns, target, tenant, ns, writing, block_hash, parent_hash) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (inode, parent, name, mode, uid, gid, size, atime, mtime, now, target, tenant, ns,
             writing, block_hash, parent_hash),
        )
        new = cur.lastrowid if inode is None else inode
        assert new is not None
        # A tenant directory is its own tenant; a depth-2 directory is its own namespace.
        if tenant == 0 and parent == ROOT_INODE and new != ROOT_INODE:
            self.db.execute("UPDATE nodes SET tenant=? WHERE inode=?", (new, new))
            tenant = new
        elif ns == 0 and tenant != 0 and parent == tenant and stat.S_ISDIR(mode):
            self.db.execute("UPDATE nodes SET ns=? WHERE inode=?", (new, new))
            ns = new
        return Node(new, parent, name, mode, uid, gid, size, atime, mtime, now, target, tenant,
                    ns, writing, block_hash, parent_hash)

    def lease_inodes(self, n: int) -> int:
        """Take `n` inode numbers off the sequence (for the request thread's creates,
        kvfs.daemon.made): the first of them; inside a transaction."""
        row = self.db.execute("UPDATE sqlite_sequence SET seq = seq + ? WHERE name = 'nodes' "
                              "RETURNING seq", (n,)).fetchone()
        return int(row[0]) - n + 1

    def insert_many(self, rows: list[tuple]) -> None:
        """Insert files in bulk (fsck): rows of (parent, name, mode, uid, gid, size, atime_ns,
        mtime_ns, target, tenant, ns, block_hash, parent_hash, pinned); ctime is now."""
        if rows:
            now = time.time_ns()
            self.db.executemany(
                "INSERT INTO nodes (parent, name, mode, uid, gid, size, atime_ns, mtime_ns, "
                "target, tenant, ns, block_hash, parent_hash, pinned, ctime_ns) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", [(*r, now) for r in rows])

    def update(self, inode: int, **fields: object) -> None:
        if not fields:
            return
        self.changed(inode)
        cols = ", ".join(f"{k}=?" for k in fields)
        self.db.execute(f"UPDATE nodes SET {cols} WHERE inode=?", (*fields.values(), inode))

    def set_times(self, inodes: Iterable[int], now_ns: int) -> None:
        """mtime and ctime of these nodes: ``now_ns``, in one statement."""
        inodes = list(inodes)
        for i in inodes:
            self.changed(i)
        self.db.executemany("UPDATE nodes SET mtime_ns=?, ctime_ns=? WHERE inode=?",
                            [(now_ns, now_ns, i) for i in inodes])

    def delete(self, inode: int) -> None:
        self.changed(inode)
        self.gone(inode)
        row = self.db.execute("DELETE FROM nodes WHERE inode=? RETURNING parent",
                              (inode,)).fetchone()
        if row is not None:
            self.changed(row[0])  # its directory's link count and times

    def orphan(self, inode: int, parent: int) -> None:
        """Take a node out of the namespace (its directory: `parent`), keeping the row for
        the kernel's references."""
        self.changed(inode)
        self.gone(inode)
        self.changed(parent)
        self.db.execute(
            "UPDATE nodes SET parent=?, name=? WHERE inode=?",
            (ORPHAN_PARENT, b"#%d" % inode, inode),
        )

    def move(self, inode: int, new_parent: int, new_name: bytes) -> None:
        """Rename a node (its old directory is the caller's to mark changed)."""
        self.changed(inode)
        self.changed(new_parent)
        self.db.execute(
            "UPDATE nodes SET parent=?, name=?, ctime_ns=? WHERE inode=?",
            (new_parent, new_name, time.time_ns(), inode),
        )

    def reassign_subtree(self, inode: int, tenant: int, ns: int) -> None:
        """Set tenant and namespace of a subtree moved to a new place.

        A node at depth 2 is its own namespace, so `ns` applies to the top of the subtree
        and is inherited below it.
        """
        self.changed(None)
        self.db.execute(
            """
            WITH RECURSIVE sub(i) AS (
                SELECT ? UNION ALL SELECT n.inode FROM nodes n JOIN sub ON n.parent = sub.i
                WHERE n.inode != n.parent
            )
            UPDATE nodes SET tenant=?, ns=? WHERE inode IN (SELECT i FROM sub)
            """,
            (inode, tenant, ns),
        )

    def purge_orphans(self) -> int:
        return self.db.execute("DELETE FROM nodes WHERE parent=?", (ORPHAN_PARENT,)).rowcount

    def find_block(self, ns: int, block_hash: bytes) -> Node | None:
        row = self.db.execute(
            f"SELECT {_COLUMNS} FROM nodes WHERE ns=? AND block_hash=? AND parent!=? LIMIT 1",
            (ns, block_hash, ORPHAN_PARENT),
        ).fetchone()
        return _node(row) if row else None

    def touch(self, blocks: list[tuple[int, int, bytes]], files: list[tuple[int, int]]) -> None:
        """Access times, in one transaction: of blocks, (atime_ns, namespace, block hash)
        each, and of files, (atime_ns, inode) each."""
        with self.transaction():
            if blocks:
                self.db.executemany(
                    "UPDATE nodes SET atime_ns=? WHERE ns=? AND block_hash=?", blocks)
            if files:
                self.db.executemany("UPDATE nodes SET atime_ns=? WHERE inode=?", files)

    def cached_files(self, newest: int, tenant: int | None = None) -> Iterator[Node]:
        """The `newest` most recently accessed named regular files of the hot tier (of one
        tenant, or of all), least recently accessed first: what the eviction policies start
        from."""
        # Each tenant's files in access order (nodes_by_atime), merged, in two passes that
        # hold nothing per file: newest first, (atime, inode) only, to find the cut-off;
        # then oldest first from the cut-off on.
        tenants = [tenant] if tenant is not None else [t.inode for t in self.tenants()]
        where = "tenant = ? AND (mode & ?) = ? AND parent != ? AND tier = 0"
        regular = (0o170000, stat.S_IFREG, ORPHAN_PARENT)
        keys = heapq.merge(*(self.db.execute(
            f"SELECT atime_ns, inode FROM nodes WHERE {where} "
            "ORDER BY atime_ns DESC, inode DESC LIMIT ?", (t, *regular, newest))
            for t in tenants), reverse=True)
        last = collections.deque(itertools.islice(keys, newest), maxlen=1)
        cut = last[0] if last else (-1, 0)
        runs = [self.db.execute(
            f"SELECT {_COLUMNS} FROM nodes WHERE {where} AND (atime_ns, inode) >= (?, ?) "
            "ORDER BY atime_ns, inode", (t, *regular, *cut)) for t in tenants]
        # Columns 7 and 0 are atime_ns and inode.
        return (_node(r) for r in heapq.merge(*runs, key=lambda r: (r[7], r[0])))

    def coldest(self, tenant: int, after: tuple[int, int], limit: int) -> list[Node]:
        """A tenant's evictable hot files (unpinned, complete, named) in access order, from
        just after (atime_ns, inode) `after` on."""
        rows = self.db.execute(
            f"SELECT {_COLUMNS} FROM nodes WHERE tenant = ? AND (atime_ns, inode) > (?, ?) "
            "AND (mode & ?) = ? AND parent != ? AND tier = 0 AND pinned = 0 AND writing = 0 "
            "ORDER BY atime_ns, inode LIMIT ?",
            (tenant, *after, 0o170000, stat.S_IFREG, ORPHAN_PARENT, limit)).fetchall()
        return [_node(r) for r in rows]

    def expired(self, tenant: int, idle_before_ns: int, written_before_ns: int,
                limit: int = 1000) -> list[Node]:
        """Unpinned files of a tenant idle since, or written before, the given times."""
        rows = self.db.execute(
            f"SELECT {_COLUMNS} FROM nodes WHERE tenant=? AND (mode & ?) = ? AND parent != ? "
            "AND pinned=0 AND tier=0 AND (atime_ns < ? OR mtime_ns < ?) ORDER BY atime_ns LIMIT ?",
            (tenant, 0o170000, stat.S_IFREG, ORPHAN_PARENT, idle_before_ns, written_before_ns,
             limit),
        ).fetchall()
        return [_node(r) for r in rows]

    def tenant_files(self, tenant: int, written_before_ns: int, limit: int = 1000
                     ) -> list[Node]:
        """Files of a tenant (pinned or not, in any tier) written before the given time."""
        rows = self.db.execute(
            f"SELECT {_COLUMNS} FROM nodes WHERE tenant=? AND (mode & ?) = ? AND parent != ? "
            "AND mtime_ns < ? LIMIT ?",
            (tenant, 0o170000, stat.S_IFREG, ORPHAN_PARENT, written_before_ns, limit),
        ).fetchall()
        return [_node(r) for r in rows]

    def tenants(self) -> list[Node]:
        return self.children(ROOT_INODE, limit=1 << 30)

    def writing_nodes(self) -> list[Node]:
        """Files open for writing (`writing` 1 or WATCHED) when the daemon last stopped."""
        rows = self.db.execute(f"SELECT {_COLUMNS} FROM nodes WHERE writing>0").fetchall()
        return [_node(r) for r in rows]

    # -- accounting -----------------------------------------------------------------------

    def usage_by_namespace(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(tenant, ns) -> (regular files, bytes), over nodes that have a name."""
        rows = self.db.execute(  # literals, not parameters: so that nodes_usage serves it
            "SELECT tenant, ns, COUNT(*), COALESCE(SUM(size), 0) FROM nodes "
            f"WHERE {_HOT_FILE} GROUP BY tenant, ns").fetchall()
        return {(t, n): (c, b) for t, n, c, b in rows}

    def tier_usage(self) -> dict[int, tuple[int, int]]:
        """tier -> (files, bytes) of the blocks this host knows to live only there."""
        rows = self.db.execute(
            "SELECT tier, COUNT(*), COALESCE(SUM(size), 0) FROM nodes WHERE tier > 0 "
            "AND parent != ? GROUP BY tier", (ORPHAN_PARENT,)).fetchall()
        return {t: (n, b) for t, n, b in rows}

    # -- directories not listed yet ---------------------------------------------------------

    def unlisted(self) -> list[int]:
        """Directories whose entries are not indexed yet, oldest first."""
        return [r[0] for r in self.db.execute("SELECT inode FROM unlisted ORDER BY inode")]

    def mark_unlisted(self, inodes: list[int]) -> None:
        self.db.executemany("INSERT OR IGNORE INTO unlisted (inode) VALUES (?)",
                            [(i,) for i in inodes])

    def mark_listed(self, inode: int) -> None:
        self.db.execute("DELETE FROM unlisted WHERE inode=?", (inode,))

    def count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM nodes").fetchone()[0]


def ensure_root(index: Index, st: os.stat_result) -> Node:
    """Make sure the root row exists, mirroring the backing directory's attributes."""
    root = index.find(ROOT_INODE)
    if root is None:
        index.insert(
            inode=ROOT_INODE,
            parent=ROOT_INODE,
            name=b"",
            mode=st.st_mode,
            uid=st.st_uid,
            gid=st.st_gid,
            atime_ns=st.st_atime_ns,
            mtime_ns=st.st_mtime_ns,
        )
        root = index.get(ROOT_INODE)
    return root
