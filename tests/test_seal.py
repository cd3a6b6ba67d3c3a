"""Sealed blocks (kvfs.format.seal) and the keyring (kvfs.daemon.keys), without a mount."""

from __future__ import annotations

import multiprocessing
import os
import stat
import struct
import time

import pytest

from kvfs.daemon.keys import KeyCommand, KeyFile, Keyring, KeyUnavailable
from kvfs.daemon.tiers import DirTier
from kvfs.format import blockfile, codec, control, hashing, seal

PATTERN = b"KVFS-PLAINTEXT-PATTERN-"


def raw_block(n: int = 40_000, dtype: str = "bfloat16") -> bytes:
    payload = (PATTERN * (2 * n // len(PATTERN) + 1))[:2 * n]
    h = hashing.block_hashes(list(range(16)), 16)[0]
    return blockfile.encode(block_hash=h, parent_hash=hashing.ROOT_PARENT,
                            fingerprint=bytes(16), token_count=16, dtype=dtype, shape=(n,),
                            payload=payload)


NK = seal.namespace_key(bytes(range(32)), "acme", "m@0123")


@pytest.fixture(params=["c", "python"])
def ciphers(request, monkeypatch):
    """Each test that takes it runs with kvfs's C cipher (kvfs.format._seal) and with the
    cryptography package's, which seal and open each other's blocks."""
    if request.param == "python":
        monkeypatch.setattr(seal, "_CGcm", None)
    elif seal._CGcm is None:  # noqa: SLF001
        if os.environ.get("CI") == "true":  # CI builds it (tools/setup.sh)
            pytest.fail("kvfs.format._seal is not built")
        pytest.skip("kvfs.format._seal is not built (tools/setup.sh builds it)")
    return request.param


def test_the_two_ciphers_open_each_others_blocks(monkeypatch):
    raw = raw_block()
    c_sealed = seal.seal_file(raw, NK, 3, "acme", "m@0123", encode=False)
    c_gcm = seal._CGcm  # noqa: SLF001
    monkeypatch.setattr(seal, "_CGcm", None)
    py_sealed = seal.seal_file(raw, NK, 3, "acme", "m@0123", encode=False)
    assert seal.open_file(c_sealed, NK, "acme", "m@0123") == raw
    monkeypatch.setattr(seal, "_CGcm", c_gcm)
    assert seal.open_file(py_sealed, NK, "acme", "m@0123") == raw


@pytest.mark.parametrize("encode", [False, True])
def test_a_sealed_block_opens_to_the_same_file_and_holds_no_plaintext(encode, ciphers):
    raw = raw_block()
    sealed = seal.seal_file(raw, NK, 0x1234, "acme", "m@0123", encode=encode)
    assert PATTERN not in sealed and len(sealed) <= len(raw)
    h = blockfile.decode_header(sealed)
    assert h.encoding.seal.key_id == 0x1234 and seal.is_sealed(h)
    assert h.encoding.codec == (blockfile.CODEC_PLANES if encode and codec.available()
                                else blockfile.CODEC_NONE)
    assert codec.decode_file(seal.open_file(sealed, NK, "acme", "m@0123")) == raw
    with pytest.raises(blockfile.BlockFormatError) as ei:
        blockfile.decode(sealed)  # never read as a plain block
    assert ei.value.reason == "sealed"


def test_a_raw_block_in_a_bytearray_is_sealed_where_it_lies(ciphers):
    """An upload reads a hot block into a buffer of its own and seals it there (no copy): the
    same buffer comes back, the size of the raw file, holding no plaintext, and it opens to
    the block as a copied seal does. A bytes block is sealed into new memory, left as it was."""
    raw = raw_block()
    buf = bytearray(raw)
    assert seal.seal_file(buf, NK, 9, "acme", "m@0123", encode=False) is not buf
    assert buf == raw  # (in place only where asked)
    sealed = seal.seal_file(buf, NK, 9, "acme", "m@0123", encode=False, in_place=True)
    assert sealed is buf and len(buf) == len(raw) and PATTERN not in buf
    assert seal.is_sealed(blockfile.decode_header(buf))
    assert seal.open_file(bytes(buf), NK, "acme", "m@0123") == raw
    assert blockfile.verify_file(buf).encoding.seal.key_id == 9
    copied = seal.seal_file(raw, NK, 9, "acme", "m@0123", encode=False)
    assert copied is not raw and len(copied) == len(raw) and PATTERN in raw
    # A bytearray that is not exactly a raw file (here: encoded, where the codec is built)
    # is sealed into new memory, the caller's bytes untouched.
    enc = codec.encode_file(raw)
    if enc is not None:
        ebuf = bytearray(enc)
        out = seal.seal_file(ebuf, NK, 9, "acme", "m@0123", in_place=True)
        assert out is not ebuf and ebuf == enc
        assert codec.decode_file(seal.open_file(out, NK, "acme", "m@0123")) == raw


def test_a_sealed_block_elsewhere_or_altered_fails_authentication(ciphers):
    raw = raw_block()
    sealed = seal.seal_file(raw, NK, 7, "acme", "m@0123", encode=False)
    other_tenant = seal.namespace_key(bytes(range(32)), "evil", "m@0123")
    for key, tenant, ns in ((NK, "acme", "m@other"), (NK, "evil", "m@0123"),
                            (other_tenant, "evil", "m@0123"),
                            (seal.namespace_key(os.urandom(32), "acme", "m@0123"), "acme",
                             "m@0123")):
        with pytest.raises(blockfile.BlockFormatError) as ei:
            seal.open_file(sealed, key, tenant, ns)
        assert ei.value.reason == "auth"
    # Another block's hash in the header (a copy under another name), a flipped tag, a
    # flipped ciphertext byte whose stored checksum was fixed up: each fails.
    h = blockfile.decode_header(sealed)
    moved = blockfile.encode_header(type(h)(**{**h.__dict__, "block_hash": bytes(16)}))
    tag = bytearray(sealed)
    tag[250] ^= 1
    body = bytearray(sealed)
    body[blockfile.HEADER_SIZE + 5] ^= 1
    e = h.encoding
    fixed = type(e)(**{**e.__dict__, "stored_checksum": __import__("xxhash").xxh3_64_intdigest(
        bytes(body[blockfile.HEADER_SIZE:blockfile.HEADER_SIZE + e.stored_len]))})
    body[:blockfile.HEADER_SIZE] = blockfile.encode_header(type(h)(**{**h.__dict__,
                                                                      "encoding": fixed}))
    for bad, reason in ((moved + sealed[blockfile.HEADER_SIZE:], "auth"),
                        (_reseal(tag), "auth"), (bytes(body), "auth")):
        with pytest.raises(blockfile.BlockFormatError) as ei:
            seal.open_file(bad, NK, "acme", "m@0123")
        assert ei.value.reason == reason


def _reseal(buf: bytearray) -> bytes:
    """The header checksum recomputed after a change to the header."""
    import xxhash
    buf[168:176] = bytes(8)
    struct.pack_into("<Q", buf, 168, xxhash.xxh3_64_intdigest(bytes(buf[:4096])))
    return bytes(buf)


def test_open_landed_decrypts_in_place_across_views(ciphers):
    raw = raw_block(300_000)  # more than one piece
    for encode in (False, True):
        sealed = seal.seal_file(raw, NK, 1, "acme", "m@0123", encode=encode)
        h = blockfile.decode_header(sealed)
        dest = bytearray(h.payload_len)
        mv = memoryview(dest)
        mv[:h.stored_len] = sealed[4096:4096 + h.stored_len]
        seal.open_landed(h, [mv[:12345], mv[12345:]], NK, "acme", "m@0123")
        assert bytes(dest) == raw[4096:4096 + h.payload_len]


def test_keys_answer_round_trips():
    keys = [(1, bytes(32)), (0xFFFFFFFF, bytes(range(32)))]
    assert control.decode_keys(control.encode_keys(1500, keys)) == (1500, keys)
    with pytest.raises(ValueError):
        control.decode_keys(control.encode_keys(1, keys)[:-1])


def test_the_key_file_is_made_private_and_keys_are_shared_through_a_tier(tmp_path):
    kek = tmp_path / "etc" / "kek"
    tier = DirTier(str(tmp_path / "cold"))
    a = Keyring(KeyFile(str(kek)), str(tmp_path / "a"), [tier])
    assert stat.S_IMODE(os.stat(kek).st_mode) == 0o600
    kid = a.ensure("acme")
    assert a.ensure("acme") == kid
    objs = [k for k, _ in tier.list(".kvfs/keys/")]
    assert objs == [f".kvfs/keys/acme/{kid:08x}.key"]
    dk = a.data_key("acme", kid)
    stored = (tmp_path / "cold" / objs[0]).read_bytes()
    assert dk not in stored and dk.hex().encode() not in stored  # wrapped, never plain
    # Another host with the same key-encryption key and tier: the same key.
    b = Keyring(KeyFile(str(kek)), str(tmp_path / "b"), [tier])
    assert b.ensure("acme") == kid and b.data_key("acme", kid) == dk
    # A host with another key-encryption key cannot unwrap it.
    c = Keyring(KeyFile(str(tmp_path / "other")), str(tmp_path / "c"), [tier])
    with pytest.raises(KeyUnavailable, match="does not unwrap"):
        c.data_key("acme", kid)


def _load_key_file(path: str, barrier, out) -> None:
    barrier.wait()
    try:
        out.put(KeyFile(path).id)
    except KeyUnavailable as exc:
        out.put(f"refused: {exc}")


def test_daemons_starting_together_make_one_key_file(tmp_path):
    """Daemons that start at the same moment on a host without a key-encryption key (two
    mounts enabled at first boot): one key is made, every one loads it whole (the file was
    made, then written: a daemon that read it in between refused to start), and no
    temporary is left."""
    ctx = multiprocessing.get_context("fork")
    for trial in range(10):
        path = str(tmp_path / f"etc{trial}" / "kek")
        barrier, out = ctx.Barrier(8), ctx.Queue()
        procs = [ctx.Process(target=_load_key_file, args=(path, barrier, out))
                 for _ in range(8)]
        for p in procs:
            p.start()
        ids = {out.get(timeout=60) for _ in procs}
        for p in procs:
            p.join(60)
        assert len(ids) == 1 and not next(iter(ids)).startswith("refused"), ids
        assert os.listdir(os.path.dirname(path)) == ["kek"]
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_rotation_retirement_and_forgetting(tmp_path):
    tier = DirTier(str(tmp_path / "cold"))
    a = Keyring(KeyFile(str(tmp_path / "kek")), str(tmp_path / "a"), [tier], ttl=0.01)
    b = Keyring(KeyFile(str(tmp_path / "kek")), str(tmp_path / "b"), [tier], ttl=0.01)
    old = a.ensure("acme")
    new = a.rotate("acme")
    assert a.ensure("acme") == new and b.ensure("acme") == new  # newest first
    assert b.data_key("acme", old)  # older keys still open their blocks
    with pytest.raises(KeyUnavailable, match="newest"):
        a.retire("acme", new)
    a.retire("acme", old)
    time.sleep(0.02)  # b's bound: its ttl
    with pytest.raises(KeyUnavailable, match="retired"):
        b.data_key("acme", old)
    b.data_key("acme", new)
    report = a.forget("acme")
    assert "cold" in report["destroyed_in"] and not report["not_reached"]
    assert not [k for k, _ in tier.list(".kvfs/keys/acme/") if k.endswith(".key")]
    # b held the key unwrapped: past its ttl it reads the tier again and it is gone.
    time.sleep(0.02)
    forgotten = b.refresh()
    assert list(forgotten) == ["acme"] and forgotten["acme"] > 0
    with pytest.raises(KeyUnavailable, match="destroyed"):
        b.data_key("acme", new)
    assert not [n for n in os.listdir(tmp_path / "b") if n.endswith(".key")]
    # A tenant of the same name made later gets a new key.
    assert a.ensure("acme") not in (old, new)


def test_a_failing_key_provider_is_a_clear_error(tmp_path):
    script = tmp_path / "provider"
    script.write_text("#!/bin/sh\necho 'vault: permission denied' >&2\nexit 3\n")
    script.chmod(0o755)
    ring = Keyring(KeyCommand(str(script)), str(tmp_path / "a"), [DirTier(str(tmp_path / "t"))])
    with pytest.raises(KeyUnavailable, match="exited 3: vault: permission denied"):
        ring.ensure("acme")


def test_an_opener_opens_pieces_as_they_land_and_zeroes_a_forgery(ciphers):
    raw = raw_block(300_000)
    sealed = seal.seal_file(raw, NK, 2, "acme", "m@0123", encode=False)
    h = blockfile.decode_header(sealed)
    for forged in (False, True):
        body = bytearray(sealed[4096:4096 + h.stored_len])
        if forged:
            body[777] ^= 1
        op = seal.Opener(h, NK, "acme", "m@0123")
        mv = memoryview(body)
        for at in range(0, len(body), 100_000):  # as a GET's body lands, piece by piece
            op.feed(mv[at:at + 100_000])
        if not forged:
            assert op.finish().encoding is None and bytes(body) == raw[4096:4096 + len(body)]
            continue
        with pytest.raises(blockfile.BlockFormatError) as ei:
            op.finish()
        assert ei.value.reason == "auth" and not any(body)
