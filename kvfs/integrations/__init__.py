"""Engine adapters: each module plugs kvfs's direct path into one engine's own plug-in point.

Each imports its engine lazily, only in its own module, so ``import kvfs`` and
``import kvfs.integrations`` work without any engine installed:

- ``kvfs.integrations.vllm``: vLLM's v1 KV connector (``KVFSConnector``);
- ``kvfs.integrations.sglang``: SGLang HiCache's dynamic storage backend
  (``KVFSHiCacheStorage``);
- ``kvfs.integrations.lmcache``: an LMCache storage plugin (``KVFSBackend``).

Imports: :mod:`kvfs.format` and :mod:`kvfs.client` (and each its own engine, lazily);
never the daemon, the models, the benchmarks or the command line.
"""

from __future__ import annotations
