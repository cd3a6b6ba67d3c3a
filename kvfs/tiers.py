"""The lower tiers: a directory (HDD or a shared POSIX file system) and an S3-compatible bucket.

A tier is a small blocking store of immutable, content-addressed block files under keys like
``<tenant>/<model-namespace>/<hh>/<hash>.kv``. Every method blocks (file or network I/O): the
daemon calls them from worker threads through `trio.to_thread.run_sync`, never on the event
loop, and one tier object is shared by all those threads, so every method is thread-safe.

Because a key names its content, a put is idempotent: the first writer wins and later ones are
no-ops, which is what lets many hosts share a tier with no coordination. A get never verifies
the bytes; the daemon checks the block's checksums itself before serving them.

A slow or dead tier must not hang a request: the S3 client has connect and read timeouts and
few retries, `fetch_deadline` gives the deadline for one fetch, and a `Breaker` stops calling a
tier that keeps failing. boto3 is imported only when an S3 tier is built.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from .config import ConfigError
from .layout import TEMP_PREFIX
from .store import RENAME_NOREPLACE, renameat2

log = logging.getLogger(__name__)

#: Temporaries (in a tier, or next to a get's destination) start with this; list skips them.
TMP_PREFIX = TEMP_PREFIX.decode()
_COPY_CHUNK = 16 << 20


class TierError(Exception):
    """A tier operation failed for a reason other than an absent key (I/O error, timeout,
    refused connection, denied access). Names the tier, the operation and the cause."""

    def __init__(self, tier: str, op: str, key: str, cause: BaseException | str) -> None:
        super().__init__(f"{tier} tier: {op} {key}: {cause}")
        self.tier = tier
        self.op = op
        self.key = key
        self.cause = cause


def check_key(key: str) -> str:
    """A key is a relative path of plain names: no '', '.', '..' or temporary components."""
    parts = key.split("/")
    if (not key or "\0" in key or any(p in ("", ".", "..") for p in parts)
            or any(p.startswith(TMP_PREFIX) for p in parts)):
        raise ValueError(f"bad tier key {key!r}")
    return key


def _copy_fd(src: int, dst: int) -> None:
    """Copy from the current position of `src` to its end (sendfile where it can)."""
    try:
        while os.sendfile(dst, src, None, _COPY_CHUNK):
            pass
        return
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    while buf := os.read(src, 1 << 20):
        os.write(dst, buf)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _temp_beside(path: str) -> tuple[str, int]:
    """Create an exclusive 0600 temporary in the directory of `path`: (name, fd)."""
    tmp = os.path.join(os.path.dirname(path), f"{TMP_PREFIX}{uuid.uuid4().hex}")
    return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)


def _makedirs(path: str, top: str) -> None:
    """Create `path` and its missing parents below `top`, every one 0700."""
    if path == top or os.path.isdir(path):
        return
    _makedirs(os.path.dirname(path), top)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class Tier(ABC):
    """A blocking, thread-safe store of immutable block files."""

    name: str
    url: str

    @abstractmethod
    def put(self, key: str, src: str | bytes) -> bool:
        """Store the file at local path `src` (or the bytes `src`) under `key`, atomically.
        Idempotent: False (and nothing written) if the key already exists, True if this call
        wrote it."""

    @abstractmethod
    def get(self, key: str, dest: str) -> bool:
        """Fetch `key` into local path `dest` (a temporary beside it, then a rename); False if
        the key is absent."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key`; an absent key is fine."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size in bytes, None if absent."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """(key, size) of every object whose key starts with `prefix`."""

    def usage(self) -> tuple[int, int]:
        """(bytes, objects) held. Lists the whole tier: a walk of the tree for a directory,
        one LIST request per 1000 objects for S3. Meant for status and fsck, not hot paths."""
        nbytes = count = 0
        for _key, size in self.list():
            nbytes += size
            count += 1
        return nbytes, count

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the tier is not used afterwards."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.url}>"


class DirTier(Tier):
    """Files at ``<root>/<key>``: a local HDD, or a POSIX file system every host mounts (NFS,
    CephFS, Lustre). It holds every tenant's data, so directories are 0700 and files 0600."""

    def __init__(self, root: str, name: str = "cold", *, fsync: bool = False) -> None:
        self.root = os.path.abspath(root)
        self.name = name
        self.url = f"dir://{self.root}"
        self.fsync = fsync
        os.makedirs(self.root, mode=0o700, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, check_key(key))

    def _error(self, op: str, key: str, exc: BaseException) -> TierError:
        return TierError(self.name, op, key, exc)

    def put(self, key: str, src: str | bytes) -> bool:
        dest = self._path(key)
        if os.path.lexists(dest):
            return False
        tmp = None
        try:
            _makedirs(os.path.dirname(dest), self.root)
            with contextlib.nullcontext(src) if isinstance(src, bytes) else open(src, "rb") as f:
                tmp, fd = _temp_beside(dest)
                try:
                    if isinstance(f, bytes):
                        _write_all(fd, f)
                    else:
                        _copy_fd(f.fileno(), fd)
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            published = _publish(tmp, dest)
            tmp = None if published else tmp
            return published
        except OSError as exc:
            raise self._error("put", key, exc) from exc
        finally:
            if tmp is not None:
                _unlink_quietly(tmp)

    def get(self, key: str, dest: str) -> bool:
        path = self._path(key)
        tmp = None
        try:
            try:
                src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return False
            try:
                tmp, fd = _temp_beside(dest)
                try:
                    _copy_fd(src, fd)
                finally:
                    os.close(fd)
            finally:
                os.close(src)
            os.rename(tmp, dest)
            tmp = None
            return True
        except OSError as exc:
            raise self._error("get", key, exc) from exc
        finally:
            if tmp is not None:
                _unlink_quietly(tmp)

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._error("delete", key, exc) from exc

    def size(self, key: str) -> int | None:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise self._error("stat", key, exc) from exc
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def list(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """Sorted by key within each directory; walks only below the prefix's directory."""
        base = prefix.rpartition("/")[0]
        start = os.path.join(self.root, base) if base else self.root
        try:
            yield from self._walk(start, base, prefix)
        except OSError as exc:
            raise self._error("list", prefix, exc) from exc

    def _walk(self, path: str, rel: str, prefix: str) -> Iterator[tuple[str, int]]:
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            if entry.name.startswith(TMP_PREFIX):
                continue
            key = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_dir(follow_symlinks=False):
                if key.startswith(prefix) or prefix.startswith(key + "/"):
                    yield from self._walk(entry.path, key, prefix)
            elif entry.is_file(follow_symlinks=False) and key.startswith(prefix):
                try:
                    yield key, entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue


def _publish(tmp: str, dest: str) -> bool:
    """Move `tmp` to `dest` unless `dest` exists; exactly one of concurrent writers wins.
    renameat2(RENAME_NOREPLACE) where the file system has it, link+unlink (NFS) otherwise."""
    try:
        renameat2(tmp.encode(), dest.encode(), RENAME_NOREPLACE)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    try:
        os.link(tmp, dest)
    except FileExistsError:
        return False
    _unlink_quietly(tmp)
    return True


class S3Tier(Tier):
    """Objects at ``<prefix>/<key>`` in an S3-compatible bucket, shared by every host.

    One boto3 client serves all threads (boto3 clients are thread-safe). Credentials come from
    boto3's default chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, the config
    files, instance metadata. `connect_timeout`, `read_timeout` (seconds, per socket operation)
    and `max_attempts` (total tries) bound how long a dead or stalled store can hold a thread.
    Constructing the tier makes no request unless `create_bucket` is set.
    """

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
        session = boto3.session.Session()
        self._client = session.client("s3", endpoint_url=endpoint, region_name=region,
                                      config=config)
        self._region = region
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

    def put(self, key: str, src: str | bytes) -> bool:
        """HEAD, then a conditional PUT (`If-None-Match: *`). The HEAD saves uploading a block
        that is already there (the common case when many hosts publish the same prefix); the
        condition makes the store itself refuse a key that appeared since (412), so concurrent
        writers from many hosts need no coordination. With a store that does not implement
        conditional writes (501, or an older botocore) two racing writers may both write the
        same bytes, which is harmless for immutable content."""
        from botocore.exceptions import BotoCoreError, ClientError, ParamValidationError

        full = self._key(key)
        if self._head(key, "put") is not None:
            return False
        for _ in range(3):
            conditional = self._conditional
            try:
                with (contextlib.nullcontext(src) if isinstance(src, bytes)
                      else open(src, "rb")) as f:
                    kw = {"IfNoneMatch": "*"} if conditional else {}
                    self._client.put_object(Bucket=self.bucket, Key=full, Body=f, **kw)
                return True
            except ParamValidationError as exc:
                if not conditional:
                    raise self._error("put", key, exc) from exc
                log.warning("%s tier: this botocore cannot send If-None-Match; "
                            "using HEAD then PUT", self.name)
                self._conditional = False
            except ClientError as exc:
                status, code = _status(exc), _code(exc)
                if status == 412 or code == "PreconditionFailed":
                    return False
                if status == 409 and code == "ConditionalRequestConflict":
                    continue  # a concurrent conditional write of this key: ask again
                if conditional and (status == 501 or code == "NotImplemented"):
                    log.warning("%s tier: the store does not support conditional PUT; "
                                "using HEAD then PUT", self.name)
                    self._conditional = False
                    continue
                raise self._error("put", key, exc) from exc
            except (BotoCoreError, OSError) as exc:
                raise self._error("put", key, exc) from exc
        return False

    def get(self, key: str, dest: str) -> bool:
        """One GET, streamed into a temporary beside `dest`, then renamed over it."""
        from botocore.exceptions import BotoCoreError, ClientError

        tmp = None
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            body = resp["Body"]
            try:
                tmp, fd = _temp_beside(dest)
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
                _unlink_quietly(tmp)

    def exists(self, key: str) -> bool:
        return self._head(key, "head") is not None

    def size(self, key: str) -> int | None:
        return self._head(key, "head")

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


# -- configuration ------------------------------------------------------------------------

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_S3_FLOATS = ("connect_timeout", "read_timeout")


def parse_tier_url(url: str, name: str) -> Tier:
    """Build a tier from its URL:

    - ``dir:///srv/kvfs-cold`` (an absolute path; percent-escapes allowed)
    - ``s3://bucket[/prefix][?endpoint=URL&region=R&connect_timeout=S&read_timeout=S
      &max_attempts=N]``

    A bad URL raises ConfigError (a ValueError) that names the URL and what is wrong.
    """
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{name} tier {url!r}: {why}")

    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise bad(str(exc)) from None
    if parts.fragment:
        raise bad("a tier URL has no #fragment")
    if parts.scheme == "dir":
        if parts.netloc or not parts.path.startswith("/"):
            raise bad("a dir:// URL takes an absolute path, e.g. dir:///srv/kvfs-cold")
        if parts.query:
            raise bad("a dir:// URL takes no ?options")
        path = unquote(parts.path)
        if os.path.normpath(path) == "/":
            raise bad("refusing / as a tier directory")
        return DirTier(path, name)
    if parts.scheme == "s3":
        bucket = parts.netloc
        if not _BUCKET_RE.match(bucket):
            raise bad(f"bad bucket name {bucket!r} (3-63 of a-z, 0-9, '.', '-')")
        prefix = unquote(parts.path).strip("/")
        if prefix and any(p in ("", ".", "..") for p in prefix.split("/")):
            raise bad(f"bad prefix {prefix!r}")
        kw: dict[str, Any] = {}
        try:
            pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=True)
        except ValueError:
            raise bad(f"cannot parse the options {parts.query!r}") from None
        for key, value in pairs:
            if key in kw:
                raise bad(f"option {key} given twice")
            if key == "endpoint":
                ep = urlsplit(value)
                if ep.scheme not in ("http", "https") or not ep.netloc:
                    raise bad(f"endpoint must be an http:// or https:// URL, not {value!r}")
                kw[key] = value
            elif key == "region":
                if not re.match(r"^[a-z0-9-]+$", value):
                    raise bad(f"bad region {value!r}")
                kw[key] = value
            elif key in _S3_FLOATS:
                try:
                    kw[key] = float(value)
                except ValueError:
                    kw[key] = -1.0
                if not 0 < kw[key] < 3600:
                    raise bad(f"{key} must be a number of seconds in (0, 3600), not {value!r}")
            elif key == "max_attempts":
                if not value.isdigit() or not 1 <= int(value) <= 10:
                    raise bad(f"max_attempts must be an integer in 1..10, not {value!r}")
                kw[key] = int(value)
            else:
                raise bad(f"unknown option {key!r} (known: endpoint, region, "
                          f"{', '.join(_S3_FLOATS)}, max_attempts)")
        return S3Tier(bucket, prefix, name=name, **kw)
    raise bad("unsupported scheme (use dir:///path or s3://bucket/prefix)")


