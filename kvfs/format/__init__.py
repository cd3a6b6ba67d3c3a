"""The format: what the daemon, the client and the offline tools share, and nothing else.

- :mod:`.blockfile`: the block file (header, payload, checksums, sums), docs/format.md;
- :mod:`.codec`: the block codecs (planes-zstd, int8), over the C loops of ``_codec``;
- :mod:`.hashing`: block names (hashes chained to the parent's) and model specs and their
  fingerprints;
- :mod:`.layout`: the backing tree's names (tenants, namespaces, manifests, temporaries);
- :mod:`.control`: the control protocol (``user.kvfs.*`` attribute names and payloads);
- :mod:`.config`: the primitives of settings (:class:`ConfigError`, sizes, TOML files).

Imports: the standard library, xxhash and zstandard only; nothing else of kvfs. Every other
folder may import this one.
"""
