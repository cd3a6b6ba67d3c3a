"""Sealed blocks: a block's stored bytes encrypted under its tenant's key (docs/format.md,
"Sealed blocks").

A sealed block is a version 3 file whose encoding flags say *sealed*: its stored bytes (the
payload as is, codec ``none``, or a codec's output: compress, then encrypt) are AES-256-GCM
ciphertext, the same length as the plaintext, so a sealed file is never longer than the
block it seals; the header keeps the nonce and the tag beside the tenant key's id, and the
stored checksum is the ciphertext's (a torn object is found before any decryption).

Keys (the daemon holds the tenants' data keys, kvfs.daemon.keys):
- a *namespace key*: HMAC-SHA256 of the tenant's data key over the tenant and the namespace
  (:func:`namespace_key`); a client is given its own namespace's, never the data key;
- a *block key*: HMAC-SHA256 of the namespace key over the block hash (:func:`block_key`),
  the AES-256-GCM key of that one block.
The associated data binds the tenant, the namespace and the header's fields (block hash,
parent, fingerprint, payload checksum, shape, codec: everything but the checksums of the
ciphertext and of the header, and the tag): a block copied to another name, namespace or
tenant fails authentication, a miss that is never served.

The cipher (:func:`cipher`) is kvfs's C module ``kvfs.format._seal`` where it is built (the
system's libcrypto, in place, the xxh3 of each piece taken as it is transformed, without the
GIL: the threads of a restore open their blocks in parallel), else the cryptography package
(one core at a time, through a copy).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from . import blockfile, codec
from .blockfile import HEADER_SIZE, BlockFormatError, BlockHeader, Encoding, Seal

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
#: Bytes decrypted per call when opening in place (a piece stays in the core's cache).
PIECE = 1 << 20
_AAD = b"kvfs-seal-1\0"
_NS_INFO = b"kvfs-namespace-key-1\0"
_BLOCK_INFO = b"kvfs-block-key-1\0"


def namespace_key(data_key: bytes, tenant: str, namespace: str) -> bytes:
    """The key of one tenant's namespace, from the tenant's data key."""
    return hmac.digest(data_key, b"".join((_NS_INFO, tenant.encode(), b"\0",
                                           namespace.encode())), "sha256")


try:
    from ._seal import Gcm as _CGcm
except ImportError:  # not built: the cryptography package's cipher
    _CGcm = None


class _PyGcm:
    """:func:`cipher` with the cryptography package (which holds the GIL and refuses to
    transform in place: each piece goes through a copy)."""

    def __init__(self, key: bytes, nonce: bytes, aad: bytes, decrypt: bool) -> None:
        c = Cipher(algorithms.AES(key), modes.GCM(nonce))
        self._c = c.decryptor() if decrypt else c.encryptor()
        self._c.authenticate_additional_data(aad)
        self._x = xxhash.xxh3_64()
        self._decrypt = decrypt

    def update(self, buf: Any) -> None:
        v = memoryview(buf).cast("B")
        v[:] = self._c.update(v)
        self._x.update(v)

    def finish(self, tag: bytes | None = None) -> Any:
        if not self._decrypt:
            self._c.finalize()
            return self._c.tag
        try:
            self._c.finalize_with_tag(tag)
        except InvalidTag:
            return False
        return True

    def digest(self) -> int:
        return self._x.intdigest()


def cipher(key: bytes, nonce: bytes, aad: bytes, *, decrypt: bool) -> Any:
    """AES-256-GCM of one block's stored bytes, piece by piece in place: ``update(buf)``
    transforms a writable buffer where it lies and hashes (xxh3) what it then holds;
    ``finish()`` gives the tag (sealing) or ``finish(tag)`` whether it authenticates
    (opening); ``digest()`` the hash of every updated byte."""
    return (_CGcm or _PyGcm)(key, nonce, aad, decrypt)


def block_key(ns_key: bytes, block_hash: bytes) -> bytes:
    """The AES-256-GCM key of one block, from its namespace's key."""
    return hmac.digest(ns_key, _BLOCK_INFO + bytes(block_hash), "sha256")


def associated_data(head: bytes, tenant: str, namespace: str) -> bytes:
    """What a sealed block's tag binds besides its ciphertext: the tenant, the namespace and
    the header ``head`` (its 4096 bytes) but for its header checksum (168..176), its stored
    checksum (216..224) and its tag (240..256)."""
    return b"".join((_AAD, tenant.encode(), b"\0", namespace.encode(), b"\0", head[:168],
                     head[176:216], head[224:240]))


def is_sealed(h: BlockHeader) -> bool:
    return h.encoding is not None and h.encoding.seal is not None


