"""Extended attributes: kvfs's own `user.kvfs.*` queries (tier, backing path, hashes, limits,
usage) and settings (pin, a tenant's limits), the control commands routed to kvfs.daemon.commands,
and every other `user.*` attribute passed through to the backing file. The names and payloads
are kvfs.format.control's.

State: the tenants' limits live in `Residency.limits` (changed here, on the event loop).
"""

from __future__ import annotations

import errno
import logging
from typing import Any

import pyfuse3
from pyfuse3 import FUSEError

from ..format import control
from .capacity import Limits
from .commands import Commands
from .governance import Governance
from .index import FIRST_REAL_INODE, ROOT_INODE, Node
from .reclaim import Reclaim
from .tree import Tree

log = logging.getLogger(__name__)

#: The limit attributes, by attribute name: the Limits field each sets.
LIMIT_XATTRS = {control.limit_name(n): n for n in Limits.names()}


class Xattrs:
    def __init__(self, tree: Tree, reclaim: Reclaim, commands: Commands,
                 governance: Governance) -> None:
        self.tree = tree
        self.governance = governance
        self.index = tree.index
        self.residency = tree.residency
        self.reclaim = reclaim
        self.commands = commands

    def tier_name(self, tier: int) -> str:
        tiering = self.tree.tiering
        if tier == 0 or tiering is None or tier > len(tiering.tiers):
            return "hot"
        return tiering.tiers[tier - 1].name

    def values(self, node: Node) -> dict[bytes, bytes]:
        """kvfs's own attributes of a node, by name."""
        tree = self.tree
        out = {control.TIER: self.tier_name(node.tier).encode()}
        if node.inode != ROOT_INODE:
            out[control.BACKING] = tree.store.path(tree.path(node))
        if node.is_dir and node.inode != ROOT_INODE:
            out[control.CODEC] = tree.info.hot_codec.encode()
            if tree.info.hot_encrypt:
                out[control.SEAL] = b"1"
        if node.is_dir and tree.tiering is not None:
            out[control.TIERS] = ",".join(t.name for t in tree.tiering.tiers).encode()
        if node.block_hash is not None:
            out[control.BLOCK_HASH] = node.block_hash.hex().encode()
            out[control.PARENT_HASH] = (node.parent_hash or b"").hex().encode()
        if node.pinned:
            out[control.PIN] = b"1"
        if node.inode == node.tenant:
            limits = self.residency.limits.get(node.inode, Limits())
            for xname, name in LIMIT_XATTRS.items():
                out[xname] = limits.render(name).encode()
            out[control.USED] = str(tree.stats.tenant_bytes(node.inode)).encode()
        return out

    async def get(self, inode: int, name: bytes, ctx: Any = None) -> bytes:
        if not name.startswith(b"user."):
            # Only the user namespace exists here (as setxattr says): ENOTSUP, not ENODATA,
            # tells tools such as `ls -l` that asking this file system again is pointless.
            raise FUSEError(errno.ENOTSUP)
        if inode < FIRST_REAL_INODE and inode != ROOT_INODE:
            raise FUSEError(pyfuse3.ENOATTR)
        node = self.index.get(inode)
        if name.startswith(control.GRANT_REPLY) and ctx is not None and node.is_dir:
            return self.commands.grants.reply(node, name, ctx.uid)
        if name.startswith(control.KEYS) and node.is_dir:
            want = control.wanted_key(name)
            if want is not None or name == control.KEYS:
                return await self.governance.client_keys(node, want if want != -1 else None)
        if name == control.FORGET and node.inode == node.tenant:
            return self.governance.report(node)
        if name == control.KEY_STATE and node.inode == node.tenant:
            return self.governance.key_state(node)
        if name.startswith(control.XATTR_PREFIX):
            value = self.values(node).get(name)
            if value is None:
                raise FUSEError(pyfuse3.ENOATTR)
            return value
        return await self.tree.io(self.tree.store.getxattr, self.tree.path(node), name,
                                  tenant=node.tenant)

    async def names(self, inode: int) -> list[bytes]:
        if inode < FIRST_REAL_INODE and inode != ROOT_INODE:
            return []
        node = self.index.get(inode)
        names = list(self.values(node))
        if node.inode != ROOT_INODE:
            names += await self.tree.io(self.tree.store.listxattr, self.tree.path(node),
                                        tenant=node.tenant)
        return names

    async def set(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        if inode < FIRST_REAL_INODE or not name.startswith(b"user."):
            raise FUSEError(errno.ENOTSUP if inode >= FIRST_REAL_INODE else errno.EPERM)
        node = self.index.get(inode)
        tree = self.tree
        if name in control.COMMANDS:
            await self.commands.run(node, name, value, ctx)
        elif name in (control.FORGET, control.ROTATE_KEY, control.RETIRE_KEY):
            await self.governance.key_command(node, name, value, ctx)
            if name != control.FORGET:
                tree.audit_op(ctx.uid, ctx.pid, node, name.decode()[len("user.kvfs."):],
                              value=value.decode(errors="replace"))
        elif name == control.PIN:
            pinned = value.strip() not in (b"0", b"", b"false", b"no")
            await self.pin(node, pinned)
            tree.audit_op(ctx.uid, ctx.pid, node, "pin" if pinned else "unpin")
        elif name in LIMIT_XATTRS:
            await self.set_limit(node, LIMIT_XATTRS[name], value, ctx)
            tree.audit_op(ctx.uid, ctx.pid, node, "limit", limit=LIMIT_XATTRS[name],
                          value=value.decode(errors="replace"))
        elif name.startswith(control.XATTR_PREFIX):
            raise FUSEError(errno.EPERM)  # kvfs's own attributes are read-only
        else:
            await tree.io(tree.store.setxattr, tree.path(node), name, value, tenant=node.tenant)

    async def remove(self, inode: int, name: bytes, ctx: Any) -> None:
        if inode < FIRST_REAL_INODE or not name.startswith(b"user."):
            raise FUSEError(errno.ENOTSUP if inode >= FIRST_REAL_INODE else errno.EPERM)
        node = self.index.get(inode)
        if name == control.PIN:
            await self.pin(node, False)
        elif name in LIMIT_XATTRS:
            await self.set_limit(node, LIMIT_XATTRS[name], b"none", ctx)
        elif name.startswith(control.XATTR_PREFIX):
            raise FUSEError(errno.EPERM)
        else:
            await self.tree.io(self.tree.store.removexattr, self.tree.path(node), name,
                               tenant=node.tenant)

    async def pin(self, node: Node, pinned: bool) -> None:
        """Pin (never evict nor expire) or unpin a file. The kernel has checked that the
        caller may write the file."""
        if not node.is_reg or node.tenant == 0:
            raise FUSEError(errno.EINVAL)
        await self.tree.io(self.tree.store.set_pin, self.tree.path(node), pinned,
                           tenant=node.tenant)
        node = self.index.get(node.inode)
        self.index.update(node.inode, pinned=int(pinned))
        self.residency.pin(node, pinned)

    async def set_limit(self, node: Node, name: str, value: bytes, ctx: Any) -> None:
        """Set a tenant's limit: only root (or the mount's owner), never the tenant itself."""
        if node.inode != node.tenant:
            raise FUSEError(errno.EINVAL)  # limits live on tenant directories
        if ctx.uid not in (0, self.tree.owner_uid):
            raise FUSEError(errno.EPERM)
        try:
            parsed = Limits.parse(name, value.decode())
            if name == "placement" and parsed is not None:
                known = self.governance.tier_names()
                if unknown := set(parsed) - known:
                    raise ValueError(f"no tier {', '.join(sorted(unknown))} on this mount "
                                     f"(its tiers: {', '.join(sorted(known))})")
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning("refused %s=%r on tenant %s: %s", name, value, node.name, exc)
            raise FUSEError(errno.EINVAL) from None
        limits = self.residency.limits.setdefault(node.inode, Limits())
        text = None if parsed is None else Limits(**{name: parsed}).render(name)
        await self.tree.io(self.tree.store.write_limit, node.name, name, text)
        setattr(limits, name, parsed)
        if name == "quota":
            self.reclaim.before_room()  # the request thread's grant, granted without it, back
        if name == "placement":
            self.governance.set_placement(node.name.decode(errors="surrogateescape"), parsed)
        log.info("tenant %s: %s = %s", node.name.decode(errors="replace"), name, text or "none")
        if name == "quota" and limits.quota is not None:
            over = max(0, self.tree.stats.tenant_bytes(node.inode) - limits.quota)
            if over:
                await self.reclaim.evict(over, node.inode)
        elif name in ("max_idle", "max_age"):
            await self.reclaim.expire()
