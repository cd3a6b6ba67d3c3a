"""KV as governed data, through real mounts: encryption at rest in the cold directory and a
real S3 bucket, blocks moved between names and tenants, placement, crypto-shredding across
hosts, key rotation, a failing key provider."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from .conftest import in_child, kvfs
from .s3server import s3  # noqa: F401 - the fixture

torch = pytest.importorskip("torch")

import kvfs as kv  # noqa: E402
from kvfs.format import blockfile, hashing  # noqa: E402

SPEC = kv.ModelSpec(model="org/governed", revision="r", kv_dtype="float16", block_size=16,
                    num_layers=2, num_kv_heads=2, head_dim=64)
PER = blockfile.HEADER_SIZE + SPEC.block_payload_bytes
#: A byte pattern the saved KV is made of, looked for in every stored byte below hot.
PATTERN = b"known-KV-payload!"


def patterned(n: int, seed: int = 0) -> torch.Tensor:
    """n blocks of KV whose bytes are PATTERN over and over (one byte varies per block)."""
    nbytes = n * SPEC.block_payload_bytes
    raw = bytearray((PATTERN * (nbytes // len(PATTERN) + 1))[:nbytes])
    for i in range(n):
        raw[i * SPEC.block_payload_bytes] = (seed * 31 + i) % 251
    return torch.frombuffer(raw, dtype=torch.float16).view(n, *SPEC.block_shape).clone()


def save(m, tenant: str, kv_in: torch.Tensor, first: int = 0) -> list[bytes]:
    with kv.KVCache.open(m.mnt, tenant=tenant, spec=SPEC) as c:
        hashes = c.block_hashes(list(range(first, first + 16 * len(kv_in))))
        for i in range(len(hashes)):  # one at a time: a small hot tier evicts between them
            assert c.save(hashes[i:i + 1], kv_in[i:i + 1],
                          parent=hashes[i - 1] if i else None) == 1
    return hashes


def load(m, tenant: str, hashes: list[bytes], like: torch.Tensor) -> tuple[int, torch.Tensor,
                                                                           dict]:
    with kv.KVCache.open(m.mnt, tenant=tenant, spec=SPEC) as c:
        n = c.lookup(hashes)
        out = torch.zeros_like(like)
        got = c.load(hashes[:n], out[:n]) if n else 0
        c.flush()
        return got, out, dict(c.stats)


def add(m, tenant: str, *args: str) -> None:
    res = kvfs("tenant", "add", str(m.mnt), tenant, "--uid", "0", "--gid", "0", *args)
    assert f"{tenant}: key " in res.stdout, res.stdout  # made with the tenant


def files_under(top) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs]


def bucket_objects(s3) -> dict[str, bytes]:  # noqa: F811
    c = s3.client()
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=s3.bucket).get("Contents", [])]
    return {k: c.get_object(Bucket=s3.bucket, Key=k)["Body"].read() for k in keys}


def wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_no_tier_below_hot_holds_plaintext_kv(mount_factory, s3, tmp_path):  # noqa: F811
    """Blocks demoted to the cold directory and published to the bucket are sealed (the
    pattern of the saved KV is found in no file and no object); another host restores them
    from the bucket (opening them with its namespace's keys) bit for bit."""
    cold = tmp_path / "cold"
    a = mount_factory("a", extra=["--capacity", str(PER * 4), "--cold", f"dir://{cold}",
                                  "--shared", s3.url])
    b = mount_factory("b", extra=["--shared", s3.url])
    add(a, "t")
    add(b, "t")
    kv_in = patterned(10)
    hashes = save(a, "t", kv_in)
    wait(lambda: a.stats()["tiers"][1]["uploads"] >= 10, "uploads")
    cold_files = files_under(cold)
    assert sum(f.endswith(".kv") for f in cold_files) >= 4  # demoted
    assert any("/.kvfs/keys/t/" in f for f in cold_files)  # the wrapped key beside them
    for f in cold_files:
        with open(f, "rb") as fh:
            assert PATTERN not in fh.read(), f
    objs = bucket_objects(s3)
    assert sum(k.endswith(".kv") for k in objs) == 10
    assert any("/.kvfs/keys/t/" in k for k in objs)
    for k, body in objs.items():
        assert PATTERN not in body, k
        if k.endswith(".kv"):
            assert blockfile.decode_header(body).encoding.seal is not None
    got, out, stats = load(b, "t", hashes, kv_in)
    assert got == 10 and torch.equal(out.view(torch.int16), kv_in.view(torch.int16))
    assert stats["remote_blocks"] == 10  # read from the bucket by b's client itself
    # ... and from a's cold tier through the handout, opened by a's client.
    got, out, _ = load(a, "t", hashes, kv_in)
    assert got == 10 and torch.equal(out.view(torch.int16), kv_in.view(torch.int16))
    st = a.stats()
    assert all(t["sealed"] for t in st["tiers"])
    assert st["governance"]["t"]["keys"]["live"]
    assert "sealed" in kvfs("status", str(a.mnt)).stdout


def test_a_block_moved_to_another_name_or_tenant_is_a_miss(mount_factory, tmp_path):
    """A sealed file copied into another tenant's namespace, or over another block's name,
    does not authenticate there: a miss (a corrupt block, reported), never served. And a
    tenant's process cannot have another tenant's keys."""
    cold = tmp_path / "cold"
    m = mount_factory(extra=["--capacity", str(PER * 4), "--cold", f"dir://{cold}"])
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "4001", "--gid", "4001")
    kvfs("tenant", "add", str(m.mnt), "u", "--uid", "4002", "--gid", "4002")
    hashes = save(m, "t", patterned(8, 1))
    save(m, "u", patterned(8, 2))
    ns = SPEC.namespace
    src = cold / "t" / ns / hashing.block_relpath(hashes[0])
    assert src.exists()
    # Into tenant u's namespace under the same name; over block 1's name in t's own.
    dst_u = cold / "u" / ns / hashing.block_relpath(hashes[0])
    dst_u.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, dst_u)
    dst_t = cold / "t" / ns / hashing.block_relpath(hashes[1])
    assert dst_t.exists()
    shutil.copy(cold / "t" / ns / hashing.block_relpath(hashes[2]), dst_t)
    for tenant, h in (("u", hashes[0]), ("t", hashes[1])):
        with kv.KVCache.open(m.mnt, tenant=tenant, spec=SPEC) as c:
            n = c.lookup([h])
            out = torch.zeros(1, *SPEC.block_shape, dtype=torch.float16)
            assert (c.load([h], out) if n else 0) == 0 and not out.any()  # a miss
    # The daemon's own fetch (a read through the mount) refuses them too.
    with pytest.raises(OSError):
        (m.mnt / "u" / ns / hashing.block_relpath(hashes[0])).read_bytes()
    # A tenant's process is given its own namespace's keys, never another's.
    own = in_child(4001, 4001, lambda: len(os.getxattr(str(m.mnt / "t" / ns),
                                                       "user.kvfs.keys")))
    assert own >= 12 + 36
    with pytest.raises(PermissionError):
        in_child(4001, 4001, lambda: len(os.getxattr(str(m.mnt / "u" / ns),
                                                     "user.kvfs.keys")))


