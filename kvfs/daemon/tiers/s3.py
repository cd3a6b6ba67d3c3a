"""The S3 tier: objects in an S3-compatible bucket, shared by every host.

A slow or dead store must not hang a request: the client has connect and read timeouts and
few retries. boto3 is imported only when an S3 tier is built.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from .base import Tier, TierError, check_key, temp_beside, unlink_quietly
from .presign import presign

log = logging.getLogger(__name__)


class S3Tier(Tier):
    """Objects at ``<prefix>/<key>`` in an S3-compatible bucket, shared by every host.

    One boto3 client serves all threads (boto3 clients are thread-safe). Credentials come from
    boto3's default chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, the config
    files, instance metadata. `connect_timeout`, `read_timeout` (seconds, per socket operation)
    and `max_attempts` (total tries) bound how long a dead or stalled store can hold a thread.
    Constructing the tier makes no request unless `create_bucket` is set.
    """

    presigns = True

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        name: str = "shared",
        connect_timeout: float = 2.0,
        read_timeout: float = 5.0,
        max_attempts: int = 2,
        create_bucket: bool = False,
    ) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise TierError(name, "open", f"s3://{bucket}",
                            "the S3 tier needs boto3 (pip install 'kvfs[s3]')") from exc
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.name = name
        query = {"endpoint": endpoint, "region": region}
        q = "&".join(f"{k}={v}" for k, v in query.items() if v)
        self.url = f"s3://{bucket}/{self.prefix}" + (f"?{q}" if q else "")
        config = Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            max_pool_connections=32,
            # Self-hosted stores (SeaweedFS, MinIO, Ceph) rarely have per-bucket host names.
            s3={"addressing_style": "path" if endpoint else "auto"},
        )
        session = self._session = boto3.session.Session()
        self._client = session.client("s3", endpoint_url=endpoint, region_name=region,
                                      config=config)
        self._region = region
        self._creds: tuple[float, Any] | None = None  # (when read, frozen credentials)
        self._creds_lock = threading.Lock()
        self._tls = threading.local()  # each thread's keep-alive connection for HEADs
        self._read_timeout = read_timeout
        self._max_attempts = max_attempts
        #: Whether the store honours `If-None-Match: *` on PUT; cleared on its first refusal.
        self._conditional = True
        if create_bucket:
            self._create_bucket()

    # -- helpers ------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, op: str, key: str, exc: BaseException) -> TierError:
        return TierError(self.name, op, key, exc)

    def _create_bucket(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except ClientError as exc:
            if _status(exc) != 404:
                raise self._error("head-bucket", self.bucket, exc) from exc
        except BotoCoreError as exc:
            raise self._error("head-bucket", self.bucket, exc) from exc
        kw: dict[str, Any] = {}
        if self._region and self._region != "us-east-1":
            kw["CreateBucketConfiguration"] = {"LocationConstraint": self._region}
        try:
            self._client.create_bucket(Bucket=self.bucket, **kw)
        except ClientError as exc:
            if _code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self._error("create-bucket", self.bucket, exc) from exc
        except BotoCoreError as exc:
            raise self._error("create-bucket", self.bucket, exc) from exc

    def _head(self, key: str, op: str) -> int | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self._client.head_object(Bucket=self.bucket, Key=self._key(key))[
                "ContentLength"]
        except ClientError as exc:
            if _status(exc) == 404:
                return None
            raise self._error(op, key, exc) from exc
        except BotoCoreError as exc:
            raise self._error(op, key, exc) from exc

    # -- the Tier API ---------------------------------------------------------------------

    def put(self, key: str, src: str | bytes | bytearray, *, probe: bool = True) -> bool:
        """A conditional PUT (`If-None-Match: *`): the store itself refuses a key that is
        already there (412, False), so writers on many hosts need no coordination and a
        block is never replaced. A HEAD goes first where ``probe`` is set (a demotion: the
        block may have been published when it was saved, and the HEAD saves sending it
        again), not for a write-through upload: a block this host has just saved, after a
        lookup missed it, is almost never there, and the HEAD cost every upload a round trip
        and the store a second request; a duplicate (two hosts computing the same prefix at
        once) costs its body sent once more. With a store that does not implement
        conditional writes (501, or an older botocore) it is always a HEAD, then a plain
        PUT: two racing writers may both write, harmless for immutable, content-named
        blocks."""
        from botocore.exceptions import BotoCoreError, ClientError, ParamValidationError

        full = self._key(key)
        if (probe or not self._conditional) and self.size(key) is not None:
            return False
        if (done := self._put_presigned(key, src)) is not None:
            return done
        for _ in range(3):
            conditional = self._conditional
            try:
                with (contextlib.nullcontext(src) if not isinstance(src, str)
                      else open(src, "rb")) as f:
                    kw = {"IfNoneMatch": "*"} if conditional else {}
                    self._client.put_object(Bucket=self.bucket, Key=full, Body=f, **kw)
                return True
            except ParamValidationError as exc:
                if not conditional:
                    raise self._error("put", key, exc) from exc
                if self._no_conditionals(key, "this botocore cannot send If-None-Match"):
                    return False
            except ClientError as exc:
                status, code = _status(exc), _code(exc)
                if status == 412 or code == "PreconditionFailed":
                    return False
                if status == 409 and code == "ConditionalRequestConflict":
                    continue  # a concurrent conditional write of this key: ask again
                if conditional and (status == 501 or code == "NotImplemented"):
                    if self._no_conditionals(key, "the store does not support conditional PUT"):
                        return False
                    continue
                raise self._error("put", key, exc) from exc
            except (BotoCoreError, OSError) as exc:
                raise self._error("put", key, exc) from exc
        return False

    def _no_conditionals(self, key: str, why: str) -> bool:
        """Conditional PUTs refused (``why``): from now on HEAD, then a plain PUT. Whether
        `key` is there already (then nothing is sent)."""
        log.warning("%s tier: %s; using HEAD then PUT", self.name, why)
        self._conditional = False
        return self.size(key) is not None

    def _put_presigned(self, key: str, src: str | bytes | bytearray) -> bool | None:
        """The PUT as a presigned URL sent with http.client on this thread's connection (on
        the same objects the fastest client's PUT, ``kvfs bench s3clients``; boto3's spends
        twice the CPU: payload hashing, a CRC, 100-continue). None where there are no
        credentials to sign with (then boto3's)."""
        url = self._presign("PUT", key, 300)
        if url is None:
            return None
        u = urlsplit(url)
        body = None if isinstance(src, str) else src
        for attempt in range(2 * self._max_attempts + 1):
            if body is None:
                with open(src, "rb") as f:  # a path the daemon alone writes (staging)
                    body = f.read()
            headers = {"Content-Length": str(len(body))}
            if self._conditional:
                headers["If-None-Match"] = "*"
            try:
                resp = self._round_trip(u, "PUT", body, headers)
                text = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                self._drop()
                if attempt + 1 >= self._max_attempts:
                    raise self._error("put", key, exc) from exc
                continue
            if resp.status == 200:
                return True
            if resp.status == 412:
                return False  # another host wrote it first
            if resp.status == 409 and b"ConditionalRequestConflict" in text:
                continue  # a concurrent conditional write of this key: ask again
            if self._conditional and resp.status == 501:
                if self._no_conditionals(key, "the store does not support conditional PUT"):
                    return False
                continue
            if resp.status < 500 or attempt + 1 >= self._max_attempts:
                raise self._error("put", key, f"HTTP {resp.status} {resp.reason}: "
                                  f"{text[:200].decode(errors='replace')}")
        return False

    def _connection(self, u: Any) -> http.client.HTTPConnection:
        conn = getattr(self._tls, "conn", None)
        if conn is None:
            cls = (http.client.HTTPSConnection if u.scheme == "https"
                   else http.client.HTTPConnection)
            conn = self._tls.conn = cls(u.netloc, timeout=self._read_timeout,
                                        blocksize=1 << 20)
        return conn

    def _round_trip(self, u: Any, method: str, body: Any = None,
                    headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
        """One presigned request (``u``, split) on this thread's kept-alive connection, up
        to its answer's headers."""
        conn = self._connection(u)
        conn.request(method, f"{u.path}?{u.query}", body=body, headers=headers or {})
        return conn.getresponse()

    def _drop(self) -> None:
        """Close this thread's connection (after a failure: it may be mid-answer)."""
        conn, self._tls.conn = getattr(self._tls, "conn", None), None
        if conn is not None:
            conn.close()

    def get(self, key: str, dest: str) -> bool:
        """One GET, streamed into a temporary beside `dest`, then renamed over it."""
        from botocore.exceptions import BotoCoreError, ClientError

        tmp = None
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            body = resp["Body"]
            try:
                tmp, fd = temp_beside(dest)
                with os.fdopen(fd, "wb") as out:
                    for chunk in body.iter_chunks(1 << 20):
                        out.write(chunk)
            finally:
                body.close()
            os.rename(tmp, dest)
            tmp = None
            return True
        except ClientError as exc:
            if _status(exc) == 404 or _code(exc) == "NoSuchKey":
                return False
            raise self._error("get", key, exc) from exc
        except (BotoCoreError, OSError) as exc:
            raise self._error("get", key, exc) from exc
        finally:
            if tmp is not None:
                unlink_quietly(tmp)

    def read(self, key: str, limit: int) -> bytearray | None:
        """One GET, presigned and sent with http.client on this thread's kept-alive
        connection, its body read straight into one buffer of its Content-Length (boto3's,
        through a temporary file, where there are no credentials to sign with)."""
        url = self._presign("GET", key, 60)
        if url is None:
            return super().read(key, limit)
        u = urlsplit(url)
        for attempt in range(self._max_attempts):
            try:
                resp = self._round_trip(u, "GET")
                if resp.status != 200:
                    resp.read()
                    if resp.status == 404:
                        return None
                    if resp.status < 500 or attempt + 1 == self._max_attempts:
                        raise self._error("get", key, f"HTTP {resp.status} {resp.reason}")
                    continue
                size = resp.length
                if size is None or size > limit:
                    self._drop()
                    raise self._error("get", key, f"{size} bytes, over {limit}"
                                      if size is not None else "no Content-Length")
                buf = bytearray(size)
                view, done = memoryview(buf), 0
                while done < size:
                    n = resp.readinto(view[done:])
                    if not n:
                        raise http.client.IncompleteRead(b"", size - done)
                    done += n
                del view
                return buf
            except (OSError, http.client.HTTPException) as exc:
                self._drop()
                if attempt + 1 == self._max_attempts:
                    raise self._error("get", key, exc) from exc
        return None

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def size(self, key: str) -> int | None:
        """One HEAD: presigned and sent with http.client on this thread's kept-alive
        connection (a few hundred us of CPU, against boto3's ~1.5 ms, which on a small host
        made a lookup's HEADs the larger part of a restore); boto3's where there are no
        credentials to sign with."""
        url = self._presign("HEAD", key, 60)
        if url is None:
            return self._head(key, "head")
        u = urlsplit(url)
        for attempt in range(self._max_attempts):
            try:
                resp = self._round_trip(u, "HEAD")
                resp.read()
            except (OSError, http.client.HTTPException) as exc:
                self._drop()
                if attempt + 1 == self._max_attempts:
                    raise self._error("head", key, exc) from exc
                continue
            if resp.status == 404:
                return None
            if resp.status == 200 and resp.getheader("Content-Length", "").isdigit():
                return int(resp.getheader("Content-Length"))
            if resp.status < 500 or attempt + 1 == self._max_attempts:
                raise self._error("head", key, f"HTTP {resp.status} {resp.reason}")
        return None

    def presign_get(self, key: str, expires: int) -> str | None:
        """A SigV4 presigned GET of this one object (kvfs.daemon.tiers.presign: a few us, against
        botocore's ~175 us), signed with the daemon's credentials; None without any."""
        return self._presign("GET", key, expires)

    def _presign(self, method: str, key: str, expires: int) -> str | None:
        now = time.time()
        with self._creds_lock:
            if self._creds is None or now - self._creds[0] > 60:
                creds = self._session.get_credentials()
                self._creds = (now, creds.get_frozen_credentials() if creds else None)
            creds = self._creds[1]
        if creds is None:
            return None
        region = self._region or self._client.meta.region_name or "us-east-1"
        return presign(method, self._client.meta.endpoint_url, self.bucket, self._key(key),
                       region, creds.access_key, creds.secret_key, expires, now,
                       session_token=creds.token)

    def delete(self, key: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if _status(exc) != 404:
                raise self._error("delete", key, exc) from exc
        except BotoCoreError as exc:
            raise self._error("delete", key, exc) from exc

    def list(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """In key order, 1000 keys per request."""
        from botocore.exceptions import BotoCoreError, ClientError

        base = f"{self.prefix}/" if self.prefix else ""
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base + prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    yield obj["Key"][len(base):], obj["Size"]
        except (ClientError, BotoCoreError) as exc:
            raise self._error("list", prefix, exc) from exc

    def close(self) -> None:
        self._client.close()


def _status(exc: Any) -> int | None:
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def _code(exc: Any) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))

