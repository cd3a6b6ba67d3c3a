"""The kvfs client (the direct path) against real mounts."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import xxhash

import kvfs
from kvfs.client import CacheFull, KVCache, SpecMismatch, transport
from kvfs.format import blockfile, control, hashing

from .conftest import drop_cached, flip_byte
from .conftest import kvfs as kvfs_cli

SPEC = kvfs.ModelSpec(model="org/tiny", revision="r1", kv_dtype="bfloat16", block_size=4,
                      num_layers=3, num_kv_heads=2, head_dim=8)
OTHER = kvfs.ModelSpec(model="org/tiny", revision="r2", kv_dtype="bfloat16", block_size=4,
                       num_layers=3, num_kv_heads=2, head_dim=8)
BS = SPEC.block_size


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def kv_of(hashes: list[bytes], spec: kvfs.ModelSpec = SPEC) -> torch.Tensor:
    """Deterministic KV for each block, derived from its hash (the same block, the same KV)."""
    out = []
    for h in hashes:
        g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little") >> 1)
        out.append(torch.randn(spec.block_shape, generator=g).to(torch.bfloat16))
    return torch.stack(out)


def digest(t: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(transport.host_view(t.contiguous()))


def empty(n: int, fill: float = 7.0) -> torch.Tensor:
    return torch.full((n, *SPEC.block_shape), fill, dtype=torch.bfloat16)


@pytest.fixture
def tenant(mount) -> str:
    kvfs_cli("tenant", "add", str(mount.mnt), "acme", "--uid", "0", "--gid", "0")
    return "acme"


@pytest.fixture
def cache(mount, tenant):
    with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC) as c:
        yield c


def ns_stats(mount, spec: kvfs.ModelSpec = SPEC) -> dict:
    return mount.stats()["tenants"]["acme"][spec.namespace]


def test_import_kvfs_imports_no_torch():
    code = ("import sys, kvfs; kvfs.ModelSpec; assert 'torch' not in sys.modules; "
            "kvfs.KVCache; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_client_imports_no_daemon_module():
    """The client side never loads pyfuse3, trio or a daemon module: it takes on-disk names
    from kvfs.format.layout and attribute names from kvfs.format.control."""
    code = ("import sys, kvfs.client, kvfs.client.cache, kvfs.client.channel, "
            "kvfs.client.load, kvfs.client.layerwise, kvfs.client.save, kvfs.client.layouts; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('pyfuse3', 'trio') "
            "or m.startswith('kvfs.daemon')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_open_makes_namespace_and_manifest(mount, tenant):
    with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC) as c:
        assert c.direct
        ns = mount.mnt / tenant / SPEC.namespace
        assert c.ns_dir == str(ns)
        assert json.loads((ns / "manifest.json").read_bytes())["fingerprint"] == \
            SPEC.fingerprint.hex()
        assert c.data_dir == str(mount.backing / tenant / SPEC.namespace)
    with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC) as c:  # again: reuses it
        assert c.direct
    with pytest.raises(FileNotFoundError, match="no tenant 'nobody'"):
        KVCache.open(mount.mnt, tenant="nobody", spec=SPEC)
    # Nothing is made outside a kvfs mount, nor through a tenant name that is a path.
    plain = mount.mnt.parent / "plain"
    (plain / tenant).mkdir(parents=True)
    with pytest.raises(ValueError, match=f"{plain} is not a kvfs mount"):
        KVCache.open(plain, tenant=tenant, spec=SPEC)
    assert os.listdir(plain / tenant) == []
    for bad in ("../plain", f"{tenant}/x", ".kvfs", ""):
        with pytest.raises(ValueError, match="is not a tenant name"):
            KVCache.open(mount.mnt, tenant=bad, spec=SPEC)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        KVCache.open(mount.mnt.parent / "nowhere", tenant=tenant, spec=SPEC)


def test_misuse_is_a_clear_error(mount, tenant):
    """A hash that is not bytes, and any call after close(), are said plainly (an
    AttributeError from inside the save, and the thread pool's own 'cannot schedule new
    futures' before)."""
    with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC) as c:
        hashes = c.block_hashes(tokens(2))
        kv = kv_of(hashes)
        for call in (lambda: c.save(["a" * 16], kv[:1]), lambda: c.lookup([hashes[0].hex()])):
            with pytest.raises(ValueError, match="a block hash is 16 bytes, got a str"):
                call()
        assert c.save(hashes, kv) == 2
    out = torch.zeros_like(kv)
    for call in (lambda: c.save(hashes, kv), lambda: c.save_async(hashes, kv),
                 lambda: c.load(hashes, out), lambda: c.load_async(hashes, out),
                 lambda: c.lookup(hashes)):
        with pytest.raises(RuntimeError, match="KVCache is closed"):
            call()
    c.close()  # again: nothing to do


