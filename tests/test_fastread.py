"""kvfs.client._fastread, the host load path in C: the same verdicts as the reads in Python.

Each case is a block file on disk (sound, or damaged one way) read by both: the C reads must
accept exactly the blocks the Python fast path (transport.read_file + HeaderCheck) accepts,
report absent and unreadable files as such, leave every other verdict to the Python reads
(ST_RECHECK), and put the same bytes where the payload goes. Loads through a mount with each
reader are compared in tests/test_client.py.
"""

from __future__ import annotations

import errno
import os
import random
import struct
from pathlib import Path

import pytest
import xxhash

import kvfs
from kvfs.client import transport
from kvfs.format import blockfile

from .conftest import drop_cached

try:
    from kvfs.client import _fastread as fastread
except ImportError:
    if os.environ.get("CI") == "true":  # CI builds it (tools/setup.sh): not built is a failure
        raise
    pytest.skip("kvfs.client._fastread is not built (tools/setup.sh builds it)",
                allow_module_level=True)

SMALL = kvfs.ModelSpec(model="org/m", revision="r1", kv_dtype="bfloat16", block_size=16,
                       num_layers=2, num_kv_heads=2, head_dim=33)  # padded, one transfer
#: Above ONE_READ_BYTES: read and hashed in pieces, padded.
BIG = kvfs.ModelSpec(model="org/big", revision="r1", kv_dtype="bfloat16", block_size=16,
                     num_layers=4, num_kv_heads=4, head_dim=1030)


def test_the_extension_is_built():
    """CI builds it (tools/setup.sh), and fails at this module's import if it did not: a load
    that silently fell back to Python would hide a broken build behind slower loads."""
    assert fastread.KERNEL in ("avx512", "avx2", "default")


def test_its_format_constants_are_the_formats():
    b = blockfile
    assert fastread.HEADER_SIZE == b.HEADER_SIZE
    assert (fastread.BHASH_OFF, fastread.FP_OFF, fastread.CSUM_OFF, fastread.HCSUM_OFF) == (
        b._BHASH_OFF, b._FP_OFF, b._CSUM_OFF, b._HCSUM_OFF)
    assert (fastread.SUMS_OFF, fastread.SUMS_END, fastread.SUMS_PRIME) == (
        b._SUMS_OFF, b._SUMS_END, b.SUMS_PRIME)
    assert (fastread.HASH_PIECE, fastread.ONE_READ_BYTES) == (
        transport.HASH_PIECE, transport.ONE_READ_BYTES)


@pytest.mark.parametrize("n", [0, 1, 17, 240, 241, 1000, 4096, 100_003, 1 << 20, 3 << 20])
def test_xxh3_is_pythons(n):
    data = random.Random(n).randbytes(n)
    assert fastread.xxh3_64(data) == xxhash.xxh3_64_intdigest(data)


def _check(spec: kvfs.ModelSpec) -> blockfile.HeaderCheck:
    return blockfile.HeaderCheck(fingerprint=spec.fingerprint, token_count=spec.block_size,
                                 dtype=spec.kv_dtype, shape=spec.block_shape)


def _block(spec: kvfs.ModelSpec, h: bytes, seed: int, **kw) -> bytes:
    payload = random.Random(seed).randbytes(spec.block_payload_bytes)
    return blockfile.encode(block_hash=h, parent_hash=b"p" * 16, fingerprint=spec.fingerprint,
                            token_count=spec.block_size, dtype=spec.kv_dtype,
                            shape=spec.block_shape, payload=payload, **kw)


