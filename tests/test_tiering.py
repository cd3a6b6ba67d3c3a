"""Lower tiers through a real mount: demotion, promotion, hosts sharing a tier."""

from __future__ import annotations

import os
import time

import pytest

from kvfs.format import blockfile, hashing

from .conftest import kvfs


def block(i: int, size: int = 60 * 1024) -> tuple[bytes, bytes]:
    h = hashing.block_hashes([i] * 16, 16)[0]
    payload = os.urandom(size)
    return h, blockfile.encode(block_hash=h, parent_hash=hashing.ROOT_PARENT,
                               fingerprint=bytes(16), token_count=16, dtype="uint8",
                               shape=(size,), payload=payload)


def put(ns, h: bytes, data: bytes) -> None:
    p = ns / hashing.block_relpath(h)
    p.parent.mkdir(exist_ok=True)
    tmp = p.parent / ".tmp"
    tmp.write_bytes(data)
    os.replace(tmp, p)


def setup(m):
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    ns = m.mnt / "t" / "m@0123456789abcdef"
    ns.mkdir()
    return ns


def over_capacity(mount_factory, *tier: str):
    """A mount of 400 KiB with a lower tier (``tier``: its options), its namespace, and
    12 blocks of 64 KiB for it: three times the capacity."""
    m = mount_factory(extra=["--capacity", "400K", *tier])
    return m, setup(m), [block(i) for i in range(12)]


def test_eviction_demotes_and_reads_promote(mount_factory, tmp_path):
    cold = tmp_path / "cold"
    m, ns, blocks = over_capacity(mount_factory, "--cold", f"dir://{cold}")
    for h, d in blocks:
        put(ns, h, d)
    assert m.stats()["used_bytes"] <= 400 * 1024
    first = ns / hashing.block_relpath(blocks[0][0])
    assert os.getxattr(first, "user.kvfs.tier") == b"cold"
    assert m.stats()["tiers"][0]["known_files"] >= 6  # what this host demoted
    assert "holds" in kvfs("status", str(m.mnt)).stdout
    assert os.stat(first).st_size == len(blocks[0][1]) and os.stat(first).st_blocks == 0
    assert (cold / "t" / "m@0123456789abcdef" / hashing.block_relpath(blocks[0][0])).exists()
    # Reading a demoted block promotes it: the same bytes, hot again.
    for h, d in blocks:
        assert (ns / hashing.block_relpath(h)).read_bytes() == d
    assert os.getxattr(first, "user.kvfs.tier") in (b"hot", b"cold")
    st = m.stats()
    c = st["tenants"]["t"]["m@0123456789abcdef"]
    assert c["demotions"] >= 8 and c["promotions"] >= 8
    assert st["used_bytes"] <= 400 * 1024
    assert st["tiers"][0]["name"] == "cold" and st["tiers"][0]["hits"] >= 8
    # A corrupt copy in the lower tier is never served.
    m.restart()  # (the kernel forgets cached pages)
    cold_ones = [h for h, _ in blocks
                 if os.getxattr(ns / hashing.block_relpath(h), "user.kvfs.tier") == b"cold"]
    assert cold_ones
    cpath = cold / "t" / "m@0123456789abcdef" / hashing.block_relpath(cold_ones[0])
    raw = bytearray(cpath.read_bytes())
    raw[5000] ^= 0xFF
    cpath.write_bytes(bytes(raw))
    with pytest.raises(FileNotFoundError):
        (ns / hashing.block_relpath(cold_ones[0])).read_bytes()
    assert m.stats()["tiers"][0]["bad_blocks"] == 1


def test_two_hosts_share_a_tier(mount_factory, tmp_path):
    shared = tmp_path / "shared"
    a = mount_factory("a", extra=["--shared", f"dir://{shared}"])
    b = mount_factory("b", extra=["--shared", f"dir://{shared}"])
    ns_a, ns_b = setup(a), setup(b)
    blocks = [block(i) for i in range(5)]
    for h, d in blocks:
        put(ns_a, h, d)
    key = f"t/m@0123456789abcdef/{hashing.block_relpath(blocks[-1][0])}"
    deadline = time.monotonic() + 10
    while not (shared / key).exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # write-through is asynchronous
    time.sleep(0.2)
    for h, d in blocks:  # host B has never seen these: a miss there, a hit from the tier
        assert (ns_b / hashing.block_relpath(h)).read_bytes() == d
    assert b.stats()["tiers"][0]["hits"] == 5
    missing = hashing.block_hashes([999] * 16, 16)[0]
    assert not (ns_b / hashing.block_relpath(missing)).exists()