def seal_block(h: BlockHeader, stored: Any, ns_key: bytes, key_id: int, tenant: str,
               namespace: str, *, in_place: bool = False) -> tuple[BlockHeader, memoryview]:
    """Seal block ``h`` whose stored bytes are ``stored`` (the payload of a raw block, or a
    codec's stored bytes of an encoded one): its sealed header and ciphertext, in a copy, or
    (``in_place``) where ``stored`` lies (a writable buffer)."""
    enc = h.encoding
    if enc is None:
        enc = Encoding(blockfile.CODEC_NONE, blockfile.DTYPE_SIZES[h.dtype], 1, h.payload_len,
                       0)
    elif enc.seal is not None:
        raise ValueError("block is sealed already")
    nonce = os.urandom(NONCE_BYTES)
    draft = replace(h, encoding=replace(enc, stored_checksum=0,
                                        seal=Seal(key_id, nonce, bytes(TAG_BYTES))))
    aad = associated_data(blockfile.encode_header(draft), tenant, namespace)
    ct = (memoryview(stored).cast("B") if in_place
          else bytearray(memoryview(stored).cast("B")))  # (the caller's bytes stay as they are)
    enc_ = cipher(block_key(ns_key, h.block_hash), nonce, aad, decrypt=False)
    enc_.update(ct)
    tag = enc_.finish()
    final = replace(enc, stored_checksum=enc_.digest(), seal=Seal(key_id, nonce, tag))
    return replace(h, encoding=final), memoryview(ct)


def seal_file(data: Any, ns_key: bytes, key_id: int, tenant: str, namespace: str, *,
              encode: bool = True, in_place: bool = False) -> bytes | bytearray:
    """A sound block file (checked here) sealed: encoded first with planes where ``encode``
    and that pays (an encoded block keeps its codec). With ``in_place``, a raw block in a
    bytearray that stays raw is sealed where it lies (the sealed file has the raw one's
    layout: the ciphertext over the payload, the sealed header over the header) and
    returned: no copy of its bytes. Raises BlockFormatError."""
    mv = memoryview(data).cast("B")
    h, payload = blockfile.decode(mv)  # every check (an encoded one decoded too)
    stored: Any = payload
    if h.encoding is not None:
        stored = mv[HEADER_SIZE:HEADER_SIZE + h.stored_len]
    elif encode and (got := codec.encode_block(h, payload)) is not None:
        h, stored = got
    elif in_place and isinstance(data, bytearray) and len(data) == h.file_size:
        sh, _ = seal_block(h, mv[HEADER_SIZE:HEADER_SIZE + h.payload_len], ns_key, key_id,
                           tenant, namespace, in_place=True)
        mv[:HEADER_SIZE] = blockfile.encode_header(sh)
        return data
    sh, ct = seal_block(h, stored, ns_key, key_id, tenant, namespace)
    return b"".join(codec.file_parts(sh, ct))


def _views(buf: Any) -> list[memoryview]:
    parts = buf if isinstance(buf, list | tuple) else [buf]
    return [memoryview(p).cast("B") for p in parts]


def open_in_place(h: BlockHeader, stored: Any, ns_key: bytes, tenant: str, namespace: str,
                  *, check_stored: bool = False) -> BlockHeader:
    """Decrypt sealed block ``h``'s stored bytes in place in ``stored`` (a writable buffer,
    or a list of them holding the stored bytes in order) and authenticate them: the header of
    what is there now (a raw block's, its payload checksum checked; or its codec's, whose
    stored checksum is the plaintext's). The tag covers every stored byte, so the
    ciphertext's own checksum is checked only where asked (``check_stored``: before any
    decryption, to tell a torn object from a forged one). Each piece is hashed as it is
    decrypted, in cache. Raises BlockFormatError ("length", "checksum", "auth"); ``stored``
    then holds no plaintext to use."""
    e = h.encoding
    if e is None or e.seal is None:
        raise ValueError("not a sealed block")
    views = _views(stored)
    total = sum(v.nbytes for v in views)
    if total != e.stored_len:
        raise BlockFormatError("length", f"stored bytes are {total}, header says "
                               f"{e.stored_len}")
    if check_stored:
        x = xxhash.xxh3_64()
        for v in views:
            x.update(v)
        if x.intdigest() != e.stored_checksum:
            raise BlockFormatError("checksum", f"stored checksum {x.intdigest():#018x}, "
                                   f"header says {e.stored_checksum:#018x}")
    aad = associated_data(blockfile.encode_header(h), tenant, namespace)
    dec = cipher(block_key(ns_key, h.block_hash), e.seal.nonce, aad, decrypt=True)
    for v in views:  # a piece at a time, decrypted and hashed in the core's cache
        for at in range(0, v.nbytes, PIECE):
            dec.update(v[at:at + PIECE])
    if not dec.finish(e.seal.tag):
        for v in views:  # nothing unauthenticated is left to be mistaken for a payload
            v[:] = bytes(v.nbytes)
        raise BlockFormatError("auth", "the block does not authenticate under its tenant's "
                               f"key {e.seal.key_id:08x} (moved, tampered with, torn, or "
                               "another tenant's)") from None
    digest = dec.digest()
    if e.codec == blockfile.CODEC_NONE:
        if digest != h.checksum:
            raise BlockFormatError("checksum", f"payload checksum {digest:#018x}, header "
                                   f"says {h.checksum:#018x}")
        return replace(h, encoding=None)
    return replace(h, encoding=replace(e, seal=None, stored_checksum=digest))