# -- failure handling ---------------------------------------------------------------------


def fetch_deadline(size_bytes: int, *, floor: float = 0.5, bandwidth: float = 200e6) -> float:
    """Seconds to allow for fetching one block of `size_bytes` from a lower tier: a fixed
    `floor` for the round trips (connect, request, first byte) plus the transfer at
    `bandwidth` bytes/s, a rate well below what a healthy HDD, NFS mount or object store gives
    one stream. Past it the fetch counts as a miss and the block is recomputed."""
    if size_bytes < 0:
        raise ValueError(f"negative size {size_bytes}")
    return floor + size_bytes / bandwidth


class Breaker:
    """A circuit breaker for one tier.

    Closed: calls go through. After `threshold` consecutive failures it opens: `allow()` says
    no for `cooldown` seconds. Then it is half-open: one probe call goes through; its success
    closes the breaker, its failure opens it for another cooldown. A probe that never reports
    (its caller gave up) is replaced by another after a further cooldown. Thread-safe; `clock`
    is injectable for tests.
    """

    def __init__(self, threshold: int = 3, cooldown: float = 10.0, *, name: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold < 1 or cooldown < 0:
            raise ValueError("threshold must be >= 1 and cooldown >= 0")
        self.name = name
        self.threshold = threshold
        self.cooldown = cooldown
        self._clock = clock
        self._lock = threading.Lock()
        self._consecutive = 0
        self._opened_at: float | None = None  # None: closed
        self._probe_at: float | None = None  # when the half-open probe was let through
        #: Counters: failures reported, times opened, calls refused.
        self.failures = 0
        self.opens = 0
        self.rejected = 0

    @property
    def state(self) -> str:
        with self._lock:
            return self._state(self._clock())

    def _state(self, now: float) -> str:
        if self._opened_at is None:
            return "closed"
        return "open" if now < self._opened_at + self.cooldown else "half-open"

    def allow(self) -> bool:
        with self._lock:
            now = self._clock()
            state = self._state(now)
            if state == "closed":
                return True
            if state == "half-open" and (self._probe_at is None
                                         or now >= self._probe_at + self.cooldown):
                self._probe_at = now
                return True
            self.rejected += 1
            return False

    def success(self) -> None:
        with self._lock:
            self._consecutive = 0
            self._opened_at = self._probe_at = None

    def failure(self) -> None:
        with self._lock:
            now = self._clock()
            self.failures += 1
            self._consecutive += 1
            state = self._state(now)
            if state == "half-open" or (state == "closed"
                                        and self._consecutive >= self.threshold):
                self._opened_at = now
                self._probe_at = None
                self.opens += 1
                log.warning("%s tier: circuit open for %gs after %d consecutive failures",
                            self.name or "a", self.cooldown, self._consecutive)
