"""Tests for kvfs.format.hashing: pinned vectors, chaining, names and model fingerprints."""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys
from array import array

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvfs.format.hashing import (
    ROOT_PARENT,
    ModelSpec,
    block_filename,
    block_hashes,
    block_relpath,
    hash_hex,
    parse_block_filename,
    parse_hash,
    parse_namespace,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Pinned test vectors (also listed in docs/format.md). Never change them: a change means
# every stored block is orphaned.
V_PLAIN = ["f520289e34e96253d3ff7f0eb2c0a4ca", "4f019deaef48ee034fc45d0ba349abaa"]
V_LORA = ["4e3619fe03324e19351e3077831e7f30", "b6201a83f48cf44611f4dc5428fdf847"]
V_PARENT = ["a34386679f194e705b6cf25b631d13dc"]  # range(16), parent = bytes(range(16))
SPEC = ModelSpec("meta-llama/Llama-3.1-8B-Instruct", "main", "bfloat16", 16, 32, 8, 128)
V_FINGERPRINT = "d63a9e59af86df24757cd7b66c825fbc"
V_NAMESPACE = "meta-llama--Llama-3.1-8B-Instruct@d63a9e59af86df24"


def reference(tokens: list[int], block_size: int, parent: bytes, extra: bytes) -> list[bytes]:
    """The recipe from docs/format.md, written as plainly as possible."""
    out, h = [], parent
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        msg = b"kvfs-block-v1\x00" + h + struct.pack("<I", len(extra)) + extra
        msg += struct.pack(f"<{block_size}I", *block)
        h = xxhash.xxh3_128(msg, seed=0).digest()
        out.append(h)
    return out


def test_vectors() -> None:
    assert [h.hex() for h in block_hashes(range(32), 16)] == V_PLAIN
    assert [h.hex() for h in block_hashes(range(32), 16, extra="lora:1")] == V_LORA
    assert [h.hex() for h in block_hashes(range(32), 16, extra=b"lora:1")] == V_LORA
    assert [h.hex() for h in block_hashes(range(16), 16, parent=bytes(range(16)))] == V_PARENT


def test_vectors_match_reference() -> None:
    toks = list(range(32))
    assert [h.hex() for h in reference(toks, 16, ROOT_PARENT, b"")] == V_PLAIN
    assert [h.hex() for h in reference(toks, 16, ROOT_PARENT, b"lora:1")] == V_LORA
    assert [h.hex() for h in reference(toks[:16], 16, bytes(range(16)), b"")] == V_PARENT


def test_chain_and_partial_tail() -> None:
    full = block_hashes(range(32), 16)
    assert block_hashes(range(16, 32), 16, parent=full[0]) == full[1:]
    assert block_hashes(range(47), 16) == full  # 15-token tail gets no hash
    assert block_hashes(range(15), 16) == []
    assert block_hashes([], 16) == []
    assert block_hashes(range(32), 16, parent=None) == block_hashes(
        range(32), 16, parent=ROOT_PARENT
    )
    assert block_hashes(range(32), 16, extra=None) == block_hashes(range(32), 16, extra=b"")


def test_input_types() -> None:
    want = block_hashes(list(range(32)), 16)
    assert block_hashes(tuple(range(32)), 16) == want
    assert block_hashes(array("I", range(32)), 16) == want
    assert block_hashes(array("q", range(32)), 16) == want
    assert block_hashes(iter(range(32)), 16) == want
    assert block_hashes([2**32 - 1] * 4, 4) == reference([2**32 - 1] * 4, 4, ROOT_PARENT, b"")


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_token_range(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"token id {bad} at index 3"):
        block_hashes([1, 2, 3, bad], 2)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="index 1"):
        block_hashes([1, 2.5], 1)
    for bs in (0, -4, 1.0, True):
        with pytest.raises(ValueError, match="block_size"):
            block_hashes([1, 2], bs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="parent"):
        block_hashes([1, 2], 1, parent=bytes(15))