def test_forgetting_a_tenant_shreds_it_on_every_host(mount_factory, s3, tmp_path):  # noqa: F811
    """Three hosts share a bucket. After `kvfs tenant forget` on one: its keys are gone from
    every tier, its objects deleted, a host that had restored its blocks drops them within
    its key_ttl, and every host's lookups of them miss; another tenant is untouched; the
    audit log has the key's life."""
    audit = tmp_path / "audit.jsonl"
    extra = ["--shared", s3.url, "--key-ttl", "1", "--fetch-timeout", "2"]
    a = mount_factory("a", extra=[*extra, "--audit", str(audit)])
    b = mount_factory("b", extra=extra)
    c = mount_factory("c", extra=extra)
    for m in (a, b, c):
        add(m, "t")
        add(m, "keep")
    kv_t, kv_keep = patterned(6, 1), patterned(6, 2)
    hashes = save(a, "t", kv_t)
    keep = save(a, "keep", kv_keep)
    s3.wait_for_blocks(12)
    got, _, _ = load(b, "t", hashes, kv_t)
    assert got == 6  # b restored them: its hot tier holds them now
    res = kvfs("tenant", "forget", str(a.mnt), "t", "--yes")
    assert "forgotten" in res.stdout and "shared" in res.stdout, res.stdout
    assert not (a.mnt / "t").exists()
    objs = bucket_objects(s3)
    assert not [k for k in objs if k.startswith(f"{s3.prefix}/t/")], "t's blocks remain"
    assert not [k for k in objs if "/.kvfs/keys/t/" in k and k.endswith(".key")]
    assert [k for k in objs if "/.kvfs/keys/t/forgotten-" in k]
    assert len([k for k in objs if k.startswith(f"{s3.prefix}/keep/")]) == 6
    got, _, _ = load(c, "t", hashes, kv_t)  # never had them: the objects are gone
    assert got == 0
    ns_b = b.mnt / "t" / SPEC.namespace
    wait(lambda: not any((ns_b / hashing.block_relpath(h)).exists() for h in hashes),
         "b kept the forgotten tenant's blocks past its key_ttl", timeout=10)
    assert load(b, "t", hashes, kv_t)[0] == 0
    got, out, _ = load(c, "keep", keep, kv_keep)
    assert got == 6 and torch.equal(out.view(torch.int16), kv_keep.view(torch.int16))
    def ops() -> list[str]:
        return [json.loads(line)["op"] for line in audit.read_text().splitlines()]

    # (The log is written twice a second: what was recorded may be half a second away.)
    wait(lambda: {"key-create", "key-destroy", "forget"} <= set(ops()),
         f"the key's life is not in the audit log: {sorted(set(ops()))}")
    # The deletions behind the forgetting end on their own, then are audited.
    wait(lambda: "forget-done" in ops(), "the forgetting was never audited as done")
    # A tenant of that name made again is a new tenant with a new key.
    add(a, "t")
    assert load(a, "t", hashes, kv_t)[0] == 0