def test_eviction_of_a_published_block_is_a_demotion(mount_factory, tmp_path):
    """A block that write-through already put into the shared tier is there when eviction
    demotes it: a demotion (its name stays, read back from the tier), not a failure that
    counts against the tier's circuit and drops the name."""
    shared = tmp_path / "shared"
    m, ns, blocks = over_capacity(mount_factory, "--shared", f"dir://{shared}")
    for h, d in blocks:
        put(ns, h, d)
        key = shared / "t" / "m@0123456789abcdef" / hashing.block_relpath(h)
        deadline = time.monotonic() + 10
        while not key.exists() and time.monotonic() < deadline:
            time.sleep(0.02)  # published before the next save evicts anything
        assert key.exists()
    tier = m.stats()["tiers"][0]
    assert tier["demotions"] >= 6, tier
    assert tier["demotion_failures"] == 0 and tier["circuit"] == "closed", tier
    first = ns / hashing.block_relpath(blocks[0][0])
    assert os.getxattr(first, "user.kvfs.tier") == b"shared"
    for h, d in blocks:  # every name is still there and reads its block
        assert (ns / hashing.block_relpath(h)).read_bytes() == d
    assert m.stats()["tiers"][0]["demotion_failures"] == 0


def test_client_on_another_host_loads_from_the_shared_tier(mount_factory, tmp_path):
    torch = pytest.importorskip("torch")
    import kvfs as kv

    _a, b, _shared, spec, hashes, kv_in = _saved_on_a(mount_factory, tmp_path, 6)
    with kv.KVCache.open(b.mnt, tenant="t", spec=spec) as cb:
        assert cb.tiers == ["shared"]
        calls = cb.stats["control_calls"]
        assert cb.lookup(hashes) == 6
        # One grant (its access record goes with the load that follows).
        assert cb.stats["control_calls"] - calls == 1
        out = torch.zeros_like(kv_in)
        assert cb.load(hashes, out) == 6
        assert torch.equal(out, kv_in)
        # One pass: the daemon handed the tier's files over (kvfs.daemon.handout) and fetched
        # none of them; the load read them and wrote the hot copies behind.
        assert cb.stats["remote_blocks"] == 6
    tier = b.stats()["tiers"][0]
    assert tier["grants"] == 6 and tier["hits"] == 0 and tier["fetched_bytes"] == 0
    ns_b = b.mnt / "t" / spec.namespace
    for h in hashes:
        assert os.getxattr(ns_b / hashing.block_relpath(h), "user.kvfs.tier") == b"hot"
    assert b.stats()["tenants"]["t"][spec.namespace]["promotions"] == 6
    with kv.KVCache.open(b.mnt, tenant="t", spec=spec) as cb:
        calls = cb.stats["control_calls"]
        assert cb.lookup(hashes) == 6 and cb.stats["control_calls"] == calls  # all hot
        out = torch.zeros_like(kv_in)
        assert cb.load(hashes, out) == 6 and torch.equal(out, kv_in)
    assert b.stats()["tiers"][0]["grants"] == 6


def test_kvfs_warm_promotes_a_namespace(mount_factory, tmp_path):
    cold = tmp_path / "cold"
    m = mount_factory(extra=["--capacity", "2M", "--cold", f"dir://{cold}"])
    ns = setup(m)
    blocks = [block(i) for i in range(40)]  # 2.5 MiB: some are demoted
    for h, d in blocks:
        put(ns, h, d)
    assert any(os.getxattr(ns / hashing.block_relpath(h), "user.kvfs.tier") == b"cold"
               for h, _ in blocks)
    kvfs("tenant", "set", str(m.mnt), "t", "--quota", "none")
    nsrel = ns.relative_to(m.mnt)
    m.stop()
    # Counted once the daemon is gone: background eviction may demote more after the puts.
    cold_before = [h for h, _ in blocks
                   if not (m.backing / nsrel / hashing.block_relpath(h)).exists()]
    assert cold_before
    m.extra = ["--capacity", "8M", "--cold", f"dir://{cold}"]
    m.start()
    res = kvfs("warm", str(ns))
    assert f"warmed {len(cold_before)} blocks" in res.stdout
    assert all(os.getxattr(ns / hashing.block_relpath(h), "user.kvfs.tier") == b"hot"
               for h, _ in blocks)


