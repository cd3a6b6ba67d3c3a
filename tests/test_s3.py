"""Several hosts share one real S3 bucket (SeaweedFS on loopback) through their mounts."""

from __future__ import annotations

import os
import time

import pytest

from .conftest import in_child, kvfs
from .s3server import s3  # noqa: F401 - the fixture

torch = pytest.importorskip("torch")

import kvfs as kv  # noqa: E402
from kvfs.format import codec, hashing  # noqa: E402

SPEC = kv.ModelSpec(model="org/shared", revision="r", kv_dtype="float16", block_size=16,
                    num_layers=2, num_kv_heads=2, head_dim=64)


def mounts(mount_factory, s3):  # noqa: F811
    extra = ["--shared", s3.url, "--fetch-timeout", "2", "--tier-cooldown", "1"]
    hosts = [mount_factory(name, extra=extra) for name in ("a", "b")]
    for m in hosts:
        kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
    return hosts


def save(m, tokens):
    kv_in = torch.randn(len(tokens) // 16, *SPEC.block_shape).to(torch.float16)
    with kv.KVCache.open(m.mnt, tenant="t", spec=SPEC) as c:
        hashes = c.block_hashes(tokens)
        c.save(hashes, kv_in)
    return hashes, kv_in


def wait_uploaded(s3, hashes):  # noqa: F811
    client = s3.client()
    keys = [f"t/{SPEC.namespace}/{hashing.block_relpath(h)}" for h in hashes]
    deadline = time.monotonic() + 20
    for key in keys:
        while True:
            objs = client.list_objects_v2(Bucket=s3.bucket).get("Contents", [])
            if any(o["Key"].endswith(key) for o in objs):
                break
            assert time.monotonic() < deadline, f"{key} never reached the bucket"
            time.sleep(0.1)


def load(m, hashes, like, stats=None):
    with kv.KVCache.open(m.mnt, tenant="t", spec=SPEC) as c:
        start = time.monotonic()
        n = c.lookup(hashes)
        out = torch.zeros_like(like)
        got = c.load(hashes[:n], out)
        seconds = time.monotonic() - start
        c.flush()
        if stats is not None:
            stats.update(c.stats)
        return got, out, seconds


def test_a_context_saved_on_one_host_loads_on_another(mount_factory, s3):  # noqa: F811
    a, b = mounts(mount_factory, s3)
    hashes, kv_in = save(a, list(range(16 * 8)))
    wait_uploaded(s3, hashes)
    client: dict = {}
    got, out, _ = load(b, hashes, kv_in, client)
    assert got == 8 and torch.equal(out, kv_in)
    # One pass: host b's client read each object itself with the URL its daemon granted;
    # the daemon moved no byte (no fetch), and the hot copies were written behind.
    assert client["remote_blocks"] == 8 and client["behind_blocks"] == 8
    st = b.stats()
    tier = st["tiers"][0]
    assert tier["name"] == "shared" and tier["grants"] == 8 and tier["hits"] == 0
    assert tier["uploads"] == 0  # the hot copies are not sent back to the tier they came from
    assert st["tenants"]["t"][SPEC.namespace]["promotions"] == 8
    ns_b = b.mnt / "t" / SPEC.namespace
    assert all(os.getxattr(ns_b / hashing.block_relpath(h), "user.kvfs.tier") == b"hot"
               for h in hashes)
    # (These float16 blocks are stored as saved: encoded, they would not take a page less.)
    assert a.stats()["tiers"][0]["ratio"] == 1.0
    again: dict = {}
    got, out, _ = load(b, hashes, kv_in, again)  # now from b's hot tier
    assert got == 8 and torch.equal(out, kv_in) and again["remote_blocks"] == 0
    assert b.stats()["tiers"][0]["grants"] == 8


def test_a_dead_store_costs_misses_within_the_deadline(mount_factory, s3):  # noqa: F811
    a, b = mounts(mount_factory, s3)
    warm, warm_kv = save(a, list(range(16 * 2)))
    cold, cold_kv = save(a, list(range(1000, 1000 + 16 * 6)))
    wait_uploaded(s3, warm + cold)
    assert load(b, warm, warm_kv)[0] == 2  # now hot on b
    s3.stop()
    got, _, seconds = load(b, cold, cold_kv)
    assert got == 0
    assert seconds < 15, f"a dead store held a lookup for {seconds:.1f} s"
    got, out, _ = load(b, warm, warm_kv)  # the hot tier keeps serving
    assert got == 2 and torch.equal(out, warm_kv)
    # The client's failed GETs are left to b's daemon (a prefetch): its own fetches fail,
    # and are counted, in the background.
    deadline = time.monotonic() + 10
    while True:
        tier = b.stats()["tiers"][0]
        if tier["errors"] + tier["timeouts"] + tier["skipped"] >= 1:
            break
        assert time.monotonic() < deadline, tier
        time.sleep(0.1)
    s3.start()
    time.sleep(1.5)  # the circuit's cooldown
    deadline = time.monotonic() + 20
    while True:
        got, out, _ = load(b, cold, cold_kv)
        if got == 6 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got == 6 and torch.equal(out, cold_kv)


def test_a_lookup_budget_bounds_a_slow_store(mount_factory, s3):  # noqa: F811
    """Host b reads the bucket through a proxy that holds every response 3 s. A lookup
    with a 0.3 s budget comes back in well under the store's latency, with misses; the
    fetches go on in the background and the next lookup finds every block hot."""
    from kvfs.bench.harness import FaultProxy

    host, _, port = s3.endpoint.rpartition(":")
    proxy = FaultProxy(("127.0.0.1", int(port)), latency=3.0)
    try:
        a = mount_factory("a", extra=["--shared", s3.url])
        slow_url = s3.url.replace(s3.endpoint, f"{host}:{proxy.port}")
        b = mount_factory("b", extra=["--shared", slow_url, "--fetch-timeout", "20"])
        for m in (a, b):
            kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")
        hashes, kv_in = save(a, list(range(16 * 4)))
        wait_uploaded(s3, hashes)
        with kv.KVCache.open(b.mnt, tenant="t", spec=SPEC) as c:
            start = time.monotonic()
            n = c.lookup(hashes, budget=0.3)
            took = time.monotonic() - start
            assert n == 0 and took < 2.0, (n, took)
            deadline = time.monotonic() + 30
            while c.lookup(hashes, budget=0) < 4:
                assert time.monotonic() < deadline, "the background fetches never landed"
                time.sleep(0.2)
            out = torch.zeros_like(kv_in)
            assert c.load(hashes, out) == 4 and torch.equal(out, kv_in)
        assert b.stats()["tenants"]["t"][SPEC.namespace]["promotions"] == 4
    finally:
        proxy.close()


def test_a_grant_reaches_one_object_for_its_asker_alone(mount_factory, s3):  # noqa: F811
    """The daemon is the authority over what a client may read from the shared tier: a
    grant's answer is for the uid that asked, on the directory it asked on; its URL reads
    that one object (another key with the same signature is refused by the store); a
    corrupt object fetched with it is a miss, never served, and gets no hot copy."""
    import urllib.error
    import urllib.request
    from urllib.parse import quote

    from kvfs.format import control

    a, b = mounts(mount_factory, s3)
    kvfs("tenant", "add", str(b.mnt), "u", "--uid", "1001", "--gid", "1001")
    hashes, kv_in = save(a, list(range(16 * 4)))
    wait_uploaded(s3, hashes)
    kv.KVCache.open(b.mnt, tenant="t", spec=SPEC).close()  # the namespace, on b
    ns_b = str(b.mnt / "t" / SPEC.namespace)
    nonce = os.urandom(16)
    os.setxattr(ns_b, control.GRANT, control.pack_grant(nonce, hashes))
    reply = control.GRANT_REPLY + nonce.hex().encode()
    granted = control.unpack_grant_reply(os.getxattr(ns_b, reply))
    assert [g.kind for g in granted] == [control.GRANT_URL] * 4
    assert all(f"/t/{quote(SPEC.namespace)}/" in g.url for g in granted)
    assert all(g.deadline_ms == 2000 for g in granted)  # the mount's --fetch-timeout
    with urllib.request.urlopen(granted[0].url, timeout=5) as resp:
        assert resp.read()[:8] == b"KVFSBLK\0"
    # Another uid cannot read the answer, even where it may read the directory.
    os.chmod(b.mnt / "t", 0o755)
    os.chmod(ns_b, 0o755)
    with pytest.raises(OSError) as exc:
        in_child(1001, 1001, lambda: os.getxattr(ns_b, reply).hex())
    assert exc.value.errno == 61  # ENODATA: not its grant
    # The signature is for one key: the same query on another object is refused.
    first, second = granted[0].url, granted[1].url
    forged = second.split("?")[0] + "?" + first.split("?")[1]
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(forged, timeout=5)
    assert http.value.code == 403
    # A corrupt object: fetched, found bad, not served, no hot copy.
    client = s3.client()
    key = f"kvfs/t/{SPEC.namespace}/{hashing.block_relpath(hashes[2])}"
    body = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    body[4096 + 100] ^= 0xFF
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(body))
    stats: dict = {}
    got, out, _ = load(b, hashes, kv_in, stats)
    assert got == 2 and torch.equal(out[:2], kv_in[:2]) and not out[2].any()
    assert stats["corrupt_blocks"] == 1 and stats["remote_blocks"] == 2
    assert not os.path.exists(os.path.join(ns_b, hashing.block_relpath(hashes[2])))