def test_deterministic_across_processes() -> None:
    code = (
        "from kvfs.format.hashing import block_hashes, ModelSpec;"
        "print(block_hashes(range(32), 16, extra='lora:1')[1].hex());"
        "print(ModelSpec('m', 'r', 'float16', 16, 2, 2, 64, extras={'b': '1', 'a': '2'}).namespace)"
    )
    outs = set()
    for seed in ("0", "12345"):
        path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=path)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outs.add(out.stdout)
    assert len(outs) == 1
    assert outs.pop().splitlines()[0] == V_LORA[1]


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=64),
    st.integers(1, 9),
    st.binary(min_size=16, max_size=16),
    st.binary(max_size=8),
)
def test_matches_reference(tokens: list[int], bs: int, parent: bytes, extra: bytes) -> None:
    assert block_hashes(tokens, bs, parent=parent, extra=extra) == reference(
        tokens, bs, parent, extra
    )


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(1, 5), st.integers(0, 8))
def test_split_chains(tokens: list[int], bs: int, nblocks: int) -> None:
    whole = block_hashes(tokens, bs)
    cut = min(nblocks, len(whole))
    head = block_hashes(tokens[: cut * bs], bs)
    tail = block_hashes(tokens[cut * bs :], bs, parent=head[-1] if head else None)
    assert head + tail == whole


def test_extra_and_order_matter() -> None:
    base = block_hashes(range(8), 4)
    assert block_hashes(range(8), 4, extra="x") != base
    assert block_hashes(range(8), 4, extra="x")[1] != block_hashes(range(8), 4, extra="y")[1]
    assert block_hashes([1, 0, 2, 3], 4) != block_hashes([0, 1, 2, 3], 4)
    assert block_hashes(range(8), 4)[0] != block_hashes(range(8), 2)[1]


