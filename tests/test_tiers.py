"""The lower tiers against real storage: a directory, and a real S3 server (SeaweedFS).

Also the circuit breaker (with a fake clock), tier URLs and fetch deadlines.
"""

from __future__ import annotations

import os
import re
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvfs.daemon.tiers import (
    Breaker,
    DirTier,
    S3Tier,
    Tier,
    TierError,
    fetch_deadline,
    parse_tier_url,
)
from kvfs.format import blockfile, hashing
from kvfs.format.config import ConfigError

from . import s3server

s3 = s3server.s3  # the fixture

NS = "alice/llama-3-8b.0123456789abcdef"
FP = bytes(range(16))


def make_block(path: Path, seed: int, tokens: int = 16, heads: int = 8) -> str:
    """A real block file at `path` (float16 K and V for `tokens` tokens); returns its key."""
    block_hash = hashing.block_hashes(range(seed, seed + tokens), tokens)[0]
    shape = (2, tokens, heads, 64)
    payload = bytes((seed + i) % 251 for i in range(2 * tokens * heads * 64 * 2))
    path.write_bytes(blockfile.encode(
        block_hash=block_hash, parent_hash=bytes(16), fingerprint=FP, token_count=tokens,
        dtype="float16", shape=shape, payload=payload))  # fmt: skip
    return f"{NS}/{hashing.block_relpath(block_hash)}"


@pytest.fixture(params=["dir", pytest.param("s3", marks=pytest.mark.mount)])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    if request.param == "dir":
        t: Tier = DirTier(str(tmp_path / "cold"))
    else:
        t = parse_tier_url(request.getfixturevalue("s3").url, "shared")
    yield t
    t.close()


def test_round_trip(tier: Tier, tmp_path: Path) -> None:
    keys = {}
    for seed in range(3):
        src = tmp_path / f"src{seed}"
        keys[make_block(src, seed)] = src
    for key, src in keys.items():
        assert not tier.exists(key)
        assert tier.size(key) is None
        assert tier.put(key, str(src)) is True
        assert tier.exists(key)
        assert tier.size(key) == src.stat().st_size
    for key, src in keys.items():
        dest = tmp_path / "dest"
        assert tier.get(key, str(dest)) is True
        assert dest.read_bytes() == src.read_bytes()
        h, _ = blockfile.decode(dest.read_bytes())
        assert key.endswith(h.block_hash.hex() + ".kv")
        # Into memory (a fetch): the same bytes, in one buffer; over its limit, refused.
        got = tier.read(key, 1 << 30)
        assert isinstance(got, bytearray) and got == src.read_bytes()
        with pytest.raises(TierError):
            tier.read(key, src.stat().st_size - 1)
    listed = dict(tier.list())
    assert listed == {k: s.stat().st_size for k, s in keys.items()}
    assert dict(tier.list(NS + "/")) == listed
    one = sorted(keys)[0]
    assert [k for k, _ in tier.list(one[: len(NS) + 3])] == [one]
    assert list(tier.list("bob/")) == []
    assert tier.usage() == (sum(s.stat().st_size for s in keys.values()), 3)
    tier.delete(one)
    tier.delete(one)
    assert not tier.exists(one)
    assert tier.usage()[1] == 2
    assert [p for p in os.listdir(tmp_path) if p.startswith(".kvfs-tmp.")] == []


def test_absent_key(tier: Tier, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    assert tier.get(f"{NS}/00/{'0' * 32}.kv", str(dest)) is False
    assert not dest.exists()
    assert tier.size(f"{NS}/00/{'0' * 32}.kv") is None
    assert tier.read(f"{NS}/00/{'0' * 32}.kv", 1 << 30) is None
    tier.delete(f"{NS}/00/{'0' * 32}.kv")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".kvfs-tmp.")] == []


