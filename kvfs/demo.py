"""`kvfs demo`: a mount over a default backing directory with real KV blocks flowing in it.

It mounts ``DIR/mnt`` over ``DIR/backing`` (capacity 1 GiB), adds a tenant owned by the
invoking user, writes a chain of kvfs-native blocks through the mount the way an engine's
file backend does (temporary name, then rename), and shows what an operator sees: ``ls -l``,
``du -sh``, ``df -h``, ``getfattr`` and ``kvfs status``. The mount stays up for exploring;
``kvfs umount DIR/mnt`` ends it.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

from . import blockfile, hashing

KVFS = [sys.executable, "-m", "kvfs.cli"]

SPEC = hashing.ModelSpec(model="demo/tiny-llama", revision="r1", kv_dtype="float16",
                         block_size=16, num_layers=4, num_kv_heads=2, head_dim=64)


def _show(title: str, argv: list[str]) -> None:
    print(f"\n$ {title}")
    sys.stdout.flush()
    subprocess.run(argv, check=False)


def _owner() -> tuple[int, int]:
    uid = int(os.environ.get("SUDO_UID", os.getuid()))
    gid = int(os.environ.get("SUDO_GID", os.getgid()))
    return uid, gid


def write_blocks(ns_dir: str, token_ids: list[int], seed: int = 0) -> list[bytes]:
    """Write the blocks of `token_ids` the way an engine's file backend does."""
    rng = random.Random(seed)
    hashes = hashing.block_hashes(token_ids, SPEC.block_size)
    parent = hashing.ROOT_PARENT
    for h in hashes:
        path = os.path.join(ns_dir, hashing.block_relpath(h))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        payload = rng.randbytes(SPEC.block_payload_bytes)
        data = blockfile.encode(block_hash=h, parent_hash=parent, fingerprint=SPEC.fingerprint,
                                token_count=SPEC.block_size, dtype=SPEC.kv_dtype,
                                shape=SPEC.block_shape, payload=payload)
        tmp = os.path.join(os.path.dirname(path), f".tmp.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        parent = h
    return hashes


def run_demo(base: str) -> int:
    base = os.path.abspath(base)
    backing, mnt = os.path.join(base, "backing"), os.path.join(base, "mnt")
    os.makedirs(backing, exist_ok=True)
    os.makedirs(mnt, exist_ok=True)
    if os.path.ismount(mnt):
        subprocess.run([*KVFS, "umount", mnt], check=True)
    subprocess.run([*KVFS, "mount", backing, mnt, "--capacity", "1G"], check=True)
    uid, gid = _owner()
    tenant = os.path.join(mnt, "demo")
    if not os.path.isdir(tenant):
        subprocess.run([*KVFS, "tenant", "add", mnt, "demo", "--uid", str(uid), "--gid",
                        str(gid)], check=True)
    ns_dir = os.path.join(tenant, SPEC.namespace)
    os.makedirs(ns_dir, exist_ok=True)
    with open(os.path.join(ns_dir, "manifest.json"), "wb") as f:
        f.write(SPEC.manifest_json())
    # A system prompt shared by two conversations: their first blocks are the same files.
    system = list(range(1000, 1000 + 64))
    conv_a = write_blocks(ns_dir, system + list(range(5000, 5000 + 96)), seed=1)
    conv_b = write_blocks(ns_dir, system + list(range(9000, 9000 + 48)), seed=2)
    shared = len(set(conv_a) & set(conv_b))
    print(f"kvfs demo: wrote {len(conv_a)} + {len(conv_b)} blocks of {SPEC.block_size} tokens "
          f"({shared} shared by both conversations) into {ns_dir}")
    first = os.path.join(ns_dir, hashing.block_relpath(conv_a[-1]))
    _show(f"ls -l {os.path.dirname(first)}", ["ls", "-l", os.path.dirname(first)])
    _show(f"du -sh {tenant}", ["du", "-sh", tenant])
    _show(f"df -h {mnt}", ["df", "-h", mnt])
    _show(f"getfattr -d {first}", ["getfattr", "-d", first])
    _show(f"kvfs status {mnt}", [*KVFS, "status", mnt])
    print(f"\nThe mount stays up: explore {mnt}, then `kvfs umount {mnt}`.")
    return 0
