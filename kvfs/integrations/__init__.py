"""Engine adapters: each puts one inference engine on kvfs's direct path.

Every module here imports its engine lazily, and only itself: ``import kvfs`` and
``import kvfs.integrations`` work without any engine installed. ``kvfs.integrations.vllm``
holds the vLLM v1 KV connector (``KVFSConnector``); other engines' adapters live beside it.
"""

from __future__ import annotations
