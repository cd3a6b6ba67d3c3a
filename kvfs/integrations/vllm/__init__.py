"""The vLLM v1 KV connector backed by kvfs (``KVFSConnector``), and a one-engine driver.

Loaded by vLLM with::

    --kv-transfer-config '{"kv_connector": "KVFSConnector",
        "kv_connector_module_path": "kvfs.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"mount": "/mnt/kvfs", "tenant": "acme"}}'

Extra config keys (``kv_connector_extra_config``):

- ``mount`` (required): the kvfs mount point.
- ``tenant`` (required): the tenant whose directory holds the blocks; the engine's uid
  must be allowed to use it.
- ``verify``: ``"full"`` (default: every loaded block's payload checksum is checked) or
  ``"sampled"`` (one block in 8; headers always).
- ``lookup_budget_s``: seconds a lookup may spend on blocks a lower tier (cold, S3) must
  supply (default 0.2); what has not arrived by then is a miss for that request and keeps
  arriving in the background for the next one.
- ``model_id``: the model name in the namespace (default: the model as vLLM names it; for
  a local directory, its last component).
- ``revision``: the model revision in the namespace (default: vLLM's ``revision``; for a
  local directory, a digest of its ``config.json`` and its weight files' names and sizes).
- ``direct``: ``true`` insists on the backing directory (the direct path), ``false``
  always goes through the mount, absent: the direct path where this uid may use it.
- ``max_pending_saves``: saves queued for the writer thread beyond which a save is dropped
  (a later miss, never a stalled forward pass); default 8.
- ``layerwise``: ``true`` loads layer by layer in the background, so that
  ``wait_for_layer_load`` returns as each layer lands (:mod:`.layerload`); ``false`` loads
  every block whole before the forward pass; absent (the default): layer by layer where the
  KV caches are in CUDA memory, whole on a CPU host (where the per-layer load competes with
  the forward pass for the cores: measured 2-10x slower on a 2-core host, no TTFT gain).
- ``kv_codec``: ``"exact"`` (default: the KV as computed) or ``"int8"``: blocks stored as
  int8 codes with one scale per (token, head), 1.9x more context in the same bytes, within
  the quality gate of ``kvfs bench codec`` (docs/benchmarks.md). It is part of the
  namespace: int8 KV never reaches an engine that asked for exact KV.

How it works. The scheduler side hashes the request's prompt into kvfs block hashes
(``kvfs.format.hashing.block_hashes`` with vLLM's block size, so one kvfs block is one vLLM block),
asks kvfs once for the cached prefix (:meth:`kvfs.KVCache.lookup`) and answers
``get_num_new_matched_tokens`` with the part of it beyond vLLM's own prefix cache. The metadata
of each step carries exactly the blocks to load (hash, vLLM block id) and the full prompt
blocks that the step completes, to save (a mount with lower tiers: the lookup runs in a thread
while the request waits, see :meth:`SchedulerSide._looked_up`). The worker side reads the block
files layer by layer into vLLM's paged KV tensors while the forward pass computes the layers
already in (:mod:`.layerload`; ``layerwise: false``: whole, straight into the pages with
:meth:`kvfs.KVCache.load_paged`, before the pass); after it, it copies the new full blocks out
of the pages (a memory copy) and hands them to the client's writer thread
(:meth:`kvfs.KVCache.save_async`), so no forward pass waits for the disk. A block that fails
verification or vanished between lookup and load is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes it, which vLLM 0.32 does only with
``"kv_load_failure_policy": "recompute"`` (its default, ``fail``, fails the request): set it.

The namespace (:class:`kvfs.ModelSpec`) comes from vLLM's configuration: model, revision,
KV dtype, block size, layers, KV heads, head size, TP size and rank, plus (``extras``) the
model dtype, the KV-cache dtype setting, the device type and vLLM's KV-cache layout.

Modules: ``config`` (the extra config keys, the namespace, opening it), ``scheduler`` (the
scheduler side), ``events`` (its KV events), ``worker`` (the worker side), ``layerload``
(its layer-wise load), ``mountwatch`` (whether the mount is still there, asked without
hanging), ``connector`` (the class joining them),
``example`` (the tests' oracle, vLLM's ExampleConnector), ``driver``: run as a module
(``python -m kvfs.integrations.vllm --help``), it runs one engine on prompts and prints a JSON
record; the tests and ``kvfs bench engine`` use it.
"""

from __future__ import annotations

from typing import Any

from .config import CONFIG_KEYS, DEFAULT_LOOKUP_BUDGET_S, ConfigError, model_spec, open_cache
from .connector import _INSTANCES, KVFSConnector
from .scheduler import KVFSMetadata
from .worker import KVFSStats

__all__ = ["CONFIG_KEYS", "DEFAULT_LOOKUP_BUDGET_S", "ConfigError", "KVFSConnector",
           "KVFSMetadata", "KVFSStats", "PrefixExampleConnector", "model_spec", "open_cache",
           "_INSTANCES"]


def __getattr__(name: str) -> Any:
    if name == "PrefixExampleConnector":
        from .example import _example_connector_class

        return _example_connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