def test_round_trip_in_another_process(mount, cache):
    toks = tokens(5) + [1, 2]  # a partial tail block is not hashed
    hashes = cache.block_hashes(toks)
    assert hashes == hashing.block_hashes(toks, BS) and len(hashes) == 5
    kv = kv_of(hashes)
    assert cache.save(hashes, kv) == 5
    assert cache.save(hashes, kv) == 0  # already there
    script = textwrap.dedent(f"""
        import json, torch, kvfs, xxhash
        from kvfs.client import transport
        spec = kvfs.ModelSpec.from_manifest({SPEC.manifest_json().decode()!r})
        with kvfs.KVCache.open({str(mount.mnt)!r}, tenant="acme", spec=spec) as c:
            hashes = c.block_hashes({toks!r})
            n = c.lookup(hashes)
            out = torch.zeros((n, *spec.block_shape), dtype=torch.bfloat16)
            loaded = c.load(hashes[:n], out)
            print(json.dumps({{"n": n, "loaded": loaded, "direct": c.direct,
                              "digest": xxhash.xxh3_64_hexdigest(transport.host_view(out)),
                              "amp": c.stats["fetch_amplification"]}}))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"n": 5, "loaded": 5, "direct": True, "digest": digest(kv), "amp": 1.0}


def test_lookup_is_the_cached_prefix(cache):
    hashes = cache.block_hashes(tokens(6))
    cache.save(hashes[:3], kv_of(hashes[:3]))
    assert cache.lookup(hashes) == 3
    assert cache.lookup(hashes[:2]) == 2
    assert cache.lookup([]) == 0
    cache.save(hashes[4:5], kv_of(hashes[4:5]), parent=hashes[3])  # a gap: 3 is missing
    assert cache.lookup(hashes) == 3
    # A block whose prefix is not cached can never be a prefix hit: the daemon does not
    # place it (and counts it refused).
    assert not os.path.exists(cache.path(hashes[4]))
    with open(cache.path(hashes[2]), "rb") as f:
        assert blockfile.decode_header(f.read(4096)).parent_hash == hashes[1]
    with open(cache.path(hashes[0]), "rb") as f:
        assert blockfile.decode_header(f.read(4096)).parent_hash == hashing.ROOT_PARENT
    assert cache.lookup(hashes[1:]) == 2  # hashes 1, 2 present
    assert cache.stats["lookups"] == 5


def test_constant_control_calls(mount, cache):
    """save: one call; lookup + load: one call together (the lookup's access record travels
    with the load's), whatever the number of blocks; and every count reaches the daemon."""
    costs = []
    for n, start in ((1, 0), (64, 1000)):
        hashes = cache.block_hashes(tokens(n, start))
        kv = kv_of(hashes)
        cost = []
        for op, args in ((cache.save, (hashes, kv)), (cache.lookup, (hashes,)),
                         (cache.load, (hashes, torch.empty_like(kv)))):
            before = cache.stats["control_calls"]
            op(*args)
            cost.append(cache.stats["control_calls"] - before)
        costs.append(cost)
    assert costs[0] == costs[1] == [1, 0, 1]
    c = ns_stats(mount)
    assert (c["lookups"], c["hit_blocks"], c["miss_blocks"]) == (2, 65, 0)
    assert c["direct_needed_bytes"] == 65 * (4096 + SPEC.block_payload_bytes)
    # A lookup that found nothing has no load to wait for: its record goes at once.
    miss = cache.block_hashes(tokens(2, 5000))
    before = cache.stats["control_calls"]
    assert cache.lookup(miss) == 0
    assert cache.stats["control_calls"] - before == 1
    assert (ns_stats(mount)["lookups"], ns_stats(mount)["miss_blocks"]) == (3, 2)


def test_the_control_thread_ends_when_idle(mount, tenant, monkeypatch):
    """Access records go on a control thread that ends once idle, so a client never closed
    keeps no thread; the next record starts another, and nothing is lost on the way."""
    from kvfs.client import channel as client_module

    monkeypatch.setattr(client_module, "CONTROL_IDLE_S", 0.2)
    c = KVCache.open(mount.mnt, tenant=tenant, spec=SPEC)
    try:
        hashes = c.block_hashes(tokens(2))
        c.save(hashes, kv_of(hashes))
        for round_ in range(2):
            assert c.load(hashes, empty(2)) == 2
            assert c._channel._sender is not None
            deadline = time.monotonic() + 10
            while c._channel._sender is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c._channel._sender is None, "the control thread did not end"
            assert ns_stats(mount)["direct_needed_bytes"] == (round_ + 1) * 2 * (
                4096 + SPEC.block_payload_bytes)
    finally:
        c.close()


def test_a_stopped_daemon_hangs_neither_loads_nor_counters_nor_close(mount, tenant,
                                                                     monkeypatch, caplog):
    """A daemon stopped without dying (SIGSTOP) takes no control call. Loads read the
    backing files on without it (past MAX_QUEUED_RECORDS records queued behind the stopped
    call, a load waits a bounded time, then drops its record); reading the counters and
    closing wait a bounded time for the queued records, then go on and say so."""
    import signal

    from kvfs.client import cache as cache_module
    from kvfs.client import channel as channel_module

    monkeypatch.setattr(channel_module, "DRAIN_WAIT_S", 0.5)
    monkeypatch.setattr(cache_module, "DRAIN_WAIT_S", 0.5)
    c = KVCache.open(mount.mnt, tenant=tenant, spec=SPEC)
    hashes = c.block_hashes(tokens(3))
    kv = kv_of(hashes)
    c.save(hashes, kv)
    pid = mount.pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        out = empty(3)
        assert c.load(hashes, out) == 3 and torch.equal(out, kv)
        for _ in range(channel_module.MAX_QUEUED_RECORDS + 2):  # records queue, then drop
            assert c.load(hashes, empty(3)) == 3
        assert c.stats["loaded_blocks"] == 3 * (channel_module.MAX_QUEUED_RECORDS + 3)
        c.close()
        assert time.monotonic() - t < 30
    finally:
        os.kill(pid, signal.SIGCONT)
    assert "took no control call" in caplog.text
    assert mount.stats()["pid"] == pid  # the daemon serves on once it runs again


def test_held_back_lookup_records_are_not_lost(mount, tenant):
    """A lookup's record waits for the next request at most, and close() sends it."""
    with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC) as c:
        hashes = c.block_hashes(tokens(3))
        c.save(hashes, kv_of(hashes))
        assert c.lookup(hashes) == 3  # held back
        assert ns_stats(mount)["lookups"] == 0
        assert c.lookup(hashes[:1]) == 1  # sends the first, holds back its own
        c.stats  # noqa: B018 - reading them waits for the records queued so far
        assert (ns_stats(mount)["lookups"], ns_stats(mount)["hit_blocks"]) == (1, 3)
    assert (ns_stats(mount)["lookups"], ns_stats(mount)["hit_blocks"]) == (2, 4)


def test_corrupt_block_is_a_miss_and_quarantined(mount, cache):
    hashes = cache.block_hashes(tokens(4))
    kv = kv_of(hashes)
    cache.save(hashes, kv)
    path = cache.path(hashes[2])
    flip_byte(path, 4096 + 100, 0x10)  # one payload byte in the backing file
    out = empty(4)
    assert cache.load(hashes, out) == 2
    assert torch.equal(out[:2], kv[:2])
    assert torch.count_nonzero(out[2]) == 0  # no bad bytes left behind
    assert cache.stats["corrupt_blocks"] == 1
    fan = mount.mnt / "acme" / SPEC.namespace / hashes[2][:1].hex()
    assert f"{hashes[2].hex()}.kv" not in os.listdir(fan)
    assert not os.path.exists(path)
    assert ns_stats(mount)["checksum_failures"] == 1
    assert cache.lookup(hashes) == 2


#: Blocks above transport.HASH_PIECE (read and hashed in pieces), padded: 1,054,720 bytes.
BIG = kvfs.ModelSpec(model="org/big", revision="r1", kv_dtype="bfloat16", block_size=16,
                     num_layers=4, num_kv_heads=4, head_dim=1030)


@pytest.mark.parametrize("reader", ["host", "transport", "layerwise"])
@pytest.mark.parametrize("verify", ["full", "sampled"])
def test_blocks_of_the_wrong_length_are_misses(mount, tenant, verify, reader):
    """The loader reads no fstat: a probe past the padding tells the file's length. A block
    one byte too long, one missing a byte of padding, or one cut in its payload is a miss
    whether or not its checksum is sampled, nothing of it stays in `out`, and the daemon
    quarantines it. "transport" is the path CUDA destinations take (through the transport,
    with an fstat), run here with host tensors: the same verdicts; so is "layerwise"
    (load_async: each header and length checked by blockfile.check_head before any layer)."""
    quarantined = 0
    for spec in (SPEC, BIG):
        assert spec.block_payload_bytes % 4096  # padded: the probe covers padding + 1 byte
        damages = (("longer", lambda p, n: open(p, "ab").write(b"\0")),
                   ("padding cut", lambda p, n: os.truncate(p, n - 1)),
                   ("payload cut", lambda p, n, s=spec: os.truncate(
                       p, 4096 + s.block_payload_bytes // 2)))
        with KVCache.open(mount.mnt, tenant=tenant, spec=spec, verify=verify) as c:
            for k, (what, damage) in enumerate(damages):
                hashes = c.block_hashes(list(range(3 * spec.block_size)), extra=f"{what}")
                g = torch.Generator().manual_seed(k)
                kv = torch.randn((3, *spec.block_shape), generator=g).to(torch.bfloat16)
                c.save(hashes, kv)
                path = c.path(hashes[1])
                damage(path, os.path.getsize(path))
                out = torch.full_like(kv, 7.0)
                if reader == "host":
                    assert c.load(hashes, out) == 1, what
                elif reader == "layerwise":
                    assert c.load_async(hashes, out).wait(timeout=60) == 1, what
                else:
                    blocks = c._blocks(out, 3, "out")
                    assert c._load(hashes, lambda i, b=blocks: [b[i].reshape(-1)]) == 1, what
                assert torch.equal(out[0], kv[0])
                assert torch.count_nonzero(out[1]) == 0, what  # nothing of it left in out
                # Past the miss: unread, or read in parallel and sound (never returned).
                assert torch.all(out[2] == 7.0) or torch.equal(out[2], kv[2])
                quarantined += 1
                assert not os.path.exists(path), what
            assert (c.stats["corrupt_blocks"], c.stats["loaded_blocks"]) == (3, 3)
    counts = mount.stats()["tenants"]["acme"]
    assert sum(ns["checksum_failures"] for ns in counts.values()) == quarantined


@pytest.mark.parametrize("verify", ["full", "sampled"])
def test_the_c_reads_load_what_the_python_reads_load(mount, tenant, verify):
    """Host loads go through kvfs.client._fastread; the Python reads are its reference (and what
    rechecks a block it does not accept outright): the same blocks loaded, the same bytes,
    the same misses zeroed and reported, whichever reads them."""
    pytest.importorskip("kvfs.client._fastread")

    damages = {"sound": lambda p: None, "payload": lambda p: flip_byte(p, 4096 + 77, 0x01),
               "magic": lambda p: flip_byte(p, 0, 0x01), "gone": os.unlink,
               "longer": lambda p: open(p, "ab").write(b"\0"),
               "cut": lambda p: os.truncate(p, 4096 + 10)}
    seen = {}
    for native in (True, False):
        with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC, verify=verify) as c:
            c._native = native
            for name, damage in damages.items():
                hashes = c.block_hashes(tokens(6), extra=f"{name} {native} {verify}")
                # The same sampling decisions for both readers: the hashes differ by reader.
                kv = kv_of(hashes)
                c.save(hashes, kv)
                damage(c.path(hashes[3]))
                out = empty(6)
                before = c.stats
                n = c.load(hashes, out)
                after = c.stats
                sampled = verify == "full" or hashes[3][-1] % 8 == 0
                same = [i for i in range(n) if i != 3 or name != "payload"]
                assert torch.equal(out[same], kv[same]), (name, native)
                if n < 6:
                    assert torch.count_nonzero(out[n]) == 0 or name == "gone", (name, native)
                seen[(name, native)] = (
                    n if name != "payload" or sampled else "unchecked",
                    after["corrupt_blocks"] - before["corrupt_blocks"],
                    after["read_bytes"] - before["read_bytes"] >= n * c._file_bytes)
    for name in damages:
        assert seen[(name, True)] == seen[(name, False)], name
    assert seen[("sound", True)][0] == 6 and seen[("gone", True)][0] == 3


def test_sampled_verification_still_checks_headers(mount, tenant):
    with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC, verify="sampled") as c:
        hashes = c.block_hashes(tokens(16))
        c.save(hashes, kv_of(hashes))
        with open(c.path(hashes[1]), "r+b") as f:
            f.write(b"X")  # the magic
        out = empty(16)
        assert c.load(hashes, out) == 1
        assert torch.count_nonzero(out[1]) == 0


def test_manifest_of_another_spec_is_refused(mount, tenant):
    KVCache.open(mount.mnt, tenant=tenant, spec=SPEC).close()
    manifest = mount.mnt / tenant / SPEC.namespace / "manifest.json"
    manifest.write_bytes(OTHER.manifest_json())
    with pytest.raises(SpecMismatch, match=f"{OTHER.fingerprint.hex()}.*not this model's"):
        KVCache.open(mount.mnt, tenant=tenant, spec=SPEC)
    doc = json.loads(SPEC.manifest_json())
    doc["head_dim"] = 64  # fields edited, fingerprint kept: inconsistent
    manifest.write_text(json.dumps(doc))
    with pytest.raises(SpecMismatch, match="not a valid manifest"):
        KVCache.open(mount.mnt, tenant=tenant, spec=SPEC)


def test_block_of_another_spec_is_never_loaded(mount, tenant, caplog):
    with KVCache.open(mount.mnt, tenant=tenant, spec=OTHER) as other, \
            KVCache.open(mount.mnt, tenant=tenant, spec=SPEC) as c:
        hashes = c.block_hashes(tokens(2))
        other.save(hashes, kv_of(hashes, OTHER))
        c.save(hashes, kv_of(hashes))
        with open(other.path(hashes[0]), "rb") as src, open(c.path(hashes[0]), "wb") as dst:
            dst.write(src.read())  # the right name, another model's block
        assert c.lookup(hashes) == 2  # present by name...
        out = empty(2)
        with caplog.at_level(logging.ERROR, logger="kvfs.client"):
            assert c.load(hashes, out) == 0  # ...but never loaded
        assert torch.count_nonzero(out[0]) == 0
        assert "written for another model or layout" in caplog.text
        assert OTHER.fingerprint.hex() in caplog.text
        assert c.stats["mismatched_blocks"] == 1 and c.stats["corrupt_blocks"] == 0


def test_fallback_through_the_mount(mount, tenant, caplog):
    with caplog.at_level(logging.WARNING, logger="kvfs.client"):
        with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC, direct=False) as c:
            assert not c.direct and c.data_dir == c.ns_dir
            hashes = c.block_hashes(tokens(3))
            kv = kv_of(hashes)
            assert c.save(hashes, kv) == 3
            assert c.lookup(hashes) == 3
            out = empty(3)
            assert c.load(hashes, out) == 3
            assert torch.equal(out, kv)
            assert c.prefetch(hashes).result() == 3
            # No publish (the daemon saw the writes); lookup + load: one access record.
            assert c.stats["control_calls"] == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "through the mount" in warnings[0].getMessage()
    path = c.path(hashes[0])
    assert path.startswith(str(mount.mnt))
    assert os.getxattr(path, "user.kvfs.block_hash") == hashes[0].hex().encode()
    with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC) as d:  # the direct path sees them
        out = empty(3)
        assert d.load(hashes, out) == 3 and torch.equal(out, kv)