def test_put_is_idempotent(tier: Tier, tmp_path: Path) -> None:
    key = make_block(tmp_path / "a", 1)
    make_block(tmp_path / "b", 2)  # other bytes, offered under the same key
    assert tier.put(key, str(tmp_path / "a")) is True
    assert tier.put(key, str(tmp_path / "b")) is False
    assert tier.get(key, str(tmp_path / "dest"))
    assert (tmp_path / "dest").read_bytes() == (tmp_path / "a").read_bytes()


def test_concurrent_puts_of_one_key(tier: Tier, tmp_path: Path) -> None:
    srcs = [tmp_path / f"src{i}" for i in range(8)]
    key = make_block(srcs[0], 7)
    for i, src in enumerate(srcs[1:], 1):
        make_block(src, 7 + i)  # distinct bytes, so the winner is known
    barrier = threading.Barrier(len(srcs))

    def put(src: Path) -> bool:
        barrier.wait()
        return tier.put(key, str(src))

    with ThreadPoolExecutor(len(srcs)) as pool:
        results = list(pool.map(put, srcs))
    assert results.count(True) == 1
    winner = srcs[results.index(True)]
    with ThreadPoolExecutor(len(srcs)) as pool:
        seen = list(pool.map(lambda i: tier.get(key, str(tmp_path / f"dest{i}")), range(8)))
    assert all(seen)
    for i in range(8):
        assert (tmp_path / f"dest{i}").read_bytes() == winner.read_bytes()
    assert [k for k, _ in tier.list()] == [key]


def test_bad_keys_are_refused(tier: Tier, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"x")
    for key in ("", "/abs/x.kv", "a//b.kv", "a/../b.kv", "./a.kv", "a/.kvfs-tmp.x"):
        with pytest.raises(ValueError):
            tier.put(key, str(src))
        with pytest.raises(ValueError):
            tier.get(key, str(tmp_path / "dest"))


# -- the directory tier ---------------------------------------------------------------------


def test_dir_tier_layout_and_modes(tmp_path: Path) -> None:
    tier = DirTier(str(tmp_path / "cold"))
    key = make_block(tmp_path / "src", 3)
    os.chmod(tmp_path / "src", 0o644)
    assert tier.put(key, str(tmp_path / "src"))
    path = tmp_path / "cold" / key
    assert path.read_bytes() == (tmp_path / "src").read_bytes()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for d in (path.parent, path.parent.parent, tmp_path / "cold"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    # A stray temporary (a writer that died) is not an object.
    (path.parent / ".kvfs-tmp.dead").write_bytes(b"partial")
    assert [k for k, _ in tier.list()] == [key]
    assert tier.usage() == (path.stat().st_size, 1)
    assert tier.url == f"dir://{tmp_path / 'cold'}"


def test_dir_tier_errors_are_tier_errors(tmp_path: Path) -> None:
    tier = DirTier(str(tmp_path / "cold"))
    key = make_block(tmp_path / "src", 4)
    with pytest.raises(TierError) as info:
        tier.put(key, str(tmp_path / "missing"))
    assert info.value.tier == "cold" and "put" in str(info.value)
    assert tier.put(key, str(tmp_path / "src"))
    with pytest.raises(TierError):
        tier.get(key, str(tmp_path / "no-such-dir" / "dest"))
    assert [p.name for p in (tmp_path / "cold" / key).parent.iterdir()] == [key.split("/")[-1]]


# -- the S3 tier ------------------------------------------------------------------------------


def s3_tier(s3, **kw) -> S3Tier:
    kw.setdefault("connect_timeout", 1.0)
    kw.setdefault("read_timeout", 1.0)
    kw.setdefault("max_attempts", 1)
    return S3Tier(s3.bucket, s3.prefix, endpoint=s3.endpoint, region="us-east-1", **kw)


def test_s3_objects_are_under_the_prefix(s3, tmp_path: Path) -> None:
    key = make_block(tmp_path / "src", 5)
    a, b = s3_tier(s3), S3Tier(s3.bucket, "other", endpoint=s3.endpoint)
    assert a.put(key, str(tmp_path / "src"))
    assert not b.exists(key)
    assert [k for k, _ in a.list()] == [key]
    assert list(b.list()) == []
    raw = s3.client()
    assert [o["Key"] for o in raw.list_objects_v2(Bucket=s3.bucket)["Contents"]] == \
        [f"{s3.prefix}/{key}"]


def test_s3_list_pages(s3, tmp_path: Path) -> None:
    raw = s3.client(max_pool_connections=16)
    keys = [f"{NS}/{i % 256:02x}/{i:032x}.kv" for i in range(1003)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: raw.put_object(Bucket=s3.bucket, Key=f"{s3.prefix}/{k}",
                                               Body=b"abc"), keys))
    tier = s3_tier(s3)
    assert [k for k, _ in tier.list()] == sorted(keys)
    assert tier.usage() == (3 * len(keys), len(keys))