def _damages(spec: kvfs.ModelSpec, good: bytes) -> dict[str, bytes | None]:
    """Named block files: None for no file at all."""

    def flip(at: int) -> bytes:
        b = bytearray(good)
        b[at] ^= 0x20
        return bytes(b)

    cases: dict[str, bytes | None] = {"sound": good, "absent": None,
                                      "longer": good + b"\0", "padding cut": good[:-1],
                                      "payload cut": good[:4096 + spec.block_payload_bytes // 2],
                                      "header only": good[:4096], "empty": b"",
                                      "payload byte": flip(4096 + spec.block_payload_bytes - 3),
                                      "first payload byte": flip(4096)}
    for at in (0, 8, 12, 16, 31, 32, 48, 100, 159, 160, 168, 176, 184, 188, 191, 192, 4095):
        cases[f"header byte {at}"] = flip(at)
    v2 = bytearray(_block(spec, b"h" * 16, 1, sums=True))
    cases["version 2"] = bytes(v2)
    # Row sum out of range, with a header checksum that matches: only the range check says no.
    struct.pack_into("<I", v2, blockfile._SUMS_OFF + 8, blockfile.SUMS_PRIME)
    struct.pack_into("<Q", v2, blockfile._HCSUM_OFF, 0)
    struct.pack_into("<Q", v2, blockfile._HCSUM_OFF, xxhash.xxh3_64_intdigest(bytes(v2[:4096])))
    cases["version 2, sums out of range"] = bytes(v2)
    return cases


def _python_verdict(path: str, h: bytes, check: blockfile.HeaderCheck, views, want: bool
                    ) -> str:
    header = bytearray(4096)
    probe = memoryview(bytearray(check.file_size - 4096 - check.payload_len + 1))
    try:
        total, csum = transport.read_file(path, memoryview(header), views, probe, want)
    except FileNotFoundError:
        return "absent"
    except OSError:
        return "error"
    fast = check.payload_checksum(header, h)
    if total == check.file_size and fast is not None and (csum is None or csum == fast):
        return "ok"
    return "recheck"


VERDICT = {fastread.ST_OK: "ok", fastread.ST_ABSENT: "absent", fastread.ST_OSERROR: "error",
           fastread.ST_RECHECK: "recheck"}


def _dests(spec: kvfs.ModelSpec, pieces: int) -> list[memoryview]:
    """The payload's destination as ``pieces`` buffers (paged layouts give one per layer)."""
    n = spec.block_payload_bytes
    cuts = [0, *sorted(random.Random(pieces).sample(range(1, n), pieces - 1)), n]
    return [memoryview(bytearray(cuts[k + 1] - cuts[k])) for k in range(pieces)]


@pytest.mark.parametrize("spec", [SMALL, BIG], ids=["one transfer", "in pieces"])
@pytest.mark.parametrize("pieces", [1, 3])
@pytest.mark.parametrize("want", [True, False], ids=["checksummed", "unchecked"])
def test_every_verdict_is_the_python_reads(tmp_path: Path, spec, pieces, want):
    h = b"h" * 16
    check = _check(spec)
    good = _block(spec, h, 1)
    cases = _damages(spec, good)
    payload = good[4096:4096 + spec.block_payload_bytes]
    (tmp_path / "a directory").mkdir()
    paths, expect = [], []
    for k, (name, data) in enumerate(cases.items()):
        path = str(tmp_path / f"{k}.kv")
        if data is not None:
            Path(path).write_bytes(data)
        paths.append(path)
        expect.append((name, _python_verdict(path, h, check, _dests(spec, pieces), want)))
    paths.append(str(tmp_path / "a directory"))
    expect.append(("a directory", "error"))
    assert dict(expect)["sound"] == "ok" and dict(expect)["payload byte"] == (
        "recheck" if want else "ok")
    for (name, verdict), path in zip(expect, paths, strict=True):
        data = cases.get(name)
        dests = _dests(spec, pieces)
        reads = fastread.Reads([path], [dests], [h], bytes([want]), *check.expected,
                               spec.block_payload_bytes, check.file_size)
        reads.run()
        [(status, total, err)] = reads.results()
        assert VERDICT[status] == verdict, name
        if status == fastread.ST_OK:
            assert data is not None and b"".join(dests) == data[4096:4096 + len(payload)], name
            assert total == check.file_size
        if status == fastread.ST_OSERROR:
            assert err != 0, name


def test_no_block_past_a_failure_is_read(tmp_path: Path):
    spec, check = SMALL, _check(SMALL)
    hashes = [bytes([i]) * 16 for i in range(8)]
    paths = []
    for i, h in enumerate(hashes):
        paths.append(str(tmp_path / f"{i}.kv"))
        if i != 3:
            Path(paths[-1]).write_bytes(_block(spec, h, i))
    dests = [[memoryview(bytearray(spec.block_payload_bytes))] for _ in hashes]
    reads = fastread.Reads(paths, dests, hashes, bytes([1] * 8), *check.expected,
                           spec.block_payload_bytes, check.file_size)
    reads.run()
    got = [s for s, _, _ in reads.results()]
    assert got == [fastread.ST_OK] * 3 + [fastread.ST_ABSENT] + [fastread.ST_NOT_READ] * 4


def test_bad_arguments_are_refused(tmp_path: Path):
    spec, check = SMALL, _check(SMALL)
    n = spec.block_payload_bytes
    ok = ([str(tmp_path / "x")], [[memoryview(bytearray(n))]], [b"h" * 16], b"\1",
          *check.expected, n, check.file_size)
    fastread.Reads(*ok)
    with pytest.raises(ValueError, match="payload"):
        fastread.Reads(*ok[:1], [[memoryview(bytearray(n - 1))]], *ok[2:])
    with pytest.raises(ValueError, match="length"):
        fastread.Reads(*ok[:3], b"\1\1", *ok[4:])
    with pytest.raises(ValueError, match="block hash"):
        fastread.Reads(*ok[:2], [b"h" * 15], *ok[3:])
    with pytest.raises(BufferError):  # read-only memory
        fastread.Reads(*ok[:1], [[bytes(n)]], *ok[2:])
    with pytest.raises(ValueError, match="block format"):
        fastread.Reads(*ok[:-1], n + 4096 + 9000)


def test_threads_share_one_load(tmp_path: Path):
    """Many threads on one Reads: each block read once, all of them sound."""
    from concurrent.futures import ThreadPoolExecutor

    spec, check = SMALL, _check(SMALL)
    hashes = [i.to_bytes(16, "big") for i in range(200)]
    paths, blocks = [], []
    for i, h in enumerate(hashes):
        paths.append(str(tmp_path / f"{i}.kv"))
        blocks.append(_block(spec, h, i))
        Path(paths[-1]).write_bytes(blocks[-1])
    dests = [[memoryview(bytearray(spec.block_payload_bytes))] for _ in hashes]
    reads = fastread.Reads(paths, dests, hashes, bytes([1] * 200), *check.expected,
                           spec.block_payload_bytes, check.file_size)
    with ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(reads.run) for _ in range(4)]:
            f.result()
    assert all(s == fastread.ST_OK for s, _, _ in reads.results())
    for d, b in zip(dests, blocks, strict=True):
        assert bytes(d[0]) == b[4096:4096 + spec.block_payload_bytes]


