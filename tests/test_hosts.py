"""Three hosts share one bucket: separate daemons and backing directories, and where a test
needs a host it can cut off, a network namespace of its own (a veth pair to this one) in
which that host's daemon and client run, reaching the store over its own link."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvfs.bench.harness import FaultProxy

from .conftest import kvfs
from .s3server import s3  # noqa: F401 - the fixture

torch = pytest.importorskip("torch")

import kvfs as kv  # noqa: E402
from kvfs.format import blockfile, hashing  # noqa: E402

from .kvload import content, spec  # noqa: E402

MODEL = "org/hosts"
SPEC = spec(MODEL)
HERE = Path(__file__).parent


class Netns:
    """Network namespace ``name`` with a veth pair to this one: 10.231.``i``.1 here,
    .2 there. ``cut()`` takes this side's end down (the other host's packets go nowhere:
    a network that fails silently, as a pulled cable does); ``mend()`` brings it back."""

    def __init__(self, name: str, i: int) -> None:
        self.name, self.here, self.there = name, f"10.231.{i}.1", f"10.231.{i}.2"
        self.link = f"kvh{i}"

    @property
    def prefix(self) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.name}"]

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def __enter__(self) -> Netns:
        self.__exit__()
        try:
            self._ip("netns", "add", self.name)
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"no network namespaces here ({exc})")
        self._ip("link", "add", self.link, "type", "veth", "peer", "name", self.link + "p")
        self._ip("link", "set", self.link + "p", "netns", self.name)
        self._ip("addr", "add", f"{self.here}/30", "dev", self.link)
        self._ip("link", "set", self.link, "up")
        self._ip("-n", self.name, "addr", "add", f"{self.there}/30", "dev", self.link + "p")
        self._ip("-n", self.name, "link", "set", self.link + "p", "up")
        self._ip("-n", self.name, "link", "set", "lo", "up")
        return self

    def cut(self) -> None:
        self._ip("link", "set", self.link, "down")

    def mend(self) -> None:
        self._ip("link", "set", self.link, "up")

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "link", "del", self.link], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


class Host:
    """A host's client process (hostload.py), in its network namespace if it has one."""

    def __init__(self, mnt: Path, prefix: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
        env.pop("PYTHONSAFEPATH", None)
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(HERE / "hostload.py"), str(mnt), "t", MODEL],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, cwd=str(HERE))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", (line, self.proc.stderr.read() if self.proc.stderr
                                         else "")

    def load(self, hashes: list[bytes]) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([h.hex() for h in hashes]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read() if self.proc.stderr else "the client died"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def context(first: int, blocks: int) -> list[bytes]:
    return hashing.block_hashes(list(range(first, first + 16 * blocks)), 16)


def save(m, hashes: list[bytes]) -> None:
    with kv.KVCache.open(m.mnt, tenant="t", spec=SPEC) as c:
        c.save(hashes, content(SPEC, hashes))
        c.flush()


def keys_of(hashes: list[bytes]) -> list[str]:
    return [f"t/{SPEC.namespace}/{hashing.block_relpath(h)}" for h in hashes]


def wait_in_bucket(s3, hashes: list[bytes], timeout: float = 30.0) -> dict[str, dict]:  # noqa: F811
    """The bucket's objects of these blocks (key suffix: object), once all are there."""
    client, deadline = s3.client(), time.monotonic() + timeout
    want = keys_of(hashes)
    while True:
        objs = client.list_objects_v2(Bucket=s3.bucket).get("Contents", [])
        found = {k: o for k in want for o in objs if o["Key"].endswith(k)}
        if len(found) == len(want):
            return found
        assert time.monotonic() < deadline, f"{len(want) - len(found)} blocks never uploaded"
        time.sleep(0.1)


def add_tenant(m) -> None:
    kvfs("tenant", "add", str(m.mnt), "t", "--uid", "0", "--gid", "0")


@pytest.mark.mount
def test_a_host_cut_off_from_the_store_gets_misses_in_time_and_nothing_wrong(
        mount_factory, s3):  # noqa: F811
    """Hosts A and B on this network, C in its own namespace reaching the store over a link
    of its own. A saves; C and B restore. C's link goes down mid-run: C's lookups come back
    within their deadline with misses (and its hot copies still load), B keeps restoring
    from the store; once C's link is back, C restores again."""
    with Netns("kvfs-host-c", 7) as net:
        host, port = s3.endpoint.removeprefix("http://").split(":")
        link = FaultProxy((host, int(port)), host=net.here)  # the store, as C reaches it
        try:
            tier = ["--fetch-timeout", "2", "--tier-cooldown", "1"]
            a = mount_factory("a", extra=["--shared", s3.url, *tier])
            b = mount_factory("b", extra=["--shared", s3.url, *tier])
            c = mount_factory("c", extra=["--shared", s3.url.replace(s3.endpoint,
                                                                     link.endpoint), *tier],
                              start=False)
            c.prefix = net.prefix
            c.start()
            for m in (a, b, c):
                add_tenant(m)
            first, second, third = context(0, 6), context(10_000, 6), context(20_000, 6)
            save(a, first + second + third)
            wait_in_bucket(s3, first + second + third)
            on_c = Host(c.mnt, net.prefix)
            on_b = Host(b.mnt, [])
            try:
                got = on_c.load(first)
                assert got == {**got, "found": 6, "loaded": 6, "right": True}, got
                assert c.stats()["tiers"][0]["grants"] == 6  # from the store, over C's link
                net.cut()
                got = on_c.load(second)
                assert got["loaded"] == 0 and got["right"], got
                assert got["seconds"] < 10, f"a cut-off host waited {got['seconds']} s"
                got = on_c.load(first)  # now hot on C: the store is not needed
                assert got == {**got, "found": 6, "loaded": 6, "right": True}, got
                got = on_b.load(second)  # the others are not held up
                assert got == {**got, "found": 6, "loaded": 6, "right": True}, got
                net.mend()
                deadline = time.monotonic() + 30
                while True:
                    got = on_c.load(third)
                    assert got["right"], got
                    if got["loaded"] == 6:
                        break
                    assert time.monotonic() < deadline, (got, c.stats()["tiers"][0])
                    time.sleep(0.5)
            finally:
                on_c.close()
                on_b.close()
        finally:
            link.close()


@pytest.mark.mount
def test_two_hosts_saving_one_block_at_once_leave_one_object_every_reader_verifies(
        mount_factory, s3):  # noqa: F811
    """A and B save the same context at the same moment (write-through to the same keys);
    the bucket is left one object per block, complete, and a third host restores every
    block of it right."""
    tier = ["--shared", s3.url, "--fetch-timeout", "2", "--tier-cooldown", "1"]
    a, b, c = (mount_factory(n, extra=tier) for n in ("a", "b", "c"))
    for m in (a, b, c):
        add_tenant(m)
    for round_ in range(3):
        hashes = context(100_000 * (round_ + 1), 8)
        go = threading.Barrier(2)
        errors: list[BaseException] = []

        def saver(m, hashes=hashes, go=go, errors=errors) -> None:
            try:
                kv_in = content(SPEC, hashes)
                with kv.KVCache.open(m.mnt, tenant="t", spec=SPEC) as cache:
                    go.wait(10)
                    cache.save(hashes, kv_in)
                    cache.flush()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=saver, args=(m,)) for m in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        objs = wait_in_bucket(s3, hashes)
        client = s3.client()
        sizes = set()
        for key, o in objs.items():
            matching = [x for x in client.list_objects_v2(Bucket=s3.bucket, Prefix=o["Key"])
                        .get("Contents", []) if x["Key"] == o["Key"]]
            assert len(matching) == 1, matching
            body = client.get_object(Bucket=s3.bucket, Key=o["Key"])["Body"].read()
            assert len(body) == o["Size"], key
            blockfile.verify_file(body)  # whole: header, size, checksums, padding
            sizes.add(len(body))
        assert len(sizes) == 1  # every block the same size: each one whole
        reader = Host(c.mnt, [])
        try:
            got = reader.load(hashes)
        finally:
            reader.close()
        assert got == {**got, "found": 8, "loaded": 8, "right": True}, got
        tiers = c.stats()["tiers"][0]
        assert tiers["grants"] >= 8 * (round_ + 1)
    for m in (a, b):
        t = m.stats()["tiers"][0]
        assert t.get("upload_failures", 0) == 0, t