def test_s3_store_down_fails_fast_and_recovers(s3, tmp_path: Path) -> None:
    tier = s3_tier(s3)
    key = make_block(tmp_path / "src", 6)
    other = make_block(tmp_path / "src2", 16)
    assert tier.put(key, str(tmp_path / "src"))

    def fails_fast(what: str, fn, *args) -> None:
        t0 = time.monotonic()
        with pytest.raises(TierError) as info:
            fn(*args)
        took = time.monotonic() - t0
        assert took < 10, f"{what} took {took:.1f}s"
        assert info.value.tier == "shared"

    s3.stop()
    fails_fast("get (down)", tier.get, key, str(tmp_path / "dest"))
    fails_fast("read (down)", tier.read, key, 1 << 30)
    fails_fast("put (down)", tier.put, other, str(tmp_path / "src2"))
    fails_fast("exists (down)", tier.exists, key)
    fails_fast("list (down)", lambda: list(tier.list()))
    s3.start()
    assert tier.get(key, str(tmp_path / "dest"))
    assert (tmp_path / "dest").read_bytes() == (tmp_path / "src").read_bytes()
    # Accepting connections but never answering: the read timeout ends each call.
    assert tier.read(key, 1 << 30) == (tmp_path / "src").read_bytes()
    s3.freeze()
    fails_fast("get (frozen)", tier.get, key, str(tmp_path / "dest2"))
    fails_fast("read (frozen)", tier.read, key, 1 << 30)
    fails_fast("put (frozen)", tier.put, other, str(tmp_path / "src2"))
    s3.thaw()
    assert not (tmp_path / "dest2").exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".kvfs-tmp.")] == []
    # Recovered within seconds: the store's own servers were stopped with it, and its first
    # answers after the thaw may take longer than this tier's 1 s read timeout.
    deadline = time.monotonic() + 20
    while True:
        try:
            assert tier.put(other, str(tmp_path / "src2")) in (True, False)  # the frozen
            break  # PUT may have landed
        except TierError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert tier.exists(other)


def test_s3_without_conditional_put(s3, tmp_path: Path) -> None:
    """A store that answers 501 to If-None-Match: the tier falls back to HEAD then PUT."""
    tier = s3_tier(s3)
    refused = []
    real = tier._connection

    class NotImplemented501:
        status, reason = 501, "Not Implemented"

        def read(self) -> bytes:
            return (b"<Error><Code>NotImplemented</Code><Message>A header you provided "
                    b"implies functionality that is not implemented</Message></Error>")

    class NoConditionals:
        """The tier's connection, but a conditional PUT gets the 501 of such a store."""

        def __init__(self, u) -> None:
            self.conn, self.fake = real(u), False

        def request(self, method, target, body=None, headers=None) -> None:
            self.fake = method == "PUT" and "If-None-Match" in (headers or {})
            if self.fake:
                refused.append(target)
            else:
                self.conn.request(method, target, body=body, headers=headers or {})

        def getresponse(self):
            return NotImplemented501() if self.fake else self.conn.getresponse()

        def close(self) -> None:
            self.conn.close()

    tier._connection = NoConditionals
    key = make_block(tmp_path / "a", 8)
    make_block(tmp_path / "b", 9)
    assert tier.put(key, str(tmp_path / "a")) is True
    assert len(refused) == 1
    assert tier.put(key, str(tmp_path / "b")) is False
    other = make_block(tmp_path / "c", 10)
    assert tier.put(other, str(tmp_path / "c")) is True
    assert len(refused) == 1  # remembered: no second conditional attempt
    assert tier.get(key, str(tmp_path / "dest"))
    assert (tmp_path / "dest").read_bytes() == (tmp_path / "a").read_bytes()