def test_a_fetch_past_its_deadline_never_leaves_a_block_behind(tmp_path):
    """In-process: a tier that answers after the deadline. The fetch is a miss, and the late
    answer is not renamed into the hot tier behind the daemon's back."""
    import trio

    from kvfs.daemon.tiers import DirTier
    from kvfs.daemon.tiers.mover import Tiering

    class LateTier(DirTier):
        def read(self, key, limit):
            found = super().read(key, limit)
            time.sleep(0.4)
            return found

    h, data = block(1)
    key = f"t/ns/{hashing.block_relpath(h)}"
    (tmp_path / "cold" / "t" / "ns" / h[:1].hex()).mkdir(parents=True)
    (tmp_path / "cold" / key).write_bytes(data)
    final = tmp_path / "hot" / hashing.block_relpath(h)
    final.parent.mkdir(parents=True)

    async def main():
        tiering = Tiering([LateTier(str(tmp_path / "cold"))], trio.CapacityLimiter(4),
                          fetch_timeout=0.1)
        assert await tiering.fetch(key, str(final), (0, 0, 0o644)) is None
        await trio.sleep(0.8)  # the late thread has finished by now
        assert tiering.counters[0].timeouts == 1
        assert list(final.parent.iterdir()) == []  # neither the block nor a temporary
        tiering.fetch_timeout = 5.0
        got = await tiering.fetch(key, str(final), (0, 0, 0o644))
        assert got is not None and got.header.block_hash == h

    trio.run(main)
    assert final.read_bytes() == data
    assert [p.name for p in final.parent.iterdir()] == [final.name]  # no temporaries left



def test_concurrent_fetches_of_one_block_share_one_fetch(tmp_path):
    import trio

    from kvfs.daemon.tiers import DirTier
    from kvfs.daemon.tiers.mover import Tiering

    calls = []

    class CountingTier(DirTier):
        def read(self, key, limit):
            calls.append(key)
            time.sleep(0.2)
            return super().read(key, limit)

    h, data = block(3)
    key = f"t/ns/{hashing.block_relpath(h)}"
    (tmp_path / "cold" / "t" / "ns" / h[:1].hex()).mkdir(parents=True)
    (tmp_path / "cold" / key).write_bytes(data)
    final = tmp_path / "hot" / hashing.block_relpath(h)
    final.parent.mkdir(parents=True)
    results = []

    async def main():
        tiering = Tiering([CountingTier(str(tmp_path / "cold"))], trio.CapacityLimiter(4),
                          fetch_timeout=5.0)

        async def one():
            results.append(await tiering.fetch(key, str(final), (0, 0, 0o644)))

        async with trio.open_nursery() as n:
            for _ in range(8):
                n.start_soon(one)

    trio.run(main)
    assert calls == [key]
    assert len(results) == 8 and all(r is not None and r.header.block_hash == h for r in results)