def test_paged_round_trip(cache):
    hashes = cache.block_hashes(tokens(3))
    kv = kv_of(hashes)
    pages = 8
    src = [torch.randn((pages, *SPEC.block_shape[1:])).to(torch.bfloat16)
           for _ in range(SPEC.num_layers)]
    for i, p in enumerate([5, 1, 7]):
        for layer in range(SPEC.num_layers):
            src[layer][p] = kv[i, layer]
    assert cache.save_paged(hashes, src, [5, 1, 7]) == 3
    out = empty(3)
    assert cache.load(hashes, out) == 3 and torch.equal(out, kv)  # same files as save()
    dst = [torch.zeros((pages, *SPEC.block_shape[1:]), dtype=torch.bfloat16)
           for _ in range(SPEC.num_layers)]
    assert cache.load_paged(hashes, dst, [0, 3, 2]) == 3
    for layer in range(SPEC.num_layers):
        for i, p in enumerate([0, 3, 2]):
            assert torch.equal(dst[layer][p], kv[i, layer])
        assert torch.count_nonzero(dst[layer][1]) == 0
    with pytest.raises(IndexError):
        cache.load_paged(hashes, dst, [0, 3, 99])


def test_load_async_layer_by_layer(cache):
    hashes = cache.block_hashes(tokens(8))
    kv = kv_of(hashes)
    cache.save(hashes, kv)
    out = empty(8)
    h = cache.load_async(hashes, out)
    for layer in range(SPEC.num_layers):
        assert h.wait_layer(layer) == 8
        assert torch.equal(out[:, layer], kv[:, layer])
    assert h.wait() == 8 and h.done()
    assert torch.equal(out, kv)
    assert cache.stats["fetch_amplification"] == 1.0
    with open(cache.path(hashes[5]), "r+b") as f:  # corrupt the last layer of block 5
        f.seek(4096 + SPEC.block_payload_bytes - 1)
        f.write(b"\x55")
    out = empty(8)
    h = cache.load_async(hashes, out)
    assert h.wait_layer(0) == 8  # headers are fine: checksums come with wait()
    assert h.wait() == 5
    assert torch.equal(out[:5], kv[:5]) and torch.count_nonzero(out[5]) == 0
    h = cache.load_async(hashes, empty(8))
    assert h.wait() == 5  # quarantined: now absent
    with pytest.raises(ValueError, match="shape"):
        cache.load_async(hashes, empty(8)[:, :2])