def test_placement_keeps_a_tenant_out_of_a_tier(mount_factory, s3, tmp_path):  # noqa: F811
    """A tenant placed in hot and cold never reaches the shared tier, through write-through or
    demotion, and its lookups never look there; an unknown tier is refused; `kvfs status`
    and stats.json show the placement."""
    cold = tmp_path / "cold"
    a = mount_factory("a", extra=["--capacity", str(PER * 4), "--cold", f"dir://{cold}",
                                  "--shared", f"eu={s3.url}"])
    add(a, "local", "--placement", "hot,cold")
    add(a, "open")
    bad = kvfs("tenant", "set", str(a.mnt), "open", "--placement", "hot,us", check=False)
    assert bad.returncode != 0 and "placement" in bad.stderr
    save(a, "local", patterned(8, 3))
    save(a, "open", patterned(8, 4))
    s3.wait_for_blocks(8)
    time.sleep(1)  # anything of local's would have been uploaded by now
    objs = bucket_objects(s3)
    assert [k for k in objs if k.startswith(f"{s3.prefix}/open/")]
    assert not [k for k in objs if k.startswith(f"{s3.prefix}/local/")]
    assert not [k for k in objs if "/.kvfs/keys/local/" in k]  # nor its keys
    assert any(f.endswith(".kv") for f in files_under(cold / "local"))  # demoted to cold
    st = a.stats()
    assert st["governance"]["local"]["placement"] == "hot,cold"
    assert st["governance"]["open"]["placement"] == "all"
    assert st["tiers"][1]["name"] == "eu" and st["tiers"][1]["refused_placements"] >= 8
    assert "placement hot,cold" in kvfs("status", str(a.mnt)).stdout
    # Placed in hot alone: an eviction deletes instead of demoting.
    kvfs("tenant", "set", str(a.mnt), "local", "--placement", "hot")
    shutil.rmtree(cold / "local")
    save(a, "local", patterned(8, 5), first=10_000)
    assert not any(f.endswith(".kv") for f in files_under(cold / "local"))
    # Lookups look only inside the placement: host b (placement all) publishes to the
    # bucket; a's tenant placed without eu does not see those blocks, then does.
    b = mount_factory("b", extra=["--shared", f"eu={s3.url}"])
    add(b, "local")
    kv_b = patterned(3, 6)
    hb = save(b, "local", kv_b, first=50_000)
    s3.wait_for_blocks(len([k for k in objs if k.endswith(".kv")]) + 3)
    assert load(a, "local", hb, kv_b)[0] == 0
    kvfs("tenant", "set", str(a.mnt), "local", "--placement", "all")
    got, out, _ = load(a, "local", hb, kv_b)
    assert got == 3 and torch.equal(out.view(torch.int16), kv_b.view(torch.int16))


PROVIDER = """#!{python}
import os, sys
flag = {flag!r}
if os.path.exists(flag):
    sys.stderr.write("kms: access denied\\n")
    sys.exit(2)
op = sys.argv[1]
data = sys.stdin.buffer.read()
if op == "forget":
    sys.exit(0)
sys.stdout.buffer.write(bytes(b ^ 0x5A for b in data))  # a stand-in for a KMS's wrap
"""


