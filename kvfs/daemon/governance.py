"""KV as governed data: the tenants' placements, their keys' lives, and forgetting a tenant.

- **Placement** (a tenant's `placement` limit, kvfs.daemon.capacity.Limits): the tiers its
  blocks may reach. The mover (kvfs.daemon.tiers.mover) asks :meth:`Governance.placement_of`
  before every put, fetch, locate and handout; a block is never put in a tier outside it
  (counted, and audited once a minute per tenant and tier), and lookups look only inside it.
- **Keys** (kvfs.daemon.keys): each tenant gets a key when it is made and, at the mount, when
  it has none; every ``key_ttl`` the keyring reads the tiers' keys again (another host's
  rotation, retirement or forgetting). A client is given its namespace's keys
  (:meth:`client_keys`, getxattr ``user.kvfs.keys``), never the tenant's data key.
- **Forgetting** (:meth:`forget`, setxattr ``user.kvfs.forget`` on a tenant, root only):
  the tenant's wrapped keys are destroyed in every tier and the provider first (from then on
  no host can open its sealed blocks anywhere), then its blocks are removed here and deleted
  from every tier in the background; the report (getxattr ``user.kvfs.forget``) says what was
  and was not reached. A host that finds another's forgetting in a tier removes the tenant's
  blocks it holds (written before then), within ``key_ttl``.

State: on the event loop, except the keyring's (its own lock, used from worker threads).
"""

from __future__ import annotations

import errno
import json
import logging
import time
from typing import Any

import trio
from pyfuse3 import FUSEError

from ..format import control
from .index import ROOT_INODE, Node
from .keys import Keyring, KeyUnavailable
from .reclaim import Reclaim
from .tiers.base import TierError
from .tree import Tree

log = logging.getLogger(__name__)

#: Seconds between two audit records of one tenant's refused placement in one tier.
REFUSED_AUDIT_EVERY = 60.0
#: Errors a forgetting's report keeps (the rest are counted).
REPORT_ERRORS = 20