#: 9 MiB: a cold block's rest is one long transfer.
HUGE = kvfs.ModelSpec(model="org/huge", revision="r1", kv_dtype="bfloat16", block_size=16,
                      num_layers=3, num_kv_heads=8, head_dim=6001)


@pytest.mark.parametrize("spec", [BIG, HUGE], ids=["1 MiB", "9 MiB"])
@pytest.mark.parametrize("pieces", [1, 3])
def test_cold_blocks_get_the_same_verdicts(tmp_path: Path, spec, pieces):
    """A checksummed block not in the page cache takes the other branch: its first piece
    comes back short (RWF_NOWAIT), the rest in one transfer, hashed after."""
    assert spec.block_payload_bytes % 4096
    h, check = b"h" * 16, _check(spec)
    good = _block(spec, h, 2)
    n = spec.block_payload_bytes
    cases = {"sound": good, "last payload byte": bytearray(good), "longer": good + b"\0",
             "payload cut": good[:4096 + n // 2 + 5], "padding cut": good[:-1]}
    cases["last payload byte"][4096 + n - 1] ^= 0x40
    for name, data in cases.items():
        path = str(tmp_path / "block.kv")
        Path(path).write_bytes(data)
        drop_cached(path)
        expect = _python_verdict(path, h, check, _dests(spec, pieces), True)
        drop_cached(path)
        dests = _dests(spec, pieces)
        reads = fastread.Reads([path], [dests], [h], b"\1", *check.expected, n,
                               check.file_size)
        reads.run()
        [(status, total, _)] = reads.results()
        assert VERDICT[status] == expect, name
        assert (name == "sound") == (status == fastread.ST_OK), name
        if status == fastread.ST_OK:
            assert b"".join(dests) == bytes(data[4096:4096 + n])


def test_the_blocks_to_checksum_are_taken_first(tmp_path: Path):
    """They take longest: taken first, they leave the others to fill the threads' ends. One
    thread here, so the order shows: blocks 1 and 3 (checksummed) are read before block 0
    is found absent, block 2 after it is not read."""
    spec, check = SMALL, _check(SMALL)
    hashes = [bytes([i]) * 16 for i in range(4)]
    paths = [str(tmp_path / f"{i}.kv") for i in range(4)]
    for i in (1, 2, 3):
        Path(paths[i]).write_bytes(_block(spec, hashes[i], i))
    dests = [[memoryview(bytearray(spec.block_payload_bytes))] for _ in hashes]
    reads = fastread.Reads(paths, dests, hashes, bytes([0, 1, 0, 1]), *check.expected,
                           spec.block_payload_bytes, check.file_size)
    reads.run()
    assert [s for s, _, _ in reads.results()] == [
        fastread.ST_ABSENT, fastread.ST_OK, fastread.ST_NOT_READ, fastread.ST_OK]


# -- writes: kvfs.client._fastread.write_block, the save path's per-block work ---------------------


def _zero_checksum_header(spec: kvfs.ModelSpec, h: bytes, **kw) -> bytes:
    """The header a save hands to write_block: everything but the payload checksum."""
    return blockfile.encode_header(blockfile.BlockHeader(
        block_hash=h, parent_hash=b"p" * 16, fingerprint=spec.fingerprint,
        token_count=spec.block_size, dtype=spec.kv_dtype, shape=spec.block_shape,
        payload_len=spec.block_payload_bytes, checksum=0, **kw))


@pytest.mark.parametrize("spec", [SMALL, BIG], ids=["one transfer", "in pieces"])
@pytest.mark.parametrize("pieces", [1, 3, 40])
def test_a_written_block_is_the_python_encoding(tmp_path: Path, spec, pieces):
    """Byte for byte the block blockfile.encode makes of the same payload (header, checksum,
    padding), in a fan-out directory it makes, renamed from a temporary that is then gone."""
    h = b"h" * 16
    good = _block(spec, h, 1)
    payload = good[4096:4096 + spec.block_payload_bytes]
    bufs = _dests(spec, pieces)
    off = 0
    for b in bufs:
        b[:] = payload[off:off + b.nbytes]
        off += b.nbytes
    final = tmp_path / "ab" / "block.kv"
    tmp = tmp_path / "ab" / ".tmp-block"
    pad = len(good) - 4096 - spec.block_payload_bytes
    csum = fastread.write_block(str(tmp), str(final), _zero_checksum_header(spec, h), bufs,
                                pad, False)
    assert final.read_bytes() == good
    assert csum == blockfile.decode_header(good[:4096]).checksum
    assert not tmp.exists()
    # Version 2 (payload sums from a device) keeps its sums; fsync asked for.
    sums = blockfile.payload_sums(payload)
    v2 = _block(spec, h, 1, sums=True)
    fastread.write_block(str(tmp), str(tmp_path / "v2.kv"),
                         _zero_checksum_header(spec, h, sums=sums), bufs, pad, True)
    assert (tmp_path / "v2.kv").read_bytes() == v2


def test_a_failed_write_leaves_nothing(tmp_path: Path):
    spec = SMALL
    h = b"h" * 16
    bufs = [memoryview(bytearray(spec.block_payload_bytes))]
    header = _zero_checksum_header(spec, h)
    # The temporary name is taken: refused (O_EXCL), the other file left as it was.
    (tmp_path / "taken").write_bytes(b"other")
    with pytest.raises(FileExistsError):
        fastread.write_block(str(tmp_path / "taken"), str(tmp_path / "f.kv"), header, bufs, 0,
                             False)
    assert (tmp_path / "taken").read_bytes() == b"other"
    assert not (tmp_path / "f.kv").exists()
    # The rename fails (no such directory): the temporary is removed.
    with pytest.raises(FileNotFoundError):
        fastread.write_block(str(tmp_path / "t"), str(tmp_path / "no" / "f.kv"), header, bufs,
                             0, False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    # Bad arguments: refused before anything is made.
    for args, match in (((header[:100], bufs, 0), "header"),
                        ((header, bufs, 4096), "padding"),
                        ((header, [], 0), "payload"),
                        ((header, [memoryview(bytearray(0))], 0), "empty")):
        with pytest.raises(ValueError, match=match):
            fastread.write_block(str(tmp_path / "t"), str(tmp_path / "f.kv"), args[0],
                                 args[1], args[2], False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_a_copy_whose_memory_changed_is_not_placed(tmp_path: Path):
    """write_block's `expect` (the write-behind of a block fetched from a shared tier): a
    payload whose checksum is not the one it was fetched with is not renamed into place."""
    spec = SMALL
    h = b"h" * 16
    good = _block(spec, h, 1)
    payload = bytearray(good[4096:4096 + spec.block_payload_bytes])
    want = blockfile.decode_header(good[:4096]).checksum
    pad = len(good) - 4096 - spec.block_payload_bytes
    header = _zero_checksum_header(spec, h)
    final = tmp_path / "f.kv"
    assert fastread.write_block(str(tmp_path / "t"), str(final), header,
                                [memoryview(payload)], pad, False, want) == want
    assert final.read_bytes() == good
    final.unlink()
    payload[7] ^= 1  # the destination was reused before the copy was written
    with pytest.raises(OSError) as exc:
        fastread.write_block(str(tmp_path / "t"), str(final), header, [memoryview(payload)],
                             pad, False, want)
    assert exc.value.errno == errno.EBADMSG
    assert list(tmp_path.iterdir()) == []