def test_save_async_drops_when_the_queue_is_full(mount, tenant):
    with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC, max_pending_saves=1) as c:
        gate = threading.Event()
        save = c.save

        def slow_save(*args, **kw):
            gate.wait(10)
            return save(*args, **kw)

        c.save = slow_save  # the writer thread is stuck on the first save
        a, b = c.block_hashes(tokens(2)), c.block_hashes(tokens(2, 100))
        assert c.save_async(a, kv_of(a))
        assert not c.save_async(b, kv_of(b))
        assert c.stats["dropped_saves"] == 1
        gate.set()
        c.flush()
        assert c.lookup(a) == 2 and c.lookup(b) == 0
        assert c.save_async(b, kv_of(b))
    with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC) as c:  # close() flushed
        assert c.lookup(b) == 2


def test_many_threads_share_one_client(cache):
    chains = [cache.block_hashes(tokens(4) + tokens(4, 1000 * t)) for t in range(8)]
    errors: list[BaseException] = []

    def work(hashes: list[bytes]) -> None:
        try:
            for _ in range(3):
                kv = kv_of(hashes)
                cache.save(hashes, kv)
                out = empty(len(hashes))
                assert cache.load(hashes, out) == len(hashes)
                assert torch.equal(out, kv)
                h = cache.load_async(hashes, out2 := empty(len(hashes)))
                assert h.wait() == len(hashes) and torch.equal(out2, kv)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(h,)) for h in chains]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert cache.stats["fetch_amplification"] == 1.0