def test_s3_upload_is_one_request_and_never_replaces(s3, tmp_path: Path) -> None:
    """A write-through upload (``probe=False``) is one conditional PUT, no HEAD; a demotion's
    put asks first and sends nothing where the block is there; a key that is there is never
    replaced either way."""
    tier = s3_tier(s3)
    sent: list[tuple[str, int]] = []
    real = tier._connection

    class Counting:
        def __init__(self, u) -> None:
            self.conn = real(u)

        def request(self, method, target, body=None, headers=None) -> None:
            sent.append((method, len(body) if body else 0))
            self.conn.request(method, target, body=body, headers=headers or {})

        def getresponse(self):
            return self.conn.getresponse()

        def close(self) -> None:
            self.conn.close()

    tier._connection = Counting
    key = make_block(tmp_path / "a", 8)
    make_block(tmp_path / "b", 9)
    size = (tmp_path / "a").stat().st_size
    assert tier.put(key, str(tmp_path / "a"), probe=False) is True
    assert sent == [("PUT", size)]
    assert tier.put(key, str(tmp_path / "b"), probe=False) is False  # the store's 412
    assert [m for m, _ in sent] == ["PUT", "PUT"]
    assert tier.put(key, str(tmp_path / "b")) is False  # asked first: nothing sent
    assert sent[2:] == [("HEAD", 0)]
    other = make_block(tmp_path / "c", 10)
    assert tier.put(other, str(tmp_path / "c")) is True
    assert [m for m, _ in sent[3:]] == ["HEAD", "PUT"]
    assert tier.get(key, str(tmp_path / "dest"))
    assert (tmp_path / "dest").read_bytes() == (tmp_path / "a").read_bytes()


def test_s3_bad_credentials(s3, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    tier = s3_tier(s3)
    key = make_block(tmp_path / "src", 10)
    with pytest.raises(TierError, match="SignatureDoesNotMatch|AccessDenied|Forbidden|403"):
        tier.put(key, str(tmp_path / "src"))
    with pytest.raises(TierError):
        tier.get(key, str(tmp_path / "dest"))
    with pytest.raises(TierError, match="403"):
        tier.read(key, 1 << 30)  # refused, never a miss


def test_s3_create_bucket(s3, tmp_path: Path) -> None:
    name = s3.bucket + "-new"
    tier = S3Tier(name, "p", endpoint=s3.endpoint, region="us-east-1", create_bucket=True)
    S3Tier(name, "p", endpoint=s3.endpoint, region="us-east-1", create_bucket=True).close()
    key = make_block(tmp_path / "src", 11)
    assert tier.put(key, str(tmp_path / "src"))
    assert [k for k, _ in tier.list()] == [key]
    absent = S3Tier(s3.bucket + "-absent", "p", endpoint=s3.endpoint, region="us-east-1")
    with pytest.raises(TierError, match="NoSuchBucket"):
        absent.put(key, str(tmp_path / "src"))


# -- URLs, deadlines, the breaker ----------------------------------------------------------------


def test_parse_tier_url(tmp_path: Path) -> None:
    t = parse_tier_url(f"dir://{tmp_path}/cold%20tier", "cold")
    assert isinstance(t, DirTier) and t.root == f"{tmp_path}/cold tier" and t.name == "cold"
    assert (tmp_path / "cold tier").is_dir()
    s = parse_tier_url("s3://kv-cache/prod/v1?endpoint=http://127.0.0.1:9&region=eu-west-1"
                       "&connect_timeout=0.5&read_timeout=3&max_attempts=1", "shared")
    assert isinstance(s, S3Tier)
    assert (s.bucket, s.prefix, s.name) == ("kv-cache", "prod/v1", "shared")
    cfg = s._client.meta.config
    assert (cfg.connect_timeout, cfg.read_timeout) == (0.5, 3.0)
    assert cfg.retries["total_max_attempts"] == 1
    assert s._client.meta.endpoint_url == "http://127.0.0.1:9"
    assert s._client.meta.region_name == "eu-west-1"
    assert parse_tier_url("s3://kv-cache", "shared").prefix == ""


@pytest.mark.parametrize("url, why", [
    ("cold", "unsupported scheme"),
    ("file:///srv/cold", "unsupported scheme"),
    ("dir://srv/cold", "absolute path"),
    ("dir:///", "refusing /"),
    ("dir:///srv/cold?fsync=1", "no ?options"),
    ("s3://", "bad bucket"),
    ("s3://Bad_Bucket/x", "bad bucket"),
    ("s3://kv/x", "bad bucket"),
    ("s3://kv-cache/a/../b", "bad prefix"),
    ("s3://kv-cache/p?endpoint=localhost:9000", "endpoint must be"),
    ("s3://kv-cache/p?read_timeout=soon", "read_timeout"),
    ("s3://kv-cache/p?connect_timeout=0", "connect_timeout"),
    ("s3://kv-cache/p?max_attempts=0", "max_attempts"),
    ("s3://kv-cache/p?region=us-east-1&region=eu-west-1", "given twice"),
    ("s3://kv-cache/p?secret=x", "unknown option 'secret'"),
    ("s3://kv-cache/p?endpoint", "cannot parse"),
    ("s3://kv-cache/p#frag", "fragment"),
])  # fmt: skip
def test_parse_tier_url_refuses(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)) as info:
        parse_tier_url(url, "cold")
    assert isinstance(info.value, ConfigError)
    assert repr(url) in str(info.value)


