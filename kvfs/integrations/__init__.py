"""Engine adapters: each module plugs kvfs's direct path into one engine's own plug-in point.

Each imports its engine lazily, only in its own module, so ``import kvfs`` and
``import kvfs.integrations`` work without any engine installed:

- ``kvfs.integrations.vllm``: vLLM's v1 KV connector (``KVFSConnector``);
- ``kvfs.integrations.sglang``: SGLang HiCache's dynamic storage backend
  (``KVFSHiCacheStorage``);
- ``kvfs.integrations.lmcache``: an LMCache storage plugin (``KVFSBackend``).
"""

from __future__ import annotations