def test_mount_stats_show_the_client(mount, cache):
    hashes = cache.block_hashes(tokens(5))
    cache.save(hashes[:3], kv_of(hashes[:3]))
    assert cache.lookup(hashes) == 3
    assert cache.load(hashes[:3], empty(3)) == 3
    cache.flush()  # access records travel on the client's control thread: wait for them
    c = ns_stats(mount)
    assert c["published_blocks"] == 3
    assert c["published_bytes"] == 3 * blockfile.HEADER_SIZE * 2
    assert (c["lookups"], c["hit_blocks"], c["miss_blocks"]) == (1, 3, 2)
    assert (c["hit_tokens"], c["miss_tokens"]) == (3 * BS, 2 * BS)
    assert c["direct_read_bytes"] == 3 * (4096 + SPEC.block_payload_bytes)
    assert c["direct_needed_bytes"] == c["direct_read_bytes"]  # fetch amplification 1.00x
    listing = os.listdir(mount.mnt / "acme" / SPEC.namespace)
    assert {h[:1].hex() for h in hashes[:3]} <= set(listing)


def test_full_cache_raises(mount_factory):
    mount = mount_factory(extra=["--capacity", "20K"])
    kvfs_cli("tenant", "add", str(mount.mnt), "acme", "--uid", "0", "--gid", "0")
    with KVCache.open(mount.mnt, tenant="acme", spec=SPEC) as c:
        hashes = c.block_hashes(tokens(4))  # 8 KiB files: 32 KiB do not fit
        with pytest.raises(CacheFull):
            c.save(hashes, kv_of(hashes))
        left = [h for h in hashes if os.path.exists(c.path(h))]
        assert len(left) < 4  # what was refused is gone; what is left is published:
        for h in left:
            assert os.path.exists(os.path.join(c.ns_dir, hashing.block_relpath(h)))


def test_a_large_save_is_published_in_parts_as_it_is_written(mount_factory, monkeypatch):
    """A direct save of more than PUBLISH_EVERY bytes is published in parts, each once its
    blocks are written (the daemon's write-through begins while the rest is written), every
    block published in the end; a save larger than the capacity is still one command,
    refused whole: nothing of it kept."""
    from kvfs.client import save as saving

    file_bytes = 4096 + blockfile.padded_size(SPEC.block_payload_bytes)  # 8 KiB
    monkeypatch.setattr(saving, "PUBLISH_EVERY", 2 * file_bytes)
    batches: list[int] = []
    real = saving.Saving._publish

    def publish(self, batch, *, fetched):
        batches.append(len(batch))
        return real(self, batch, fetched=fetched)

    monkeypatch.setattr(saving.Saving, "_publish", publish)
    mount = mount_factory(extra=["--capacity", "48K"])
    kvfs_cli("tenant", "add", str(mount.mnt), "acme", "--uid", "0", "--gid", "0")
    with KVCache.open(mount.mnt, tenant="acme", spec=SPEC) as c:
        hashes = c.block_hashes(tokens(5))  # 40 KiB: fits
        assert c.save(hashes, kv_of(hashes)) == 5
        assert batches == [2, 2, 1]
        assert c.lookup(hashes) == 5
        out = empty(5)
        assert c.load(hashes, out) == 5 and torch.equal(out, kv_of(hashes))
        batches.clear()
        more = c.block_hashes(tokens(8, start=100))  # 64 KiB: more than the capacity
        with pytest.raises(CacheFull):
            c.save(more, kv_of(more))
        assert batches == [8]
        assert not any(os.path.exists(c.path(h)) for h in more)
        assert c.lookup(hashes) == 5  # (nothing of the first evicted for a refused save)


def test_blocks_that_fit_are_what_the_capacity_and_the_quota_hold(mount_factory):
    mount = mount_factory(extra=["--capacity", "20K"])
    kvfs_cli("tenant", "add", str(mount.mnt), "acme", "--uid", "0", "--gid", "0")
    file_bytes = 4096 + blockfile.padded_size(SPEC.block_payload_bytes)  # 8 KiB
    with KVCache.open(mount.mnt, tenant="acme", spec=SPEC) as c:
        assert c.blocks_that_fit(10) == 20 * 1024 // file_bytes == 2
        assert c.blocks_that_fit(1) == 1
        hashes = c.block_hashes(tokens(4))
        n = c.blocks_that_fit(len(hashes))
        assert c.save(hashes[:n], kv_of(hashes[:n])) == n  # what fits is not refused
    # A quota below the capacity: it is the limit (read again by a new client).
    os.setxattr(mount.mnt / "acme", control.limit_name("quota"), b"12K")
    with KVCache.open(mount.mnt, tenant="acme", spec=SPEC) as c:
        assert c.blocks_that_fit(10) == 1


def test_native_and_python_writes_make_the_same_files(cache, mount):
    """kvfs.client._fastread.write_block and the writes in Python: the same bytes, published
    alike."""
    pytest.importorskip("kvfs.client._fastread")
    hashes = cache.block_hashes(tokens(3))
    kv = kv_of(hashes)
    files = {}
    for native in (False, True):
        cache._native_writes = native
        assert cache.save(hashes, kv) == 3
        files[native] = [open(cache.path(h), "rb").read() for h in hashes]
        assert not [n for n in os.listdir(os.path.dirname(cache.path(hashes[0])))
                    if not n.endswith(".kv")]  # no temporary left
        for h in hashes:
            os.unlink(os.path.join(cache.ns_dir, hashing.block_relpath(h)))
    assert files[True] == files[False]
    assert cache.save(hashes, kv) == 3
    out = torch.zeros_like(kv)
    assert cache.load(hashes, out) == 3 and torch.equal(out, kv)