def test_a_failing_key_provider_gives_misses_and_no_plaintext(mount_factory, tmp_path):
    """With the key provider failing, no block leaves the hot tier unsealed (demotion
    deletes instead), blocks below are misses, and the log says why; once it answers again
    they load."""
    flag = tmp_path / "provider-down"
    script = tmp_path / "provider"
    script.write_text(PROVIDER.format(python=shutil.which("python3") or "/usr/bin/python3",
                                      flag=str(flag)))
    script.chmod(0o755)
    cold = tmp_path / "cold"
    m = mount_factory(extra=["--capacity", str(PER * 4), "--cold", f"dir://{cold}",
                             "--key-command", str(script), "--key-ttl", "0.5"])
    add(m, "t")
    kv_a = patterned(6, 7)
    first = save(m, "t", kv_a)
    below = lambda: sorted(f for f in files_under(cold / "t") if f.endswith(".kv"))  # noqa: E731
    demoted = below()
    assert demoted
    flag.touch()
    time.sleep(0.6)  # the unwrapped key expires
    save(m, "t", patterned(6, 8), first=20_000)
    assert below() == demoted  # evicted blocks were deleted, not written unsealed
    for f in below():
        with open(f, "rb") as fh:
            assert PATTERN not in fh.read()
    got, _, _ = load(m, "t", first, kv_a)
    assert got == 0  # the demoted ones cannot be opened: misses
    log = m.log_text()
    assert "kms: access denied" in log and "not sealed, so not demoted" in log
    flag.unlink()
    time.sleep(0.6)
    with kv.KVCache.open(m.mnt, tenant="t", spec=SPEC) as c:
        n = c.lookup(first)
        assert n >= 1  # the first blocks were demoted: found and opened again
        out = torch.zeros_like(kv_a)
        assert c.load(first[:n], out[:n]) == n
        assert torch.equal(out[:n].view(torch.int16), kv_a[:n].view(torch.int16))


def test_rotation_seals_new_blocks_with_the_new_key(mount_factory, tmp_path):
    cold = tmp_path / "cold"
    m = mount_factory(extra=["--capacity", str(PER * 4), "--cold", f"dir://{cold}",
                             "--key-ttl", "0.5"])
    add(m, "t")
    tdir = str(m.mnt / "t")
    old = json.loads(os.getxattr(tdir, "user.kvfs.key_state"))["live"][0]
    kv_a = patterned(4, 9)
    first = save(m, "t", kv_a)
    res = kvfs("tenant", "rotate-key", str(m.mnt), "t")
    new = json.loads(os.getxattr(tdir, "user.kvfs.key_state"))["live"][0]
    assert new != old and new in res.stdout
    kv_b = patterned(4, 10)
    later = save(m, "t", kv_b, first=30_000)
    ids = {}
    for f in files_under(cold / "t"):
        if f.endswith(".kv"):
            with open(f, "rb") as fh:
                h = blockfile.decode_header(fh.read(4096))
            ids[os.path.basename(f)] = f"{h.encoding.seal.key_id:08x}"
    assert old in ids.values() and new in ids.values()
    assert load(m, "t", first[:1], kv_a[:1])[0] == 1  # older keys open their blocks
    kvfs("tenant", "retire-key", str(m.mnt), "t", old)
    time.sleep(0.6)
    sealed_old = [h for h in first + later
                  if ids.get(hashing.block_filename(h)) == old]
    assert sealed_old
    assert load(m, "t", sealed_old[:1], kv_a[:1])[0] == 0  # retired: a miss
    assert "retired" in kvfs("tenant", "keys", str(m.mnt), "t").stdout


def test_hot_encryption_leaves_no_plaintext_on_the_backing_disk(mount_factory, tmp_path):
    """--hot-encrypt: clients seal what they save, loads open it (from hot and, demoted, from
    the cold tier), and fsck's full check finds the sealed files sound."""
    cold = tmp_path / "cold"
    m = mount_factory(extra=["--capacity", str(PER * 4), "--cold", f"dir://{cold}",
                             "--hot-encrypt"])
    add(m, "t")
    assert os.getxattr(str(m.mnt / "t"), "user.kvfs.seal") == b"1"
    kv_in = patterned(8, 11)
    hashes = save(m, "t", kv_in)
    hot = [f for f in files_under(m.backing / "t") if f.endswith(".kv")]
    assert hot and sum(f.endswith(".kv") for f in files_under(cold)) >= 1
    for f in hot + files_under(cold):
        with open(f, "rb") as fh:
            data = fh.read()
        assert PATTERN not in data, f
    got, out, _ = load(m, "t", hashes, kv_in)
    assert got == 8 and torch.equal(out.view(torch.int16), kv_in.view(torch.int16))
    m.stop()
    res = kvfs("fsck", str(m.backing), "--verify")
    assert "quarantined:" not in res.stdout, res.stdout  # sound, though it holds no key
    m.start()
    got, out, _ = load(m, "t", hashes, kv_in)
    assert got == 8 and torch.equal(out.view(torch.int16), kv_in.view(torch.int16))