def test_fetch_deadline() -> None:
    sizes = [0, 4096, 1 << 20, 64 << 20, 512 << 20]
    deadlines = [fetch_deadline(s) for s in sizes]
    assert deadlines == sorted(deadlines) and len(set(deadlines)) == len(deadlines)
    assert deadlines[0] == 0.5
    assert fetch_deadline(200_000_000) == pytest.approx(1.5)
    assert fetch_deadline(100, floor=2, bandwidth=100) == 3
    with pytest.raises(ValueError):
        fetch_deadline(-1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_breaker_state_machine() -> None:
    clock = FakeClock()
    b = Breaker(threshold=3, cooldown=10, clock=clock)
    assert b.state == "closed" and b.allow()
    b.failure()
    b.failure()
    b.success()  # a success resets the run of failures
    b.failure()
    b.failure()
    assert b.state == "closed" and b.allow() and b.opens == 0
    b.failure()
    assert b.state == "open" and b.opens == 1 and b.failures == 5
    assert not b.allow()
    clock.now += 9.9
    assert not b.allow() and b.rejected == 2
    clock.now += 0.1
    assert b.state == "half-open"
    assert b.allow()  # the one probe
    assert not b.allow()  # nobody else while it runs
    b.failure()  # the probe failed: open again for a full cooldown
    assert b.state == "open" and b.opens == 2
    clock.now += 10
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.allow()


def test_breaker_replaces_a_lost_probe() -> None:
    clock = FakeClock()
    b = Breaker(threshold=1, cooldown=5, clock=clock)
    b.failure()
    clock.now += 5
    assert b.allow() and not b.allow()
    clock.now += 4.9
    assert not b.allow()
    clock.now += 0.1
    assert b.allow()  # the first probe never reported back


def test_breaker_is_thread_safe() -> None:
    clock = FakeClock()
    b = Breaker(threshold=1000, cooldown=5, clock=clock)
    threads = [threading.Thread(target=lambda: [b.failure() for _ in range(500)])
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.failures == 4000 and b.opens == 1 and b.state == "open"
    clock.now += 5
    allowed = []
    threads = [threading.Thread(target=lambda: allowed.append(b.allow())) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert allowed.count(True) == 1
