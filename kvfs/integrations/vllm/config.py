"""The KVFSConnector's configuration: its ``kv_connector_extra_config`` keys, checked, and the
kvfs namespace (:class:`kvfs.ModelSpec`) built from vLLM's configuration; every way of opening
it that can fail becomes a :class:`ConfigError` naming the key."""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any

from kvfs.client import KVCache
from kvfs.format import codec
from kvfs.format.hashing import ModelSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: Extra config keys this connector reads (any other key is refused at start).
CONFIG_KEYS = ("mount", "tenant", "verify", "lookup_budget_s", "model_id", "revision",
               "direct", "max_pending_saves", "layerwise", "kv_codec", "inflight_wait_s")
#: ``kv_codec`` values: "exact" (the default: KV as the engine computed it, or as the
#: mount's hot-tier codec stores it losslessly), or a lossy codec (kvfs.format.codec.LOSSY), which
#: names another namespace.
KV_CODECS = ("exact", "int8")
DEFAULT_LOOKUP_BUDGET_S = 0.2
#: Seconds a new request may wait for the blocks of its prefix that another request of the
#: same engine is computing (and will save) rather than compute them a second time.
DEFAULT_INFLIGHT_WAIT_S = 30.0


class ConfigError(ValueError):
    """A kv_connector_extra_config key is missing or wrong; the message names it."""


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _local_revision(path: str) -> str:
    """A digest naming a local model directory's contents: config.json's bytes and the
    weight files' names and sizes (the same on every host holding the same copy)."""
    h = hashlib.sha256()
    try:
        with open(os.path.join(path, "config.json"), "rb") as f:
            h.update(f.read())
    except OSError:
        pass
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".bin", ".gguf", ".pt")):
            h.update(f"{name}:{os.path.getsize(os.path.join(path, name))}\n".encode())
    return "local-" + h.hexdigest()[:16]


def model_spec(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, extra: dict[str, Any],
               tp_rank: int) -> ModelSpec:
    """The kvfs namespace of this engine's KV: every fact that changes its bytes."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"KVFSConnector supports models with one KV-cache group, this one "
                          f"has {len(groups)}")
    kspec = groups[0].kv_cache_spec
    name = str(mc.model)
    local = os.path.isdir(name)
    model = str(extra.get("model_id") or (os.path.basename(os.path.normpath(name)) if local
                                          else name))
    revision = extra.get("revision") or mc.revision or (_local_revision(name) if local else "")
    from vllm.platforms import current_platform

    lossy = extra.get("kv_codec", "exact")
    device = str(current_platform.device_type)
    layout = {"page_layout": _cpu_page_layout(kspec.dtype, int(kspec.block_size),
                                              int(kspec.head_size), str(cc.cache_dtype))
              } if device == "cpu" else {}
    return ModelSpec(
        model=model, revision=str(revision), kv_dtype=_dtype_name(kspec.dtype),
        block_size=int(kspec.block_size), num_layers=len(groups[0].layer_names),
        num_kv_heads=int(kspec.num_kv_heads), head_dim=int(kspec.head_size),
        tp_size=int(pc.tensor_parallel_size), tp_rank=tp_rank,
        extras={"engine": "vllm", "model_dtype": _dtype_name(mc.dtype),
                "cache_dtype": str(cc.cache_dtype), "device": device,
                "kv_layout": str(kv_cache_config.kv_cache_layout or ""), **layout,
                **({} if lossy == "exact" else {codec.SPEC_KEY: lossy})})


def _cpu_page_layout(dtype: Any, block_size: int, head_size: int, cache_dtype: str) -> str:
    """How vLLM's CPU attention lays out a page, which the instruction set it picks decides
    (on an AMX host keys and values are packed in tiles, elsewhere in rows): pages saved on
    one host are KV only for hosts that pick the same one."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: PLC0415

        return "cpu-" + _get_attn_isa(dtype, block_size, head_size, cache_dtype)
    except ImportError:  # another vLLM: named by what the CPU can do, as vLLM 0.32 chose
        import torch  # noqa: PLC0415

        return "cpu-" + torch.backends.cpu.get_cpu_capability().lower()


def _seconds(extra: dict[str, Any], key: str, default: float) -> float:
    """``extra[key]`` as a number of seconds >= 0 (``default`` where absent)."""
    value = extra.get(key, default)
    try:
        if isinstance(value, bool):
            raise TypeError
        seconds = float(value)
        if not seconds >= 0:  # also NaN
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"kv_connector_extra_config.{key} must be a number >= 0, "
                          f"got {value!r}") from None
    return seconds


def extra_config(vllm_config: VllmConfig) -> dict[str, Any]:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown key(s) {unknown}; "
                          f"KVFSConnector reads {list(CONFIG_KEYS)}")
    for key in ("mount", "tenant"):
        if not extra.get(key) or not isinstance(extra[key], str):
            raise ConfigError(f"kv_connector_extra_config.{key} is required (a string)")
    if extra.get("verify", "full") not in ("full", "sampled"):
        raise ConfigError("kv_connector_extra_config.verify must be 'full' or 'sampled', "
                          f"got {extra['verify']!r}")
    for key, default in (("lookup_budget_s", DEFAULT_LOOKUP_BUDGET_S),
                         ("inflight_wait_s", DEFAULT_INFLIGHT_WAIT_S)):
        extra[key] = _seconds(extra, key, default)
    if extra.get("direct") not in (None, True, False):
        raise ConfigError("kv_connector_extra_config.direct must be true, false or absent")
    if extra.get("layerwise") not in (None, True, False):
        raise ConfigError("kv_connector_extra_config.layerwise must be true, false or absent")
    if extra.get("kv_codec", "exact") not in KV_CODECS:
        raise ConfigError(f"kv_connector_extra_config.kv_codec must be one of {list(KV_CODECS)}, "
                          f"got {extra['kv_codec']!r}")
    mps = extra.get("max_pending_saves", 8)
    if isinstance(mps, bool) or not isinstance(mps, int) or mps < 1:
        raise ConfigError("kv_connector_extra_config.max_pending_saves must be an int >= 1")
    return extra


def open_cache(mount: str, tenant: str, spec: ModelSpec, extra: dict[str, Any], *,
               loads_here: bool = True) -> KVCache:
    """Open the namespace, turning every way it can fail into an error naming the key.
    ``loads_here``: whether the worker that loads what this process's lookups find runs in
    this process (see :meth:`kvfs.client.KVCache.open`)."""
    if not os.path.isdir(mount):
        raise ConfigError(f"kv_connector_extra_config.mount: {mount!r} is not a directory")
    if not os.path.ismount(mount):
        raise ConfigError(f"kv_connector_extra_config.mount: {mount!r} is not a mount point "
                          "(is kvfs mounted there?)")
    try:
        return KVCache.open(mount, tenant=tenant, spec=spec, direct=extra.get("direct"),
                            verify=extra.get("verify", "full"),
                            max_pending_saves=extra.get("max_pending_saves", 8),
                            loads_here=loads_here)
    except FileNotFoundError as exc:
        raise ConfigError(f"kv_connector_extra_config.tenant: no tenant {tenant!r} in "
                          f"{mount} ({exc.strerror})") from None
    except PermissionError as exc:
        raise ConfigError(f"kv_connector_extra_config.tenant: uid {os.getuid()} may not use "
                          f"tenant {tenant!r} of {mount} ({exc.strerror})") from None
    except ValueError as exc:  # not a kvfs mount (no backing xattr), or another spec
        raise ConfigError(f"kv_connector_extra_config.mount: {exc}") from None