class Opener:
    """Opens a sealed block (codec ``none``) piece by piece as its stored bytes land (a GET's
    body read into its destination): each piece decrypted in place and hashed while it is in
    the core's cache; :meth:`finish` authenticates the whole and checks the payload checksum.
    Raises BlockFormatError ("length", "checksum", "auth")."""

    def __init__(self, h: BlockHeader, ns_key: bytes, tenant: str, namespace: str) -> None:
        e = h.encoding
        if e is None or e.seal is None or e.codec != blockfile.CODEC_NONE:
            raise ValueError("not a sealed block stored as is")
        self.h, self._tag = h, e.seal.tag
        self._dec = cipher(block_key(ns_key, h.block_hash), e.seal.nonce,
                           associated_data(blockfile.encode_header(h), tenant, namespace),
                           decrypt=True)
        self._fed = 0
        self._views: list[memoryview] = []

    def feed(self, piece: memoryview) -> None:
        """Decrypt the next landed ``piece`` in place."""
        self._dec.update(piece)
        self._fed += piece.nbytes
        self._views.append(piece)

    def finish(self) -> BlockHeader:
        """Authenticate what was fed: the block's raw header. A failure zeroes what was fed."""
        try:
            if self._fed != self.h.payload_len:
                raise BlockFormatError("length", f"stored bytes are {self._fed}, header says "
                                       f"{self.h.payload_len}")
            if not self._dec.finish(self._tag):
                raise BlockFormatError("auth", "the block does not authenticate under its "
                                       "tenant's key (moved, tampered with, torn, or another "
                                       "tenant's)")
            if self._dec.digest() != self.h.checksum:
                raise BlockFormatError("checksum", f"payload checksum "
                                       f"{self._dec.digest():#018x}, header says "
                                       f"{self.h.checksum:#018x}")
        except BlockFormatError:
            for v in self._views:
                v[:] = bytes(v.nbytes)
            raise
        return replace(self.h, encoding=None)


def open_file(data: Any, ns_key: bytes, tenant: str, namespace: str, *,
              in_place: bool = False) -> bytes | bytearray:
    """A sealed block file opened: the file it sealed (a raw block's, or its codec's version 3
    file), every check made. With ``in_place``, a sealed raw block in a bytearray is opened
    where it lies (the raw file has the sealed one's layout) and returned: no copy (and on a
    failure, nothing of it left to use). Raises BlockFormatError."""
    mv = memoryview(data).cast("B")
    h = blockfile.decode_header(mv)
    blockfile.verify_file_size(h, mv.nbytes)
    if not is_sealed(h):
        raise ValueError("not a sealed block")
    assert h.encoding is not None
    if in_place and isinstance(data, bytearray) and h.encoding.codec == blockfile.CODEC_NONE:
        blockfile.verify_padding(h, mv[HEADER_SIZE + h.stored_len:])
        opened = open_in_place(h, mv[HEADER_SIZE:HEADER_SIZE + h.stored_len], ns_key, tenant,
                               namespace, check_stored=True)
        mv[:HEADER_SIZE] = blockfile.encode_header(opened)
        blockfile.decode_header(mv)  # (its payload checksum was checked as it was opened)
        return data
    stored = bytearray(mv[HEADER_SIZE:HEADER_SIZE + h.stored_len])
    blockfile.verify_padding(h, mv[HEADER_SIZE + h.stored_len:])
    opened = open_in_place(h, stored, ns_key, tenant, namespace, check_stored=True)
    out = b"".join(codec.file_parts(opened, stored))
    blockfile.decode(out)  # the opened block's own checks (payload checksum; decoded)
    return out


def key_id_of(h: BlockHeader) -> int | None:
    """The tenant key a sealed block is under (None: not sealed)."""
    return h.encoding.seal.key_id if is_sealed(h) else None  # type: ignore[union-attr]


def open_landed(h: BlockHeader, views: Sequence[memoryview], ns_key: bytes, tenant: str,
                namespace: str) -> None:
    """A sealed block whose stored bytes landed in ``views`` (a load's destination: a sealed
    file is never longer than its block) opened there: decrypted in place and, where a
    codec stored it, decoded into the same memory; the payload checksum checked. Raises
    BlockFormatError."""
    e = h.encoding
    assert e is not None
    if e.codec == blockfile.CODEC_NONE:  # decrypted where it landed, its checksum checked
        open_in_place(h, list(views), ns_key, tenant, namespace)
        return
    stored = codec.gather(views, e.stored_len)
    opened = open_in_place(h, stored, ns_key, tenant, namespace)
    codec.decode_payload(opened, stored, list(views), stored_checked=True)