def test_hex_and_names() -> None:
    h = bytes.fromhex(V_PLAIN[0])
    assert hash_hex(h) == V_PLAIN[0]
    assert parse_hash(V_PLAIN[0]) == h
    assert parse_hash(V_PLAIN[0].upper()) == h
    for bad in ("", "xyz", V_PLAIN[0][:-1], V_PLAIN[0] + "0", " " + V_PLAIN[0][1:], 7):
        with pytest.raises(ValueError):
            parse_hash(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        hash_hex(b"short")
    assert block_filename(h) == V_PLAIN[0] + ".kv"
    assert block_relpath(h) == "f5/" + V_PLAIN[0] + ".kv"
    assert parse_block_filename(block_filename(h)) == h
    for bad in (
        V_PLAIN[0],
        V_PLAIN[0].upper() + ".kv",
        V_PLAIN[0][:-1] + ".kv",
        V_PLAIN[0] + ".kv.tmp",
        V_PLAIN[0] + ".kv\n",
        "." + V_PLAIN[0] + ".kv",
    ):
        assert parse_block_filename(bad) is None


def test_fingerprint_vector() -> None:
    assert SPEC.fingerprint.hex() == V_FINGERPRINT
    assert SPEC.namespace == V_NAMESPACE
    assert parse_namespace(V_NAMESPACE) == ("meta-llama--Llama-3.1-8B-Instruct", V_FINGERPRINT[:16])
    assert SPEC.canonical_bytes() == (
        b'{"block_size":16,"extras":{},"head_dim":128,"kv_dtype":"bfloat16",'
        b'"kvfs_fingerprint":1,"model":"meta-llama/Llama-3.1-8B-Instruct","num_kv_heads":8,'
        b'"num_layers":32,"revision":"main","tp_rank":0,"tp_size":1}'
    )
    assert SPEC.fingerprint == xxhash.xxh3_128_digest(SPEC.canonical_bytes())


def test_fingerprint_vector_with_extras() -> None:
    spec = ModelSpec(
        "Qwen/Qwen2.5-7B-Instruct", "a09a3545", "float8_e4m3fn", 16, 28, 4, 128,
        tp_size=2, tp_rank=1, extras={"kv_scale": "per-tensor"},
    )  # fmt: skip
    assert spec.fingerprint.hex() == "57fc5b96353896c06383f764c62c4470"
    assert spec.namespace == "Qwen--Qwen2.5-7B-Instruct@57fc5b96353896c0"


@pytest.mark.parametrize(
    "change",
    [
        {"model": "meta-llama/Llama-3.1-8B"},
        {"revision": "0e9e39f"},
        {"kv_dtype": "float16"},
        {"block_size": 32},
        {"num_layers": 31},
        {"num_kv_heads": 4},
        {"head_dim": 64},
        {"tp_size": 2},
        {"tp_size": 2, "tp_rank": 1},
        {"extras": {"salt": "x"}},
    ],
)
def test_every_field_changes_fingerprint(change: dict) -> None:
    other = dataclasses.replace(SPEC, **change)
    assert other.fingerprint != SPEC.fingerprint
    assert other.namespace != SPEC.namespace


def test_extras_frozen_and_order_free() -> None:
    a = dataclasses.replace(SPEC, extras={"b": "1", "a": "2"})
    b = dataclasses.replace(SPEC, extras={"a": "2", "b": "1"})
    assert a == b and hash(a) == hash(b) and a.fingerprint == b.fingerprint
    assert a.extras["a"] == "2" and dict(a.extras) == {"a": "2", "b": "1"}
    with pytest.raises(TypeError):
        a.extras["c"] = "3"  # type: ignore[index]
    assert len({SPEC, a, b}) == 2


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model": ""}, "model"),
        ({"revision": None}, "revision"),
        ({"kv_dtype": "float4"}, "kv_dtype"),
        ({"block_size": 0}, "block_size"),
        ({"num_layers": -1}, "num_layers"),
        ({"num_kv_heads": 1.5}, "num_kv_heads"),
        ({"head_dim": True}, "head_dim"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_rank": 1}, "tp_rank"),
        ({"tp_rank": -1}, "tp_rank"),
        ({"extras": {"a": 1}}, "extras"),
    ],
)
def test_spec_validation(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(SPEC, **change)


def test_shape_and_size() -> None:
    assert SPEC.block_shape == (32, 2, 16, 8, 128)
    assert SPEC.block_payload_bytes == 32 * 2 * 16 * 8 * 128 * 2


def test_manifest_round_trip() -> None:
    spec = dataclasses.replace(SPEC, tp_size=4, tp_rank=3, extras={"salt": "s"})
    m = spec.manifest()
    assert m["fingerprint"] == spec.fingerprint.hex()
    assert m["namespace"] == spec.namespace and m["format_version"] == 1
    raw = spec.manifest_json()
    assert raw.endswith(b"}\n") and b'\n  "block_size": 16,' in raw
    assert ModelSpec.from_manifest(raw) == spec
    assert ModelSpec.from_manifest(raw.decode()) == spec
    assert ModelSpec.from_manifest(m) == spec


@pytest.mark.parametrize(
    "change",
    [
        {"num_layers": 33},
        {"fingerprint": "00" * 16},
        {"fingerprint": None},
        {"namespace": "x@0000000000000000"},
        {"format_version": 2},
        {"model": None},
    ],
)
def test_manifest_rejects_tampering(change: dict) -> None:
    m = SPEC.manifest()
    for k, v in change.items():
        if v is None:
            del m[k]
        else:
            m[k] = v
    with pytest.raises(ValueError):
        ModelSpec.from_manifest(m)


def test_manifest_rejects_garbage() -> None:
    for bad in (b"not json", b"[1, 2]", "{}"):
        with pytest.raises(ValueError):
            ModelSpec.from_manifest(bad)


@pytest.mark.parametrize(
    ("model", "slug"),
    [
        ("Qwen/Qwen2.5-7B", "Qwen--Qwen2.5-7B"),
        ("local model:v2", "local_model_v2"),
        (".hidden/x", "_hidden--x"),
        ("../../etc", "_.--..--etc"),
        ("é@/x", "__--x"),
        ("a" * 300, "a" * 200),
    ],
)
def test_namespace_slug(model: str, slug: str) -> None:
    ns = dataclasses.replace(SPEC, model=model).namespace
    got = parse_namespace(ns)
    assert got is not None and got[0] == slug
    assert "/" not in ns and not ns.startswith(".")


def test_parse_namespace_rejects() -> None:
    for bad in ("x@123", "x@" + "g" * 16, "@" + "0" * 16, ".x@" + "0" * 16, "x", "a/b@" + "0" * 16):
        assert parse_namespace(bad) is None
