"""A minimal SigV4 query-string presigner for S3 GET and PUT URLs (stdlib only).

botocore's ``generate_presigned_url`` costs about 175 us per URL on a 2-core Xeon (it builds
a whole request through its event and model machinery); a plain-HTTP client that fetches
thousands of blocks a second would spend a core on it. This module signs the same URL with
one SHA-256 and one HMAC-SHA256 per URL (the signing key, four HMACs, is cached per secret,
day, region and service): the same URL botocore gives for the same inputs (path-style
addressing, ``host`` the only signed header, ``UNSIGNED-PAYLOAD``): character for character
what botocore's own signer writes (its CRT signer, used when awscrt is installed, writes the
same parameters in another order); ``tests/test_presign.py`` checks it against both and
against a real SeaweedFS.

The functions are pure: the time is an argument (``now``: epoch seconds, or an aware
datetime), nothing is read from the environment.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import hmac
import time
from urllib.parse import quote, urlsplit

ALGORITHM = "AWS4-HMAC-SHA256"
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
#: SigV4 allows a presigned URL at most seven days.
MAX_EXPIRES = 7 * 24 * 3600
_DEFAULT_PORTS = {"http": 80, "https": 443}


@functools.lru_cache(maxsize=64)
def _signing_key(secret_key: str, day: str, region: str, service: str) -> bytes:
    k = hmac.new(("AWS4" + secret_key).encode(), day.encode(), hashlib.sha256).digest()
    for part in (region, service, "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    return k


@functools.lru_cache(maxsize=64)
def _endpoint(endpoint: str) -> tuple[str, str]:
    """(scheme://netloc as given, the host header's value: without a default port)."""
    u = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    if not u.hostname or u.path.strip("/") or u.query:
        raise ValueError(f"not an endpoint URL (scheme://host[:port]): {endpoint!r}")
    host = u.hostname if ":" not in u.hostname else f"[{u.hostname}]"
    if u.port is not None and u.port != _DEFAULT_PORTS.get(u.scheme):
        host = f"{host}:{u.port}"
    return f"{u.scheme}://{u.netloc}", host


def _stamp(now: float | _dt.datetime) -> tuple[str, str]:
    if isinstance(now, _dt.datetime):
        if now.tzinfo is None:
            raise ValueError("now: an aware datetime (or epoch seconds) is needed")
        now = now.timestamp()
    amz = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(int(now)))
    return amz, amz[:8]


def _q(s: str) -> str:
    return quote(s, safe="-_.~")


def presign(method: str, endpoint: str, bucket: str, key: str, region: str, access_key: str,
            secret_key: str, expires: int, now: float | _dt.datetime, *,
            session_token: str | None = None, service: str = "s3") -> str:
    """A path-style SigV4 presigned URL for ``method`` on ``bucket``/``key``, valid for
    ``expires`` seconds from ``now``."""
    if not 1 <= int(expires) <= MAX_EXPIRES:
        raise ValueError(f"expires must be 1..{MAX_EXPIRES} seconds, not {expires}")
    if not bucket or not key:
        raise ValueError("a bucket and a key are needed")
    base, host = _endpoint(endpoint)
    amz, day = _stamp(now)
    scope = f"{day}/{region}/{service}/aws4_request"
    path = f"/{bucket}/{quote(key, safe='/~')}"
    # The canonical query string (parameters sorted by name, every one encoded) is also the
    # URL's query, as botocore's own signer writes it.
    query = (f"X-Amz-Algorithm={ALGORITHM}&X-Amz-Credential={_q(access_key)}%2F"
             f"{_q(scope)}&X-Amz-Date={amz}&X-Amz-Expires={int(expires)}"
             + (f"&X-Amz-Security-Token={_q(session_token)}" if session_token else "")
             + "&X-Amz-SignedHeaders=host")
    canonical = f"{method}\n{path}\n{query}\nhost:{host}\n\nhost\n{UNSIGNED_PAYLOAD}"
    to_sign = (f"{ALGORITHM}\n{amz}\n{scope}\n"
               f"{hashlib.sha256(canonical.encode()).hexdigest()}")
    signature = hmac.new(_signing_key(secret_key, day, region, service), to_sign.encode(),
                         hashlib.sha256).hexdigest()
    return f"{base}{path}?{query}&X-Amz-Signature={signature}"


def presign_get(endpoint: str, bucket: str, key: str, region: str, access_key: str,
                secret_key: str, expires: int, now: float | _dt.datetime, *,
                session_token: str | None = None) -> str:
    """A presigned GET of ``bucket``/``key`` (see :func:`presign`)."""
    return presign("GET", endpoint, bucket, key, region, access_key, secret_key, expires, now,
                   session_token=session_token)


def presign_put(endpoint: str, bucket: str, key: str, region: str, access_key: str,
                secret_key: str, expires: int, now: float | _dt.datetime, *,
                session_token: str | None = None) -> str:
    """A presigned PUT of ``bucket``/``key`` (the body unsigned; see :func:`presign`)."""
    return presign("PUT", endpoint, bucket, key, region, access_key, secret_key, expires, now,
                   session_token=session_token)