def as_uid(uid: int, fn) -> str:
    """Run ``fn`` in a forked child process that has dropped to ``uid`` (a process of another
    tenant); returns what it returned. A fork needs no interpreter that the uid may execute."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, str(fn()).encode())
            code = 0
        except BaseException as exc:  # noqa: BLE001
            os.write(w, f"error {exc!r}".encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    return out


def test_tenants_are_isolated(mount):
    for name, uid in (("alpha", 1000), ("beta", 1001)):
        kvfs_cli("tenant", "add", str(mount.mnt), name, "--uid", str(uid), "--gid", str(uid))

    def use(tenant: str) -> str:
        try:
            with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC) as c:
                h = c.block_hashes(tokens(1))
                c.save(h, torch.zeros((1, *SPEC.block_shape), dtype=torch.bfloat16))
                return f"open {c.direct} {c.lookup(h)}"
        except PermissionError as exc:
            return f"denied {exc}"

    def publish(tenant: str) -> str:
        try:
            os.setxattr(mount.mnt / tenant / SPEC.namespace, control.PUBLISH, bytes(16))
            return "published"
        except PermissionError:
            return "publish denied"

    assert as_uid(1000, lambda: use("alpha")) == "open True 1"
    out = as_uid(1001, lambda: use("alpha"))
    assert out.startswith("denied") and "tenant 'alpha'" in out
    assert as_uid(1001, lambda: publish("alpha")) == "publish denied"
    assert as_uid(1000, lambda: publish("alpha")) == "published"  # its own: allowed
    assert as_uid(1001, lambda: use("beta")) == "open True 1"
    st = os.stat(mount.backing / "alpha" / SPEC.namespace)
    assert st.st_uid == 1000


def test_options_are_checked(mount, tenant, monkeypatch):
    with pytest.raises(ValueError, match="verify"):
        KVCache.open(mount.mnt, tenant=tenant, spec=SPEC, verify="none")
    monkeypatch.setenv("KVFS_IO", "tape")
    with pytest.raises(ValueError, match="posix or kvikio"):
        KVCache.open(mount.mnt, tenant=tenant, spec=SPEC)
    if not torch.cuda.is_available():
        monkeypatch.setenv("KVFS_IO", "kvikio")
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            KVCache.open(mount.mnt, tenant=tenant, spec=SPEC)
    monkeypatch.delenv("KVFS_IO")
    with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC) as c:
        hashes = c.block_hashes(tokens(1))
        with pytest.raises(ValueError, match="dtype"):
            c.save(hashes, torch.zeros((1, *SPEC.block_shape)))
        with pytest.raises(ValueError, match="contiguous"):
            c.load(hashes, empty(1).transpose(4, 5).contiguous().transpose(4, 5))
        with pytest.raises(ValueError, match="holds 1 blocks"):
            c.load(hashes * 2, empty(1))


def test_vectored_io_survives_short_transfers(tmp_path, monkeypatch):
    """preadv/pwritev may move fewer bytes than asked: the helpers carry on."""
    real_preadv, real_pwritev = os.preadv, os.pwritev

    def short(fn):
        return lambda fd, bufs, off: fn(fd, [bufs[0][:3]] if bufs[0].nbytes > 3 else bufs[:1],
                                        off)

    monkeypatch.setattr(os, "preadv", short(real_preadv))
    monkeypatch.setattr(os, "pwritev", short(real_pwritev))
    data = [memoryview(os.urandom(n)) for n in (10, 0, 7, 4096)]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        transport.pwritev_all(fd, data, 5)
        bufs = [memoryview(bytearray(n)) for n in (10, 0, 7, 4096, 8)]
        assert transport.preadv_all(fd, bufs, 5) == 10 + 7 + 4096
        assert b"".join(bytes(b) for b in bufs[:4]) == b"".join(bytes(d) for d in data)
    finally:
        os.close(fd)
    assert transport.checksum(data) == blockfile.payload_checksum(b"".join(data))
    assert control.MAX_HASHES > 64


@pytest.mark.parametrize("payload", [1000, 3 * transport.HASH_PIECE + 5,
                                     transport.ONE_READ_BYTES + 5])
def test_block_reads_survive_short_transfers(tmp_path, monkeypatch, payload):
    """read_file (header, payload and probe of one block) carries on after short preadv
    transfers, and its byte count still tells the file's length, small or hashed in pieces."""
    data = os.urandom(4096 + payload)
    pad = -payload % 4096
    path = tmp_path / "b"
    real_preadv = os.preadv
    # Short transfers that stop inside a buffer (as a signal may stop one): the payload's
    # end is never a transfer's end here, so the probe's count is exact (see read_file).
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off, *flags: real_preadv(
        fd, [bufs[0][:777]] if bufs[0].nbytes > 777 else bufs, off, *flags))
    for tail, size in ((bytes(pad), 4096 + payload + pad), (bytes(pad + 1), None),
                       (b"", 4096 + payload)):
        path.write_bytes(data + tail)
        header = memoryview(bytearray(4096))
        body = memoryview(bytearray(payload))
        probe = memoryview(bytearray(pad + 1))
        n, csum = transport.read_file(str(path), header, [body], probe, True)
        assert bytes(header) + bytes(body) == data
        assert csum == blockfile.payload_checksum(data[4096:])
        if size is not None:
            assert n == size  # the right length, or short of the padding
        else:
            assert n == 4096 + payload + pad + 1  # longer: the probe is full