def test_a_dead_tier_costs_one_deadline_not_one_per_batch(tmp_path):
    """In-process: more fetches at once than there are tier threads, on a tier that never
    answers. The first batch times out and opens the circuit; the fetches that were waiting
    for a thread are then skipped, not made (each would cost another deadline)."""
    import threading

    import trio

    from kvfs.daemon.tiers import DirTier
    from kvfs.daemon.tiers.mover import Tiering

    release = threading.Event()
    calls = []

    class DeadTier(DirTier):
        def read(self, key, limit):
            calls.append(key)
            release.wait(10)
            return None

    hot = tmp_path / "hot"
    hot.mkdir()
    results = []

    async def main():
        tiering = Tiering([DeadTier(str(tmp_path / "cold"))], trio.CapacityLimiter(4),
                          fetch_timeout=0.2, breaker_cooldown=60)

        async def one(i):
            h = hashing.block_hashes([i] * 16, 16)[0]
            results.append(await tiering.fetch(f"t/ns/{hashing.block_relpath(h)}",
                                               str(hot / f"{i}.kv"), (0, 0, 0o644)))

        async with trio.open_nursery() as n:
            for i in range(16):
                n.start_soon(one, i)
        return tiering

    try:
        tiering = trio.run(main)
    finally:
        release.set()
    c = tiering.counters[0]
    assert results == [None] * 16
    assert len(calls) == 4 and c.timeouts == 4 and c.skipped == 12
    assert tiering.breakers[0].state == "open"
    # With every circuit open, the mount does not even try: lookups miss at once.
    assert not tiering.reachable()
    tiering.breakers[0].success()
    assert tiering.reachable()