def test_a_hung_store_costs_misses_and_hits_return_after_it(mount_factory, s3):  # noqa: F811
    """The store stops answering (frozen): lookups miss within the deadline, the daemon's
    circuit opens (its own fetches of what the clients' GETs could not get fail too), and
    once the store answers again the half-open circuit's probe closes it: full hits return
    within the cooldown and a deadline."""
    a, b = mounts(mount_factory, s3)
    hashes, kv_in = save(a, list(range(5000, 5000 + 16 * 16)))
    wait_uploaded(s3, hashes)
    s3.freeze()
    try:
        deadline = time.monotonic() + 30
        while b.stats()["tiers"][0]["circuit"] != "open":
            got, _, seconds = load(b, hashes, kv_in)
            assert got == 0 and seconds < 6, (got, seconds)
            assert time.monotonic() < deadline, b.stats()["tiers"][0]
        time.sleep(3)  # past every fetch's deadline: none is left to land after the thaw
    finally:
        s3.thaw()
    back = time.monotonic()
    while True:
        got, out, _ = load(b, hashes, kv_in)
        if got == 16:
            break
        assert time.monotonic() - back < 8, (got, b.stats()["tiers"][0])
        time.sleep(0.2)
    assert torch.equal(out, kv_in)


@pytest.mark.skipif(not codec.available(), reason="kvfs.format._codec not built")
def test_the_shared_tier_holds_blocks_encoded(mount_factory, s3):  # noqa: F811
    """bfloat16 KV goes to the bucket encoded (lossless); the other host's client GETs the
    smaller objects with its grants and decodes them where they land: the same bytes."""
    spec = kv.ModelSpec(model="org/shared", revision="r", kv_dtype="bfloat16", block_size=16,
                        num_layers=8, num_kv_heads=2, head_dim=64)
    a, b = mounts(mount_factory, s3)
    kv_in = torch.randn(6, *spec.block_shape).to(torch.bfloat16)
    t0 = time.monotonic()
    with kv.KVCache.open(a.mnt, tenant="t", spec=spec) as c:
        hashes = c.block_hashes(list(range(16 * 6)))
        assert c.save(hashes, kv_in) == 6
    s3c = s3.client()
    deadline = time.monotonic() + 20
    while a.stats()["tiers"][0]["uploads"] < 6:
        assert time.monotonic() < deadline, "the blocks never reached the bucket"
        time.sleep(0.1)
    # The time spent publishing: some, and no more than has passed since the save began.
    assert 0 < a.stats()["tiers"][0]["upload_seconds"] <= time.monotonic() - t0
    objs = [o for o in s3c.list_objects_v2(Bucket=s3.bucket)["Contents"]
            if spec.namespace in o["Key"]]
    assert len(objs) == 6
    raw_file = 4096 + spec.block_payload_bytes
    for o in objs:
        body = s3c.get_object(Bucket=s3.bucket, Key=o["Key"])["Body"].read()
        assert body[8] == 3 and len(body) < 0.8 * raw_file
    tier = a.stats()["tiers"][0]
    assert tier["ratio"] > 1.3 and tier["put_raw_bytes"] == 6 * raw_file
    with kv.KVCache.open(b.mnt, tenant="t", spec=spec) as c:
        assert c.lookup(hashes) == 6
        out = torch.zeros_like(kv_in)
        assert c.load(hashes, out) == 6
        assert torch.equal(out.view(torch.int16), kv_in.view(torch.int16))
        assert c.stats["remote_blocks"] == 6
        assert c.stats["remote_bytes"] == sum(o["Size"] for o in objs)  # the stored bytes
        c.flush()
    # The hot copies on b were written behind as saved (decoded), and serve again.
    ns_b = b.mnt / "t" / spec.namespace
    hot = (ns_b / hashing.block_relpath(hashes[0])).read_bytes()
    assert hot[8] in (1, 2) and len(hot) == raw_file