class Governance:
    def __init__(self, tree: Tree, reclaim: Reclaim, keyring: Keyring | None) -> None:
        self.tree = tree
        self.reclaim = reclaim
        self.tiering = tree.tiering
        self.keyring = keyring
        self.reports: dict[str, dict[str, Any]] = {}
        self._placements: dict[str, tuple[str, ...] | None] = {}
        self._refused: dict[tuple[str, str], float] = {}
        if self.tiering is not None:
            self.tiering.placement = self.placement_of
            self.tiering.on_refused = self.refused
        if self.keyring is not None:
            self.keyring.audit = self._audit_key

    # -- placement ------------------------------------------------------------------------

    def tier_names(self) -> set[str]:
        return {"hot"} | ({t.name for t in self.tiering.tiers} if self.tiering else set())

    def set_placement(self, tenant: str, placement: tuple[str, ...] | None) -> None:
        self._placements[tenant] = placement

    def placement_of(self, tenant: str) -> frozenset[str] | None:
        """The tiers ``tenant``'s blocks may reach (None: all)."""
        got = self._placements.get(tenant)
        return None if got is None else frozenset(got)

    def refused(self, tenant: str, tier: str) -> None:
        """A block of ``tenant`` was not put in ``tier``: outside its placement."""
        now = time.monotonic()
        if now - self._refused.get((tenant, tier), -REFUSED_AUDIT_EVERY) >= REFUSED_AUDIT_EVERY:
            self._refused[(tenant, tier)] = now
            self._audit(tenant, "placement-refused", tier=tier)

    # -- keys -----------------------------------------------------------------------------

    def _audit(self, tenant: str, op: str, **extra: Any) -> None:
        if self.tree.audit is not None:
            self.tree.audit.record(uid=0, pid=0, tenant=tenant, model="", op=op, path="",
                                   **extra)

    def _audit_key(self, *, op: str, tenant: str, **extra: Any) -> None:
        self._audit(tenant, op, **extra)  # from worker threads: a list append

    async def run(self) -> None:
        """Keys for the tenants that have none (at the mount), then every ``key_ttl`` the
        tiers' keys read again and another host's forgettings applied here."""
        if self.keyring is None:
            return
        for t in self.tree.index.tenants():
            await self.ensure(t.name.decode(errors="surrogateescape"))
        while True:
            await trio.sleep(self.keyring.ttl)
            try:
                forgotten = await trio.to_thread.run_sync(self.keyring.refresh)
            except (KeyUnavailable, TierError, OSError) as exc:
                log.warning("keys: %s", exc)
                continue
            except Exception:  # noqa: BLE001 - a background task: its end would end the mount
                log.exception("keys: refreshing failed")
                continue
            for tenant, at_ns in forgotten.items():
                if tenant in self.reports:
                    continue  # forgotten here
                removed = await self.purge(tenant, at_ns)
                log.warning("tenant %s was forgotten (by another host): %d of its blocks "
                            "removed here", tenant, removed)
                self._audit(tenant, "forgotten-elsewhere", blocks=removed)

    async def ensure(self, tenant: str) -> None:
        """``tenant`` has a key (made now where it has none); a failure is logged: its blocks
        then stay in the hot tier until a key can be had."""
        if self.keyring is None:
            return
        try:
            await trio.to_thread.run_sync(self.keyring.ensure, tenant)
        except (KeyUnavailable, OSError) as exc:
            log.error("tenant %s has no key, so none of its blocks leaves the hot tier: %s",
                      tenant, exc)
        except Exception:  # noqa: BLE001 - started by a mkdir: its end would end the mount
            log.exception("tenant %s has no key, so none of its blocks leaves the hot tier",
                          tenant)

    async def client_keys(self, node: Node, want: int | None = None) -> bytes:
        """The :data:`~kvfs.format.control.KEYS` answer for a namespace directory (the kernel
        checked that the caller may read it); ``want``: a key id the client needs."""
        if node.ns != node.inode or node.tenant == 0:
            raise FUSEError(errno.EINVAL)  # keys are a namespace's
        if self.keyring is None:
            return control.encode_keys(0, [])
        names = self.tree.names_of({node.tenant})
        tenant = names.get(node.tenant, "")
        ns = node.name.decode(errors="surrogateescape")
        keys = await trio.to_thread.run_sync(self.keyring.namespace_keys, tenant, ns, want)
        return control.encode_keys(int(self.keyring.ttl * 1000), keys)

    async def key_command(self, node: Node, name: bytes, value: bytes, ctx: Any) -> None:
        """Root's key commands on a tenant directory: rotate, retire, forget."""
        if node.inode != node.tenant:
            raise FUSEError(errno.EINVAL)
        if ctx.uid not in (0, self.tree.owner_uid):
            raise FUSEError(errno.EPERM)
        tenant = node.name.decode(errors="surrogateescape")
        if name == control.FORGET:
            await self.forget(node, ctx)
            return
        if self.keyring is None:
            raise FUSEError(errno.EOPNOTSUPP)  # no keys on this mount
        try:
            if name == control.ROTATE_KEY:
                await trio.to_thread.run_sync(self.keyring.rotate, tenant)
            else:
                key_id = int(value.decode().strip(), 16)
                await trio.to_thread.run_sync(self.keyring.retire, tenant, key_id)
        except (ValueError, UnicodeDecodeError):
            raise FUSEError(errno.EINVAL) from None
        except KeyUnavailable as exc:
            log.warning("tenant %s: %s", tenant, exc)
            raise FUSEError(errno.EINVAL) from None

    def key_state(self, node: Node) -> bytes:
        if self.keyring is None:
            return b'{"encrypt": false}'
        tenant = node.name.decode(errors="surrogateescape")
        return json.dumps(self.keyring.snapshot().get(tenant, {}), sort_keys=True).encode()

    # -- forgetting -----------------------------------------------------------------------

    async def forget(self, node: Node, ctx: Any) -> None:
        """Crypto-shred tenant ``node``: its keys destroyed everywhere (before this returns),
        then its blocks removed here and deleted from every tier (in the background)."""
        tenant = node.name.decode(errors="surrogateescape")
        if self.keyring is not None:
            report = await trio.to_thread.run_sync(self.keyring.forget, tenant)
        else:
            report = {"tenant": tenant, "keys": [], "destroyed_in": [],
                      "not_reached": ["no keys on this mount (--no-encrypt or no lower "
                                      "tier): its blocks are deleted only"]}
        report.update(started=time.time(), done=False, hot_removed=0, deleted=0,
                      not_deleted=0, errors=[])
        self.reports[tenant] = report
        self.tree.audit_op(ctx.uid, ctx.pid, node, "forget", keys=report["keys"],
                           not_reached=report["not_reached"])
        log.warning("tenant %s forgotten: keys %s destroyed in %s%s", tenant,
                    ",".join(report["keys"]) or "(none)", ", ".join(report["destroyed_in"]),
                    f"; not reached: {report['not_reached']}" if report["not_reached"] else "")
        assert self.tree.nursery is not None
        self.tree.nursery.start_soon(self._delete_all, tenant, report)

    async def _delete_all(self, tenant: str, report: dict[str, Any]) -> None:
        report["hot_removed"] = await self.purge(tenant, time.time_ns())
        if self.tiering is not None:
            for tier in self.tiering.tiers:

                def sweep(tier: Any = tier) -> None:
                    try:
                        keys = [k for k, _size in tier.list(f"{tenant}/")]
                    except (TierError, OSError) as exc:
                        report["not_deleted"] += 1
                        report["errors"].append(f"{tier.name}: cannot list: {exc}")
                        return
                    for k in keys:
                        try:
                            tier.delete(k)
                            report["deleted"] += 1
                        except (TierError, OSError) as exc:
                            report["not_deleted"] += 1
                            if len(report["errors"]) < REPORT_ERRORS:
                                report["errors"].append(f"{tier.name}: {k}: {exc}")

                await trio.to_thread.run_sync(sweep)
        report["done"] = True
        report["finished"] = time.time()
        self._audit(tenant, "forget-done", blocks=report["deleted"] + report["hot_removed"],
                    not_deleted=report["not_deleted"])

    async def purge(self, tenant: str, before_ns: int) -> int:
        """Remove the files of ``tenant`` written before ``before_ns`` from this host (its
        hot blocks, and the names of those below): the number removed. Files open now are
        left (they go at their last close, by the caller's rm)."""
        tree, index = self.tree, self.tree.index
        node = index.lookup(ROOT_INODE, tenant.encode(errors="surrogateescape"))
        if node is None:
            return 0
        removed = 0
        seen: set[int] = set()
        while True:
            batch = [n for n in index.tenant_files(node.inode, before_ns)
                     if n.inode not in seen]
            if not batch:
                return removed
            seen.update(n.inode for n in batch)
            batch = [n for n in batch if n.inode not in tree.in_use
                     and n.inode not in tree.evicting]
            hot = [n for n in batch if not n.tier]
            await self.reclaim.remove_files(hot, "forgotten")
            for n in batch:
                if n.tier and (cur := index.find(n.inode)) is not None:
                    tree.drop(cur)
                    tree.invalidate(cur)
            removed += len(batch)
            await self.reclaim.prune({n.parent for n in batch})

    def report(self, node: Node) -> bytes:
        got = self.reports.get(node.name.decode(errors="surrogateescape"))
        if got is None:
            raise FUSEError(errno.ENODATA)  # not forgotten since the mount
        return json.dumps(got, sort_keys=True).encode()

    def snapshot(self, names: set[str] | None = None) -> dict[str, Any]:
        """For stats.json: each tenant's placement and keys (``names``: only these)."""
        keys = self.keyring.snapshot() if self.keyring is not None else {}
        out = {}
        for t in self.tree.index.tenants():
            name = t.name.decode(errors="surrogateescape")
            if names is not None and name not in names:
                continue
            placement = self._placements.get(name)
            out[name] = {"placement": "all" if placement is None else ",".join(placement),
                         "keys": keys.get(name, {"live": [], "retired": [],
                                                 "forgotten": False})}
        return out