def test_an_adopted_tree_fetches_from_its_tier(mount_factory, tmp_path):
    """A first mount over a tree no index has seen, with a shared tier: a block the tree lacks
    in a directory not indexed yet is fetched from the tier (the directory is indexed first,
    as for any change); the blocks the tree has are served from it."""
    shared = tmp_path / "shared"
    m = mount_factory(extra=["--shared", f"dir://{shared}"], start=False)
    local = [block(i) for i in range(6)]
    remote = [block(i) for i in range(100, 140)]
    fan = {h[:1] for h, _ in local}
    remote = [(h, d) for h, d in remote if h[:1] in fan][:3]  # the same fan-out directories
    assert remote
    ns_rel = "t/m@0123456789abcdef"
    (m.backing / ns_rel).mkdir(parents=True)
    for h, d in local:
        put(m.backing / ns_rel, h, d)
    for h, d in remote:
        p = shared / ns_rel / hashing.block_relpath(h)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(d)
    m.start()
    ns = m.mnt / ns_rel
    for h, d in remote + local:
        assert (ns / hashing.block_relpath(h)).read_bytes() == d
    deadline = time.monotonic() + 30
    while m.stats()["indexing"]["directories_left"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    c = m.stats()["tenants"]["t"]["m@0123456789abcdef"]
    assert c["files"] == len(local) + len(remote) and c["promotions"] == len(remote)
    m.stop()
    res = kvfs("fsck", str(m.backing))
    assert " 0 added, 0 dropped, 0 updated" in res.stdout, res.stdout


def _spec():
    import kvfs as kv

    return kv.ModelSpec(model="org/m", revision="r", kv_dtype="float16", block_size=16,
                        num_layers=2, num_kv_heads=2, head_dim=32)


def _saved_on_a(mount_factory, tmp_path, n: int):
    """Hosts a and b sharing a directory tier, n blocks saved on a and written through:
    (a, b, the shared directory, the spec, the hashes, the KV saved)."""
    import torch

    import kvfs as kv

    shared = tmp_path / "shared"
    a = mount_factory("a", extra=["--shared", f"dir://{shared}"])
    b = mount_factory("b", extra=["--shared", f"dir://{shared}"])
    for m in (a, b):
        kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    spec = _spec()
    kv_in = torch.randn(n, *spec.block_shape).to(torch.float16)
    with kv.KVCache.open(a.mnt, tenant="t", spec=spec) as ca:
        hashes = ca.block_hashes(list(range(16 * n)))
        assert ca.save(hashes, kv_in) == n
    last = shared / "t" / spec.namespace / hashing.block_relpath(hashes[-1])
    deadline = time.monotonic() + 10
    while not last.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return a, b, shared, spec, hashes, kv_in


def test_the_handout_gives_a_grants_files_to_its_asker_alone_once(mount_factory, tmp_path):
    """The daemon is the authority over a directory tier's files: the handout socket gives
    a grant's files to the uid that sent it, once, within its answer's TTL; a nonce never
    granted gets nothing; the descriptors are read-only and reach those files alone."""
    pytest.importorskip("torch")
    import kvfs as kv
    from kvfs.client import handout
    from kvfs.format import control

    from .conftest import in_child

    _a, b, shared, spec, hashes, _kv_in = _saved_on_a(mount_factory, tmp_path, 3)
    kv.KVCache.open(b.mnt, tenant="t", spec=spec).close()
    ns_b = str(b.mnt / "t" / spec.namespace)
    sock = control.socket_path(b.backing)
    assert os.stat(sock).st_mode & 0o777 == 0o666
    nonce = os.urandom(16)
    os.setxattr(ns_b, control.GRANT,
                control.pack_grant(nonce, hashes, flags=control.GRANT_TAKES_FDS))
    got = control.unpack_grant_reply(os.getxattr(ns_b, control.GRANT_REPLY
                                                 + nonce.hex().encode()))
    assert [g.kind for g in got] == [control.GRANT_FD] * 3
    # Another uid asking with the same nonce is handed nothing (and takes nothing away).
    assert in_child(1001, 1001, lambda: handout.collect(sock, nonce, {0})) == []
    # A nonce never granted: nothing.
    assert handout.collect(sock, os.urandom(16), {0}) == []
    # A peer that is not the daemon's uid is not trusted.
    assert handout.collect(sock, nonce, {4242}) is None
    fds = handout.collect(sock, nonce, {0})
    assert fds is not None and len(fds) == 3
    try:
        for h, fd in zip(hashes, fds, strict=True):
            assert os.fstat(fd).st_ino == os.stat(
                shared / "t" / spec.namespace / hashing.block_relpath(h)).st_ino
            with pytest.raises(OSError):
                os.write(fd, b"x")  # read-only
    finally:
        for fd in fds:
            os.close(fd)
    assert handout.collect(sock, nonce, {0}) == []  # once
    # A client that takes no descriptors gets the blocks promoted, hot, as before.
    nonce = os.urandom(16)
    os.setxattr(ns_b, control.GRANT, control.pack_grant(nonce, hashes[:1]))
    got = control.unpack_grant_reply(os.getxattr(ns_b, control.GRANT_REPLY
                                                 + nonce.hex().encode()))
    assert [g.kind for g in got] == [control.GRANT_HOT]
    # The socket is the daemon's alone: it goes with the mount, and fsck ignores it.
    assert ".kvfs.sock" not in kvfs("fsck", str(b.backing), check=False).stdout


def test_blocks_demoted_here_come_back_in_one_pass(mount_factory, tmp_path):
    """Blocks this host demoted to its cold tier (known to its index, not hot) are
    restored by the client from the files the daemon hands over, and the hot copies it
    writes behind make them hot again in the index (counted, within the capacity); a
    corrupt cold file is a miss, reported, never served."""
    torch = pytest.importorskip("torch")
    import kvfs as kv

    cold = tmp_path / "cold"
    spec = _spec()
    per = blockfile.HEADER_SIZE + spec.block_payload_bytes
    m = mount_factory(extra=["--capacity", str(per * 6), "--cold", f"dir://{cold}"])
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    kv_in = torch.randn(12, *spec.block_shape).to(torch.float16)
    with kv.KVCache.open(m.mnt, tenant="t", spec=spec) as c:
        hashes = c.block_hashes(list(range(16 * 12)))
        for i in range(12):
            c.save(hashes[i:i + 1], kv_in[i:i + 1], parent=hashes[i - 1] if i else None)
    ns = m.mnt / "t" / spec.namespace
    tiers = [os.getxattr(ns / hashing.block_relpath(h), "user.kvfs.tier") for h in hashes]
    assert tiers[:4] == [b"cold"] * 4, tiers
    before = m.stats()["tenants"]["t"][spec.namespace]["promotions"]
    with kv.KVCache.open(m.mnt, tenant="t", spec=spec) as c:
        assert c.lookup(hashes[:4]) == 4
        out = torch.zeros(4, *spec.block_shape, dtype=torch.float16)
        assert c.load(hashes[:4], out) == 4 and torch.equal(out, kv_in[:4])
        assert c.stats["remote_blocks"] == 4
    st = m.stats()
    assert st["tiers"][0]["hits"] == 0  # the daemon fetched none of them
    assert st["tenants"]["t"][spec.namespace]["promotions"] - before == 4
    assert st["used_bytes"] <= per * 6
    hot = [h for h in hashes[:4]
           if os.getxattr(ns / hashing.block_relpath(h), "user.kvfs.tier") == b"hot"]
    assert hot, "the hot copies written behind were not indexed"
    for h in hot:
        assert os.stat(ns / hashing.block_relpath(h)).st_blocks > 0
    # A corrupt file in the cold tier: a miss, reported, never served.
    cold_ones = [i for i, h in enumerate(hashes)
                 if os.getxattr(ns / hashing.block_relpath(h), "user.kvfs.tier") == b"cold"]
    assert cold_ones
    i = cold_ones[0]
    cpath = cold / "t" / spec.namespace / hashing.block_relpath(hashes[i])
    raw = bytearray(cpath.read_bytes())
    raw[blockfile.HEADER_SIZE + 10] ^= 0xFF
    cpath.write_bytes(bytes(raw))
    with kv.KVCache.open(m.mnt, tenant="t", spec=spec) as c:
        c.lookup(hashes[i:i + 1])
        out = torch.zeros(1, *spec.block_shape, dtype=torch.float16)
        assert c.load(hashes[i:i + 1], out) == 0 and not out.any()
        assert c.stats["corrupt_blocks"] == 1


def kv_block(i: int, n: int = 30 * 1024) -> tuple[bytes, bytes]:
    """A block of bfloat16 values drawn like KV (what the lower tiers' codec shrinks)."""
    import random
    from array import array

    rng = random.Random(i)
    f32 = array("f", [rng.gauss(0, 1) for _ in range(n)])
    payload = array("H", f32.tobytes())[1::2].tobytes()
    h = hashing.block_hashes([i] * 16, 16)[0]
    return h, blockfile.encode(block_hash=h, parent_hash=hashing.ROOT_PARENT,
                               fingerprint=bytes(16), token_count=16, dtype="bfloat16",
                               shape=(n,), payload=payload)


@pytest.mark.parametrize("tier_codec", ["planes", "none"])
def test_blocks_below_are_stored_encoded(mount_factory, tmp_path, tier_codec):
    """Demoted blocks are stored encoded in the cold tier (lossless, the default; as saved
    with --tier-codec none); reads bring back the very bytes saved, and the tier and the
    namespace show the ratio."""
    from kvfs.format import codec

    cold = tmp_path / "cold"
    m = mount_factory(extra=["--capacity", "200K", "--cold", f"dir://{cold}",
                             "--tier-codec", tier_codec])
    ns = setup(m)
    blocks = [kv_block(i) for i in range(10)]  # 10 x 64 KiB: three times the capacity
    for h, d in blocks:
        put(ns, h, d)
    below = [cold / "t" / "m@0123456789abcdef" / hashing.block_relpath(h) for h, _ in blocks]
    stored = {p: p.read_bytes() for p in below if p.exists()}
    assert len(stored) >= 6
    encoding = tier_codec == "planes" and codec.available()
    for data in stored.values():  # sealed (encryption at rest, the default), encoded first
        e = blockfile.decode_header(data).encoding
        assert e is not None and e.seal is not None
        assert (e.codec == blockfile.CODEC_PLANES) == encoding
    for h, d in blocks:  # promoted back: the same bytes, the hot copy as saved
        assert (ns / hashing.block_relpath(h)).read_bytes() == d
    st = m.stats()
    t = st["tiers"][0]
    assert t["codec"] == ("planes" if encoding else "none")
    stored = {p: p.read_bytes() for p in below if p.exists()}  # the reads demoted more
    assert t["put_raw_bytes"] == len(stored) * len(blocks[0][1])
    assert t["put_stored_bytes"] == sum(len(x) for x in stored.values())
    c = st["tenants"]["t"]["m@0123456789abcdef"]
    if encoding:
        assert t["ratio"] > 1.2 and c["below_ratio"] == t["ratio"]
        assert t["fetched_bytes"] < t["hits"] * len(blocks[0][1])  # stored bytes moved
        assert f"codec planes ({t['ratio']}x)" in kvfs("status", str(m.mnt)).stdout
    else:
        assert t["ratio"] == 1.0
