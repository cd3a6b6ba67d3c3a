"""Tenant keys: envelope encryption of the blocks that leave the hot tier (kvfs.format.seal).

Each tenant has data keys (32 random bytes, a random u32 id each), kept only *wrapped* under
the operator's key-encryption key: a key file (``--key-file``, default ``/etc/kvfs/kek``,
created 0600 where absent; every host that shares a tier is given the same one) or a key
provider command (``--key-command``: a KMS or Vault behind it). The wrapped keys are stored
beside the data, in every tier the tenant may reach, under ``.kvfs/keys/<tenant>/`` (a name
no tenant can have), and in the hot tier's state directory, so any host sharing a tier can
unwrap them:

- ``<id>.key``: the wrapped key (JSON: tenant, id, creation time, which key-encryption key);
- ``<id>.retired``: the key no longer opens blocks (rotation's last step);
- ``forgotten-<ns>``: the tenant was forgotten (crypto-shredded) then: the key ids listed
  there were destroyed everywhere the forgetting host could reach.

A new block is sealed under the tenant's newest live key; older live keys still open theirs.
Unwrapped keys live in this process's memory only, each at most :attr:`Keyring.ttl` seconds
after it was unwrapped; every ``ttl`` the keyring lists the tiers' key directories again, so
a rotation, a retirement or a forgetting on another host reaches this one within that bound
(and a forgotten tenant's hot blocks here are removed: kvfs.daemon.reclaim).

Every method blocks (files, tier requests, the provider command): the daemon calls them from
worker threads. They are thread-safe. Failing to reach a key is :class:`KeyUnavailable`: a
block that needs it is a miss, and a block that would leave the hot tier stays where it is
(never written unsealed).
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import os
import secrets
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..format import seal
from .tiers.base import Tier, TierError

log = logging.getLogger(__name__)

DEFAULT_KEY_FILE = "/etc/kvfs/kek"
#: Seconds an unwrapped key is kept, and between two listings of the tiers' keys.
DEFAULT_TTL = 60.0
KEYS_PREFIX = ".kvfs/keys/"
COMMAND_TIMEOUT = 10.0
#: Seconds one key object's call to a tier may take (a listing, a get, a put, a delete):
#: key objects are small, and a key request (a tenant's mkdir, a client's keys, a seal) must
#: not wait on a hung store for its client's own timeouts. A tier that ran past it is skipped
#: for :data:`TIER_COOLDOWN` seconds.
TIER_DEADLINE = 5.0
TIER_COOLDOWN = 30.0
_WRAP_AAD = b"kvfs-data-key-1\0"
_FORMAT = "kvfs-key-1"


class KeyUnavailable(Exception):
    """A tenant key could not be had: no key-encryption key, a provider that failed, a key
    retired or forgotten, or no tier reachable that holds it. Says which and why."""


class KeyFile:
    """Wraps data keys with AES-256-GCM under a 32-byte key read from a file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._kek = self._load()
        self.id = hmac.digest(self._kek, b"kvfs-kek-id", "sha256")[:8].hex()

    def _create(self) -> bytes:
        """A new key, written whole under a name of its own and then linked into place:
        another daemon starting at the same moment reads no file or the whole key, never a
        part of it, and the first link wins (FileExistsError for the others)."""
        os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
        raw = secrets.token_bytes(32).hex().encode() + b"\n"
        tmp = f"{self.path}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, self.path)
        finally:
            os.unlink(tmp)
        log.warning("created the key-encryption key %s: give every host that shares a tier a "
                    "copy of it (0600, root's)", self.path)
        return raw

    def _load(self) -> bytes:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            try:
                raw = self._create()
            except FileExistsError:  # another daemon made it meanwhile
                return self._load()
            except OSError as exc:
                raise KeyUnavailable(f"key file {self.path}: {exc.strerror}") from None
        except OSError as exc:
            raise KeyUnavailable(f"key file {self.path}: {exc.strerror}") from None
        text = raw.strip()
        try:
            kek = bytes.fromhex(text.decode()) if len(text) == 64 else bytes(text)
        except (ValueError, UnicodeDecodeError):
            kek = b""
        if len(kek) != 32:
            raise KeyUnavailable(f"key file {self.path}: not a 256-bit key (64 hex digits "
                                 "or 32 bytes)")
        return kek

    def wrap(self, tenant: str, key_id: int, dk: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + AESGCM(self._kek).encrypt(nonce, dk, _wrap_aad(tenant, key_id))

    def unwrap(self, tenant: str, key_id: int, wrapped: bytes) -> bytes:
        try:
            return AESGCM(self._kek).decrypt(wrapped[:12], wrapped[12:],
                                             _wrap_aad(tenant, key_id))
        except (InvalidTag, ValueError):
            raise KeyUnavailable(f"tenant {tenant} key {key_id:08x} does not unwrap under "
                                 f"{self.path} (another host's key-encryption key?)") from None

    def forget(self, tenant: str) -> None:
        """Nothing to destroy here: the wrapped keys are in the tiers."""


class KeyCommand:
    """Wraps data keys with a key provider the operator names (``--key-command CMD``):
    ``CMD wrap TENANT ID`` (the data key on stdin, the wrapped key on stdout), ``CMD unwrap
    TENANT ID`` (the reverse) and ``CMD forget TENANT`` (destroy the provider's keys of that
    tenant). A non-zero exit or a timeout is :class:`KeyUnavailable`, with its stderr."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.id = "command"

    def _run(self, *args: str, data: bytes = b"") -> bytes:
        try:
            p = subprocess.run([*self.command.split(), *args], input=data,
                               capture_output=True, timeout=COMMAND_TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise KeyUnavailable(f"key command {self.command!r} {args[0]}: {exc}") from None
        if p.returncode:
            err = p.stderr.decode(errors="replace").strip()[-300:]
            raise KeyUnavailable(f"key command {self.command!r} {args[0]} exited "
                                 f"{p.returncode}: {err}")
        return p.stdout

    def wrap(self, tenant: str, key_id: int, dk: bytes) -> bytes:
        return self._run("wrap", tenant, f"{key_id:08x}", data=dk)

    def unwrap(self, tenant: str, key_id: int, wrapped: bytes) -> bytes:
        dk = self._run("unwrap", tenant, f"{key_id:08x}", data=wrapped)
        if len(dk) != seal.KEY_BYTES:
            raise KeyUnavailable(f"key command {self.command!r} unwrap gave {len(dk)} bytes, "
                                 f"not a {seal.KEY_BYTES}-byte key")
        return dk

    def forget(self, tenant: str) -> None:
        self._run("forget", tenant)


def _wrap_aad(tenant: str, key_id: int) -> bytes:
    return _WRAP_AAD + tenant.encode() + b"\0" + key_id.to_bytes(4, "little")


@dataclass
class _Tenant:
    wrapped: dict[int, dict[str, Any]] = field(default_factory=dict)  # id -> the key object
    retired: set[int] = field(default_factory=set)
    destroyed: set[int] = field(default_factory=set)  # ids a forgetting named
    forgotten_at: int = 0  # ns: the newest forgetting seen
    cache: dict[int, tuple[bytes, float]] = field(default_factory=dict)  # id -> (dk, until)

    def live(self) -> list[int]:
        """Live ids, newest first."""
        ids = [i for i in self.wrapped if i not in self.retired and i not in self.destroyed]
        return sorted(ids, key=lambda i: (self.wrapped[i].get("created", 0), i), reverse=True)


class Keyring:
    """The tenants' data keys of one mount."""

    def __init__(self, wrapper: KeyFile | KeyCommand, local: str, tiers: list[Tier], *,
                 ttl: float = DEFAULT_TTL,
                 reach: Callable[[str], list[int]] | None = None,
                 audit: Callable[..., None] | None = None,
                 deadline: float = TIER_DEADLINE) -> None:
        self.wrapper = wrapper
        self.local = local  # a directory only root reads: the hot tier's copies
        self.tiers = tiers
        self.ttl = ttl
        #: The tier indexes a tenant's blocks (and so its keys) may reach (placement).
        self.reach = reach or (lambda tenant: list(range(len(tiers))))
        self.audit = audit or (lambda **kw: None)
        self._lock = threading.RLock()
        self._tenants: dict[str, _Tenant] = {}
        self._listed = 0.0
        self.deadline = deadline
        self._down: dict[int, float] = {}  # tier index -> skipped until (monotonic)
        self._calls = ThreadPoolExecutor(4, thread_name_prefix="kvfs-keys")
        os.makedirs(local, mode=0o700, exist_ok=True)

    # -- the stores: the local directory and the tiers ------------------------------------

    def _local_path(self, key: str) -> str:
        return os.path.join(self.local, key[len(KEYS_PREFIX):].replace("/", "%"))

    def _call(self, i: int, fn: Callable[..., Any], *args: Any, what: str = "keys") -> Any:
        """``fn(*args)`` against tier ``i`` within :attr:`deadline` seconds; TierError when it
        ran past it (the call is left to end in its thread) or while the tier is skipped."""
        name = self.tiers[i].name
        if self._down.get(i, 0.0) > time.monotonic():
            raise TierError(name, "call", what, f"skipped for key objects (it did not "
                            f"answer within {self.deadline:g} s a moment ago)")
        future = self._calls.submit(fn, *args)
        try:
            return future.result(timeout=self.deadline)
        except FutureTimeout:
            self._down[i] = time.monotonic() + TIER_COOLDOWN
            raise TierError(name, "call", what,
                            f"no answer within {self.deadline:g} s") from None

    def _put(self, key: str, data: bytes, tiers: list[int]) -> list[str]:
        """Store one key object locally and in ``tiers``: the tiers it could not reach."""
        path = self._local_path(key)
        tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        failed = []
        for i in tiers:
            try:
                self._call(i, self.tiers[i].put, key, data)
            except (TierError, OSError) as exc:
                failed.append(self.tiers[i].name)
                log.warning("keys: %s not stored in the %s tier: %s", key, self.tiers[i].name,
                            exc)
        return failed

    def _read_tier(self, i: int, key: str) -> bytes | None:
        tier = self.tiers[i]
        tmp = os.path.join(self.local, f"get.{os.getpid()}.{threading.get_ident()}")
        try:
            if not self._call(i, tier.get, key, tmp):
                return None
            with open(tmp, "rb") as f:
                return f.read()
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _scan(self, tenant: str | None) -> None:
        """Read what the local directory and the tiers hold (one listing each)."""
        prefix = KEYS_PREFIX + (f"{tenant}/" if tenant else "")
        found: dict[str, bytes | int] = {}  # key -> its local copy, or a tier that has it
        for name in os.listdir(self.local):
            key = KEYS_PREFIX + name.replace("%", "/")
            if "%" in name and not name.endswith(".tmp") and key.startswith(prefix):
                with open(os.path.join(self.local, name), "rb") as f:
                    found[key] = f.read()
        for i, tier in enumerate(self.tiers):
            try:
                for k, _size in self._call(i, lambda t=tier: list(t.list(prefix))):
                    found.setdefault(k, i)
            except (TierError, OSError) as exc:
                log.info("keys: cannot list the %s tier: %s", tier.name, exc)
        for key, where in sorted(found.items()):
            parts = key[len(KEYS_PREFIX):].split("/")
            if len(parts) != 2:
                continue
            t, leaf = parts
            data = where if isinstance(where, bytes) else None
            if isinstance(where, int) and leaf.endswith((".key", ".retired")) or (
                    isinstance(where, int) and leaf.startswith("forgotten-")):
                try:
                    data = self._read_tier(where, key)
                except (TierError, OSError) as exc:
                    log.info("keys: cannot read %s: %s", key, exc)
                    continue
                if data is not None:  # a local copy: the next mount needs no tier for it
                    path = self._local_path(key)
                    with open(path + ".tmp", "wb") as f:
                        f.write(data)
                    os.replace(path + ".tmp", path)
            self._learn(t, leaf, data)
        self._listed = time.monotonic()

    def _learn(self, tenant: str, leaf: str, data: bytes | None) -> None:
        st = self._tenants.setdefault(tenant, _Tenant())
        try:
            if leaf.endswith(".key") and data is not None:
                obj = json.loads(data)
                if obj.get("format") == _FORMAT and obj.get("tenant") == tenant:
                    st.wrapped[int(obj["id"])] = obj
            elif leaf.endswith(".retired"):
                st.retired.add(int(leaf.split(".")[0], 16))
            elif leaf.startswith("forgotten-") and data is not None:
                obj = json.loads(data)
                ids = [int(i) for i in obj.get("ids", [])]
                st.destroyed.update(ids)
                st.forgotten_at = max(st.forgotten_at, int(leaf.split("-", 1)[1]))
                for i in ids:  # this host's copies of the destroyed keys go too
                    st.wrapped.pop(i, None)
                    for end in (".key", ".retired"):
                        path = self._local_path(f"{KEYS_PREFIX}{tenant}/{i:08x}{end}")
                        if os.path.exists(path):
                            os.unlink(path)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("keys: ignoring %s/%s: %s", tenant, leaf, exc)
        for i in list(st.cache):
            if i in st.retired or i in st.destroyed:
                del st.cache[i]

    def _state(self, tenant: str) -> _Tenant:
        with self._lock:
            if tenant not in self._tenants or time.monotonic() - self._listed > self.ttl:
                self._scan(tenant)
            return self._tenants.setdefault(tenant, _Tenant())

    # -- what the daemon asks --------------------------------------------------------------

    def ensure(self, tenant: str) -> int:
        """The id of ``tenant``'s newest live key, made (and stored in every tier it may
        reach) where it has none."""
        with self._lock:
            st = self._state(tenant)
            live = st.live()
            if live:
                return live[0]
            return self._create(tenant, "create")

    def _create(self, tenant: str, why: str) -> int:
        st = self._tenants.setdefault(tenant, _Tenant())
        key_id = secrets.randbits(32)
        while key_id in st.wrapped or key_id in st.destroyed:
            key_id = secrets.randbits(32)
        dk = secrets.token_bytes(seal.KEY_BYTES)
        wrapped = self.wrapper.wrap(tenant, key_id, dk)
        obj = {"format": _FORMAT, "tenant": tenant, "id": key_id, "created": time.time_ns(),
               "kek": self.wrapper.id,
               "wrapped": base64.b64encode(wrapped).decode()}
        failed = self._put(f"{KEYS_PREFIX}{tenant}/{key_id:08x}.key",
                           json.dumps(obj).encode(), self.reach(tenant))
        st.wrapped[key_id] = obj
        st.cache[key_id] = (dk, time.monotonic() + self.ttl)
        self.audit(op=f"key-{why}", tenant=tenant, key_id=f"{key_id:08x}",
                   unreached=failed)
        log.info("tenant %s: key %08x %s", tenant, key_id, why + "d")
        return key_id

    def data_key(self, tenant: str, key_id: int) -> bytes:
        """``tenant``'s data key ``key_id`` (unwrapped at most ``ttl`` seconds ago)."""
        with self._lock:
            st = self._state(tenant)
            got = st.cache.get(key_id)
            if got is not None and got[1] > time.monotonic():
                return got[0]
            if key_id in st.destroyed:
                raise KeyUnavailable(f"tenant {tenant} key {key_id:08x} was destroyed "
                                     "(the tenant was forgotten)")
            if key_id in st.retired:
                raise KeyUnavailable(f"tenant {tenant} key {key_id:08x} is retired")
            if key_id not in st.wrapped:
                self._scan(tenant)
            obj = st.wrapped.get(key_id)
            if obj is None:
                raise KeyUnavailable(f"tenant {tenant} has no key {key_id:08x} in any "
                                     "reachable tier")
            dk = self.wrapper.unwrap(tenant, key_id, base64.b64decode(obj["wrapped"]))
            st.cache[key_id] = (dk, time.monotonic() + self.ttl)
            return dk

    def sealing_key(self, tenant: str, namespace: str) -> tuple[int, bytes]:
        """(key id, namespace key) that new blocks of ``tenant``'s ``namespace`` are sealed
        with."""
        key_id = self.ensure(tenant)
        return key_id, seal.namespace_key(self.data_key(tenant, key_id), tenant, namespace)

    def namespace_key(self, tenant: str, namespace: str, key_id: int) -> bytes:
        return seal.namespace_key(self.data_key(tenant, key_id), tenant, namespace)

    def namespace_keys(self, tenant: str, namespace: str, want: int | None = None
                       ) -> list[tuple[int, bytes]]:
        """Every live key of ``tenant`` as ``namespace``'s keys, newest first (what a client
        of that namespace is given to open the blocks it was granted); ``want``: a key id
        the client met and was not given, looked for in the tiers again (another host's)."""
        with self._lock:
            st = self._state(tenant)
            if want is not None and want not in st.wrapped:
                self._scan(tenant)
            out = []
            for key_id in st.live():
                try:
                    out.append((key_id, self.namespace_key(tenant, namespace, key_id)))
                except KeyUnavailable as exc:
                    log.warning("keys: %s", exc)
            return out

    def rotate(self, tenant: str) -> int:
        """A new key for ``tenant``: new blocks are sealed with it, older ones still open."""
        with self._lock:
            self._scan(tenant)
            return self._create(tenant, "rotate")

    def retire(self, tenant: str, key_id: int) -> None:
        """``tenant``'s key ``key_id`` opens nothing any more (its blocks become misses). The
        newest live key cannot be retired: rotate first."""
        with self._lock:
            st = self._state(tenant)
            live = st.live()
            if key_id not in live:
                raise KeyUnavailable(f"tenant {tenant} has no live key {key_id:08x}")
            if live[0] == key_id:
                raise KeyUnavailable(f"key {key_id:08x} is tenant {tenant}'s newest: rotate "
                                     "before retiring it")
            failed = self._put(f"{KEYS_PREFIX}{tenant}/{key_id:08x}.retired", b"retired\n",
                               self.reach(tenant))
            st.retired.add(key_id)
            st.cache.pop(key_id, None)
            self.audit(op="key-retire", tenant=tenant, key_id=f"{key_id:08x}",
                       unreached=failed)

    def forget(self, tenant: str) -> dict[str, Any]:
        """Crypto-shred ``tenant``: its wrapped keys destroyed in every tier (all of them,
        not only its placement's: a block may predate it) and the provider, a tombstone left
        so other hosts drop theirs. What was and was not reached."""
        with self._lock:
            self._scan(tenant)
            st = self._tenants.setdefault(tenant, _Tenant())
            ids = sorted(set(st.wrapped) | st.destroyed)
            report: dict[str, Any] = {"tenant": tenant, "keys": [f"{i:08x}" for i in ids],
                                      "destroyed_in": [], "not_reached": []}
            try:
                self.wrapper.forget(tenant)
                report["destroyed_in"].append(f"provider:{self.wrapper.id}")
            except KeyUnavailable as exc:
                report["not_reached"].append(f"provider: {exc}")
            now = time.time_ns()
            tomb = json.dumps({"tenant": tenant, "ids": ids, "at": now}).encode()
            for i, tier in enumerate(self.tiers):
                try:
                    self._down.pop(i, None)  # forgetting tries every tier again
                    listed = self._call(i, lambda t=tier: list(t.list(f"{KEYS_PREFIX}{tenant}/")))
                    for k, _size in listed:
                        if k.endswith((".key", ".retired")):
                            self._call(i, tier.delete, k)
                    self._call(i, tier.put, f"{KEYS_PREFIX}{tenant}/forgotten-{now}", tomb)
                    report["destroyed_in"].append(tier.name)
                except (TierError, OSError) as exc:
                    report["not_reached"].append(f"{tier.name}: {exc}")
            for name in os.listdir(self.local):
                if name.startswith(f"{tenant}%") and name.endswith((".key", ".retired")):
                    os.unlink(os.path.join(self.local, name))
            path = self._local_path(f"{KEYS_PREFIX}{tenant}/forgotten-{now}")
            with open(path, "wb") as f:
                f.write(tomb)
            st.wrapped.clear()
            st.retired.clear()
            st.cache.clear()
            st.destroyed.update(ids)
            st.forgotten_at = now
            report["destroyed_in"].append("hot")
            self.audit(op="key-destroy", tenant=tenant, key_id=",".join(report["keys"]),
                       not_reached=report["not_reached"])
            return report

    def refresh(self) -> dict[str, int]:
        """List every tier's keys again and drop the unwrapped keys past their time: the
        tenants forgotten since the last refresh, with when (ns)."""
        with self._lock:
            before = {t: s.forgotten_at for t, s in self._tenants.items()}
            self._scan(None)
            now = time.monotonic()
            for st in self._tenants.values():
                for i in [i for i, (_dk, until) in st.cache.items() if until <= now]:
                    del st.cache[i]
            return {t: s.forgotten_at for t, s in self._tenants.items()
                    if s.forgotten_at > before.get(t, 0)}

    def snapshot(self) -> dict[str, Any]:
        """For stats.json: per tenant its live, retired and destroyed key ids."""
        with self._lock:
            return {t: {"live": [f"{i:08x}" for i in s.live()],
                        "retired": [f"{i:08x}" for i in sorted(s.retired)],
                        "forgotten": bool(s.forgotten_at)}
                    for t, s in sorted(self._tenants.items())}


def wrapper_from(key_file: str | None, key_command: str | None) -> KeyFile | KeyCommand:
    """The key-encryption key a mount was given (a command wins over a file)."""
    if key_command:
        return KeyCommand(key_command)
    return KeyFile(key_file or DEFAULT_KEY_FILE)


