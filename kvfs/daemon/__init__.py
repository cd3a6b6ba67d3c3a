"""The daemon: everything only the mount process runs (pyfuse3 and trio).

Request path: :mod:`.fs` (the pyfuse3 operations; :mod:`.handlers` wraps each so that no
exception escapes to pyfuse3) over :mod:`.tree` (the shared state of one mount: the node
cache, paths, the worker-thread hand-off), :mod:`.index` (the SQLite metadata), :mod:`.store`
(the backing tree's operations, every path resolved by :mod:`.backing`), :mod:`.openfiles`
and :mod:`.door` (open files; FUSE passthrough through :mod:`.passthrough`). Policy and
accounting: :mod:`.residency`, :mod:`.reclaim` (eviction), :mod:`.capacity`, :mod:`.stats`.
Files the index never saw: :mod:`.adoption` (at mount and on first listing), over
:mod:`.scanner`, the one scanner of an unindexed tree (``kvfs fsck`` stands on it too). The
control plane: :mod:`.xattrs`, :mod:`.commands`, :mod:`.grants`, :mod:`.handout`,
:mod:`.virtual` and :mod:`.stats_json` (``.kvfs/``). Below hot: :mod:`.tiers` and
:mod:`.promotion`. Around it: :mod:`.mount` (options, lifetime), :mod:`.settings` (the
option table), :mod:`.watchdog`, :mod:`.notify`, :mod:`.metrics`, :mod:`.audit`,
:mod:`.closer`.

Imports: :mod:`kvfs.format` and :mod:`kvfs.models.policy` (the eviction policies the
simulator drives too); never the client, the engines' integrations, the benchmarks or the
command line.
"""
