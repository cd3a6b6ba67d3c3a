"""kvfs.daemon.tiers.presign: the same URLs as botocore for the same inputs, and SeaweedFS
takes them."""

from __future__ import annotations

import datetime as dt
import time
from urllib.parse import parse_qsl, urlsplit

import pytest

from kvfs.daemon.tiers.presign import presign_get, presign_put

from .s3server import s3  # noqa: F401 - the fixture

T = dt.datetime(2026, 3, 4, 5, 6, 7, tzinfo=dt.UTC)
ENDPOINTS = ["http://127.0.0.1:8333", "https://s3.example.com", "http://localhost:80",
             "https://s3.eu-west-2.amazonaws.com:443", "http://[::1]:9000"]
KEYS = ["k", "kvfs/t/ns/ab/0123456789abcdef.kv", "a/b c/\u00fc+=&?.kv", "x~y!*'()", "a//b/"]
SECRET = "se/cr+et"


def _botocore(monkeypatch, endpoint: str, signer: str, token: str | None = None):
    """A botocore S3 client whose clock reads T, signing presigned URLs with `signer`
    ("python": botocore's own; "crt": awscrt's, what botocore uses when awscrt is there)."""
    pytest.importorskip("botocore")
    import botocore.auth
    import botocore.session
    from botocore.config import Config

    def fixed(remove_tzinfo: bool = True) -> dt.datetime:
        return T.replace(tzinfo=None) if remove_tzinfo else T

    monkeypatch.setattr(botocore.auth, "get_current_datetime", fixed)
    if signer == "crt":
        crt_auth = pytest.importorskip("botocore.crt.auth")
        if not botocore.auth.HAS_CRT:
            pytest.skip("awscrt not installed: botocore has no CRT signer")
        monkeypatch.setattr(crt_auth, "get_current_datetime", fixed)
        monkeypatch.setitem(botocore.auth.AUTH_TYPE_MAPS, "s3v4-query",
                            crt_auth.CrtS3SigV4QueryAuth)
    else:
        monkeypatch.setitem(botocore.auth.AUTH_TYPE_MAPS, "s3v4-query",
                            botocore.auth.S3SigV4QueryAuth)
    return botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="eu-west-2", aws_access_key_id="AK/ID",
        aws_secret_access_key=SECRET, aws_session_token=token,
        config=Config(s3={"addressing_style": "path"}, signature_version="s3v4"))


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("signer", ["python", "crt"])
def test_the_urls_are_botocores(monkeypatch, endpoint, signer):
    """Character for character botocore's Python signer's URL; the CRT signer's has the same
    parameters and signature in another order."""
    client = _botocore(monkeypatch, endpoint, signer)
    for key in KEYS:
        for op, ours in (("get_object", presign_get), ("put_object", presign_put)):
            theirs = client.generate_presigned_url(op, Params={"Bucket": "bkt", "Key": key},
                                                   ExpiresIn=900)
            for now in (T, T.timestamp()):
                mine = ours(endpoint, "bkt", key, "eu-west-2", "AK/ID", SECRET, 900, now)
                if signer == "python":
                    assert mine == theirs, (op, key)
                u, v = urlsplit(mine), urlsplit(theirs)
                assert u[:3] == v[:3]
                assert sorted(parse_qsl(u.query)) == sorted(parse_qsl(v.query)), (op, key)


@pytest.mark.parametrize("signer", ["python", "crt"])
def test_a_session_token_is_signed_as_botocore_signs_it(monkeypatch, signer):
    client = _botocore(monkeypatch, "https://s3.example.com", signer, token="tok/+=")
    theirs = client.generate_presigned_url("get_object", Params={"Bucket": "b", "Key": "k"},
                                           ExpiresIn=60)
    mine = presign_get("https://s3.example.com", "b", "k", "eu-west-2", "AK/ID", SECRET, 60, T,
                       session_token="tok/+=")
    assert dict(parse_qsl(urlsplit(mine).query)) == dict(parse_qsl(urlsplit(theirs).query))


def test_the_time_and_the_key_are_the_signature():
    url = presign_get("http://h:1", "b", "k", "r", "a", "s", 60, T)
    assert url == presign_get("http://h:1", "b", "k", "r", "a", "s", 60, T.timestamp() + 0.9)
    assert url != presign_get("http://h:1", "b", "k", "r", "a", "s", 60, T.timestamp() + 1)
    assert url != presign_get("http://h:1", "b", "k2", "r", "a", "s", 60, T)
    assert url != presign_put("http://h:1", "b", "k", "r", "a", "s", 60, T)
    assert "X-Amz-Date=20260304T050607Z" in url and "X-Amz-Expires=60&" in url


@pytest.mark.parametrize("bad", [
    dict(expires=0), dict(expires=7 * 24 * 3600 + 1), dict(now=T.replace(tzinfo=None)),
    dict(endpoint="http://h:1/prefix"), dict(endpoint="http://"), dict(key=""),
])
def test_bad_inputs_are_refused(bad):
    kw = dict(endpoint="http://h:1", bucket="b", key="k", region="r", access_key="a",
              secret_key="s", expires=60, now=T) | bad
    with pytest.raises(ValueError):
        presign_get(**kw)


def test_seaweedfs_takes_the_urls_and_refuses_others(s3):  # noqa: F811
    """A real GET and PUT through urllib3 with our URLs; an expired URL, a URL of another key,
    one signed with another secret or for another method: 403."""
    urllib3 = pytest.importorskip("urllib3")
    from kvfs.bench.seaweed import ACCESS_KEY, REGION, SECRET_KEY

    def url(sign, key, *, now=None, expires=300, secret=SECRET_KEY):
        return sign(s3.endpoint, s3.bucket, key, REGION, ACCESS_KEY, secret, expires,
                    time.time() if now is None else now)

    client = s3.client()
    body = bytes(range(256)) * 4096  # 1 MiB
    key = "kvfs/t/ns/ab/c d+\u00fc.kv"
    client.put_object(Bucket=s3.bucket, Key=key, Body=body)
    http = urllib3.PoolManager(retries=False)
    r = http.request("GET", url(presign_get, key))
    assert r.status == 200 and r.data == body
    r = http.request("PUT", url(presign_put, "put/one"), body=body[::-1])
    assert r.status == 200, r.data
    assert client.get_object(Bucket=s3.bucket, Key="put/one")["Body"].read() == body[::-1]
    # Refused: expired (signed two hours ago for a minute), the signature of another key,
    # another secret, a GET URL used to PUT.
    assert http.request("GET", url(presign_get, key, now=time.time() - 7200,
                                   expires=60)).status == 403
    other = url(presign_get, "put/one")
    forged = other.replace("/put/one?", "/" + urlsplit(url(presign_get, key)).path.split(
        "/", 2)[2] + "?")
    assert forged != other and http.request("GET", forged).status == 403
    assert http.request("GET", url(presign_get, key, secret="wrong")).status == 403
    assert http.request("PUT", url(presign_get, "put/two"), body=b"x").status == 403
    assert client.list_objects_v2(Bucket=s3.bucket, Prefix="put/two").get("KeyCount") == 0
    client.close()