@pytest.mark.parametrize("views", [1, 3])
def test_hashed_block_reads_cost_one_transfer_per_piece(tmp_path, monkeypatch, views):
    """A payload hashed in pieces costs one preadv per piece, no more: the header travels with
    the first piece and the probe with the last (every transfer releases and retakes the GIL,
    which waits where I/O threads outnumber cores). The count and checksum stay exact, for
    one destination or several (a paged block)."""
    piece = transport.HASH_PIECE
    payload = transport.ONE_READ_BYTES + 5  # above it: hashed in pieces
    whole = payload // piece
    pad = -payload % 4096
    data = os.urandom(4096 + payload)
    path = tmp_path / "b"
    calls = []
    real_preadv = os.preadv

    def counted(fd, bufs, off, *flags):
        calls.append([b.nbytes for b in bufs])
        return real_preadv(fd, bufs, off, *flags)

    monkeypatch.setattr(os, "preadv", counted)
    cuts = [0, *sorted(int(k * payload / views) for k in range(1, views)), payload]
    for tail, size in ((bytes(pad), 4096 + payload + pad), (bytes(pad + 1), None)):
        path.write_bytes(data + tail)
        calls.clear()
        header = memoryview(bytearray(4096))
        body = memoryview(bytearray(payload))
        parts = [body[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        probe = memoryview(bytearray(pad + 1))
        n, csum = transport.read_file(str(path), header, parts, probe, True)
        assert bytes(header) + bytes(body) == data
        assert csum == blockfile.payload_checksum(data[4096:])
        assert n == (size if size is not None else 4096 + payload + pad + 1)
        assert len(calls) == whole + 1  # the whole pieces and the last 5 bytes
        assert calls[0][0] == 4096 and sum(calls[0]) == 4096 + piece  # header + piece 1
        assert calls[-1][-1] == pad + 1 and sum(calls[-1]) == 5 + pad + 1  # the probe too
    # Cut short inside the third piece: short count, no checksum.
    path.write_bytes(data[:4096 + 2 * piece + 100])
    n, csum = transport.read_file(str(path), memoryview(bytearray(4096)),
                                  [memoryview(bytearray(payload))],
                                  memoryview(bytearray(pad + 1)), True)
    assert (n, csum) == (4096 + 2 * piece + 100, None)


@pytest.mark.parametrize("payload", [4096, transport.HASH_PIECE + 1,
                                     transport.ONE_READ_BYTES])
def test_checksummed_blocks_that_fit_cost_one_transfer(tmp_path, monkeypatch, payload):
    """Up to ONE_READ_BYTES, a checksummed block is read (header, payload and probe) with one
    preadv and hashed whole right after it, as the verified-read baseline does."""
    pad = -payload % 4096
    data = os.urandom(4096 + payload) + bytes(pad)
    path = tmp_path / "b"
    path.write_bytes(data)
    calls = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off, *flags: calls.append(
        off) or real_preadv(fd, bufs, off, *flags))
    body = memoryview(bytearray(payload))
    n, csum = transport.read_file(str(path), memoryview(bytearray(4096)), [body],
                                  memoryview(bytearray(pad + 1)), True)
    assert calls == [0] and n == len(data) and bytes(body) == data[4096:4096 + payload]
    assert csum == blockfile.payload_checksum(data[4096:4096 + payload])


@pytest.mark.parametrize("views", [1, 3])
def test_a_cold_block_is_read_in_one_transfer(tmp_path, monkeypatch, views):
    """A block hashed in pieces asks for each piece without waiting for the disk; when one
    is not in the page cache (here: the file's pages dropped), the rest of the block comes
    in one transfer, as raw preadv reads it, and the count and checksum stay exact. Where
    the filesystem has no RWF_NOWAIT, plain reads."""
    if not transport.NOWAIT:
        pytest.skip("no RWF_NOWAIT here")
    payload = 4 * transport.ONE_READ_BYTES + 5
    pad = -payload % 4096
    data = os.urandom(4096 + payload)
    path = tmp_path / "b"
    path.write_bytes(data + bytes(pad))
    calls = []
    real_preadv = os.preadv

    def counted(fd, bufs, off, *flags):
        calls.append((off, sum(b.nbytes for b in bufs), bool(flags and flags[0])))
        return real_preadv(fd, bufs, off, *flags)

    monkeypatch.setattr(os, "preadv", counted)
    cuts = [0, *sorted(int(k * payload / views) for k in range(1, views)), payload]

    def read() -> tuple[int, int | None, bytes]:
        body = memoryview(bytearray(payload))
        parts = [body[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        header = memoryview(bytearray(4096))
        n, csum = transport.read_file(str(path), header, parts, memoryview(bytearray(pad + 1)),
                                      True)
        return n, csum, bytes(header) + bytes(body)

    drop_cached(path)  # cold
    calls.clear()
    n, csum, got = read()
    assert (n, csum, got) == (len(data) + pad, blockfile.payload_checksum(data[4096:]), data)
    assert calls[0][2] and calls[0][1] == 4096 + transport.HASH_PIECE  # asked without waiting
    blocking = [c for c in calls if not c[2]]
    assert len(blocking) == 1 and blocking[0][1] + blocking[0][0] == len(data) + pad + 1
    calls.clear()
    assert read() == (n, csum, got)  # warm now: one transfer per piece, none blocking
    assert len(calls) == -(-payload // transport.HASH_PIECE) and all(c[2] for c in calls)

    def unsupported(fd, bufs, off, *flags):
        if flags and flags[0]:
            raise OSError(errno.EOPNOTSUPP, "no RWF_NOWAIT")
        return real_preadv(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", unsupported)
    assert read() == (n, csum, got)


def test_header_fast_check_is_never_looser_than_the_decode():
    """The loader's byte comparison (blockfile.HeaderCheck) accepts a header only where the
    full decode and check accept it, and refuses every single-bit flip anywhere in it."""
    spec = SPEC
    check = blockfile.HeaderCheck(fingerprint=spec.fingerprint, token_count=spec.block_size,
                                  dtype=spec.kv_dtype, shape=spec.block_shape)
    h, parent = b"h" * 16, b"p" * 16
    payload = os.urandom(spec.block_payload_bytes)
    head = bytearray(blockfile.encode_parts(
        block_hash=h, parent_hash=parent, fingerprint=spec.fingerprint,
        token_count=spec.block_size, dtype=spec.kv_dtype, shape=spec.block_shape,
        payload=payload)[0])
    assert check.payload_checksum(head, h) == blockfile.payload_checksum(payload)
    assert check.file_size == 4096 + blockfile.padded_size(spec.block_payload_bytes)
    assert check.payload_checksum(head, b"x" * 16) is None  # another block's header
    for bit in range(0, 4096 * 8, 7):
        bad = bytearray(head)
        bad[bit // 8] ^= 1 << bit % 8
        assert check.payload_checksum(bad, h) is None, bit
        with pytest.raises(blockfile.BlockFormatError):
            blockfile.check(blockfile.decode_header(bad), block_hash=h,
                            fingerprint=spec.fingerprint, dtype=spec.kv_dtype,
                            shape=spec.block_shape)
    # A header the full check accepts but the fast one does not know (another token count):
    # the fast check defers (None) and the loader takes the full decode's verdict.
    other = bytearray(blockfile.encode_parts(
        block_hash=h, parent_hash=parent, fingerprint=spec.fingerprint,
        token_count=spec.block_size - 1, dtype=spec.kv_dtype, shape=spec.block_shape,
        payload=payload)[0])
    assert check.payload_checksum(other, h) is None
    blockfile.check(blockfile.decode_header(other), block_hash=h, fingerprint=spec.fingerprint)


def test_a_block_refused_in_a_publish_takes_its_descendants_with_it(mount, tenant, cache):
    """Blocks 0, 1, 2 of a chain published together; block 1's header is damaged: 0 is
    placed, 1 is refused, and 2 is refused too (its prefix is not cached), never a hole."""
    hashes = cache.block_hashes(tokens(3, 500))
    kv = kv_of(hashes)
    parent = hashing.ROOT_PARENT
    for i, h in enumerate(hashes):
        cache._write_block(h, parent, [kv[i]])
        parent = h
    with open(cache.path(hashes[1]), "r+b") as f:
        f.write(b"JUNK")  # the magic
    ns = mount.mnt / tenant / SPEC.namespace
    os.setxattr(ns, control.PUBLISH, control.pack_hashes(hashes))
    assert cache.lookup(hashes) == 1
    assert os.path.exists(cache.path(hashes[0]))
    assert not os.path.exists(cache.path(hashes[1])) and not os.path.exists(cache.path(hashes[2]))


def test_a_lost_index_is_adopted_while_clients_work(mount, tenant):
    """The index deleted between two mounts: the next mount serves the blocks at once and
    indexes them while clients look up, load, save and publish through it."""
    first = tokens(40)
    with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC) as c:
        hashes = c.block_hashes(first)
        c.save(hashes, kv_of(hashes))
    mount.stop()
    for name in ("index.db", "index.db-wal", "index.db-shm"):
        path = mount.backing / ".kvfs" / name
        if path.exists():
            path.unlink()
    mount.start()
    with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC) as c:
        assert c.lookup(hashes) == 40
        out = empty(40)
        assert c.load(hashes, out) == 40 and torch.equal(out, kv_of(hashes))
        more = c.block_hashes(first + tokens(10, start=1000))
        c.save(more, kv_of(more))
        assert c.lookup(more) == 50
    deadline = time.monotonic() + 30
    while mount.stats()["indexing"]["directories_left"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ns = mount.stats()["tenants"][tenant]
    (counters,) = ns.values()
    assert counters["files"] == 50 + 1  # the blocks and the manifest
    assert "adopting" in mount.log_text()
    mount.stop()
    res = kvfs_cli("fsck", str(mount.backing))
    assert " 0 added, 0 dropped, 0 updated" in res.stdout, res.stdout


@pytest.mark.parametrize("how", ["evicted", "removed", "layer-wise"])
def test_a_lookup_leases_its_blocks_to_the_load(mount_factory, monkeypatch, how):
    """Blocks a lookup reported stay loadable until the load reads them: an eviction (a
    save that needs their room, in another client, between the two) or an `rm` through the
    mount takes their names, not their bytes; the load gets every block, verified. Past the
    lease, a lookup's blocks are read by name again (gone: a miss)."""
    from kvfs.client import leases

    mount = mount_factory(extra=["--capacity", "40K"])  # 8 KiB files: four fit
    kvfs_cli("tenant", "add", str(mount.mnt), "acme", "--uid", "0", "--gid", "0")
    with KVCache.open(mount.mnt, tenant="acme", spec=SPEC) as c, \
            KVCache.open(mount.mnt, tenant="acme", spec=SPEC) as other:
        old = c.block_hashes(tokens(4))
        c.save(old, kv_of(old))
        assert c.lookup(old) == 4 and leases.held() >= 4
        if how == "removed":
            for h in old:
                os.unlink(os.path.join(c.ns_dir, hashing.block_relpath(h)))
        else:  # another client's save needs the room: the looked-up blocks are evicted
            new = other.block_hashes(tokens(4, start=1000))
            other.save(new, kv_of(new))
        assert not any(os.path.exists(c.path(h)) for h in old), "nothing was evicted"
        out = empty(4)
        if how == "layer-wise":
            assert c.load_async(old, out).wait(30) == 4
        else:
            assert c.load(old, out) == 4
        assert digest(out) == digest(kv_of(old))
        assert leases.held() == 0 or not any(
            (c.ns_dir, h) in leases._TABLE for h in old)  # the load closed them
        # Past its lease, a lookup's block is read by name.
        monkeypatch.setattr(leases, "LEASE_S", 0.0)
        again = other.block_hashes(tokens(4, start=1000))
        other.save(again, kv_of(again))
        assert c.lookup(again) == 4
        for h in again:
            os.unlink(os.path.join(c.ns_dir, hashing.block_relpath(h)))
        time.sleep(0.01)
        assert c.load(again, empty(4)) == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_cache_used_from_a_bound_thread_does_its_io_on_every_cpu(mount, tenant, monkeypatch):
    """An engine's thread bound to one core (vLLM's CPU build binds its main thread through
    OpenMP) saves and loads through a KVCache: the client's I/O threads run on every CPU the
    process may use (kvfs.client.cpus), not on the engine's core alone."""
    import threading

    monkeypatch.delenv("KVFS_IO_CPUS", raising=False)
    allowed = os.sched_getaffinity(0)
    seen: dict[str, set[int]] = {}

    def engine_thread():
        os.sched_setaffinity(0, {min(allowed)})
        with KVCache.open(mount.mnt, tenant=tenant, spec=SPEC) as c:
            hashes = c.block_hashes(tokens(8))
            c.save(hashes, kv_of(hashes))
            c.flush()
            out = empty(8)
            assert c.lookup(hashes) == 8 and c.load(hashes, out) == 8
            assert torch.equal(out, kv_of(hashes))
            for th in threading.enumerate():
                if th.name.startswith(("kvfs-io", "kvfs-save", "kvfs-load")):
                    seen[th.name] = os.sched_getaffinity(th.native_id)

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert seen, "no I/O thread of the client found"
    assert all(cpus == allowed for cpus in seen.values()), seen
