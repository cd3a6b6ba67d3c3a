"""Operating kvfs: Prometheus metrics, the audit log, systemd readiness, fstab, status/top."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from .conftest import KVFS, kvfs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_metrics_and_hit_rate_through_the_mount(mount_factory):
    pytest.importorskip("prometheus_client")
    port = free_port()
    m = mount_factory(extra=["--metrics", f"127.0.0.1:{port}"])
    kvfs("tenant", "add", str(m.mnt), "acme", "--uid", "0", "--gid", "0")
    ns = m.mnt / "acme" / "llama@0123456789abcdef"
    ns.mkdir()
    # An engine's cache lookup is exists() then open(); a miss is then computed and written
    # (the kernel's lookup before the create is the same miss, counted once).
    assert not (ns / "k1.bin").exists()
    (ns / "k1.bin").write_bytes(b"x" * 1000)
    assert not (ns / "k0.bin").exists() and not (ns / "k2.bin").exists()
    assert (ns / "k1.bin").read_bytes() == b"x" * 1000
    c = m.stats()["tenants"]["acme"]["llama@0123456789abcdef"]
    assert (c["mount_hits"], c["mount_misses"]) == (1, 3)
    time.sleep(1.5)  # the endpoint refreshes its snapshot once a second
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}

    def value(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    who = {"tenant": "acme", "model": "llama@0123456789abcdef"}
    assert value("kvfs_hit_blocks_total", door="mount", **who) == 1
    assert value("kvfs_miss_blocks_total", door="mount", **who) == 3
    assert value("kvfs_hit_ratio", **who) == 0.25
    assert value("kvfs_bytes", **who) == 1000
    assert value("kvfs_used_bytes", tier="hot") == 1000
    assert ("kvfs_fetch_amplification", tuple(sorted(who.items()))) not in samples  # no loads


def test_metrics_port_in_use_refuses_the_mount(mount_factory):
    pytest.importorskip("prometheus_client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        m = mount_factory(start=False)
        res = kvfs("mount", str(m.backing), str(m.mnt), "--metrics",
                   f"127.0.0.1:{s.getsockname()[1]}", check=False)
    assert res.returncode == 1 and "cannot serve metrics" in res.stderr
    assert not os.path.ismount(m.mnt)


def test_audit_log(mount_factory, tmp_path):
    audit = tmp_path / "audit.jsonl"
    m = mount_factory(extra=["--audit", str(audit)])
    kvfs("tenant", "add", str(m.mnt), "acme", "--uid", "0", "--gid", "0")
    ns = m.mnt / "acme" / "ns"
    ns.mkdir()
    (ns / "f").write_bytes(b"12345")
    (ns / "f").read_bytes()
    os.unlink(ns / "f")
    m.stop()
    recs = [json.loads(line) for line in audit.read_text().splitlines()]
    ops = [(r["op"], r["tenant"], r["model"], r["bytes"]) for r in recs if r["model"] == "ns"]
    assert ("write", "acme", "ns", 5) in ops and ("read", "acme", "ns", 5) in ops
    assert ("unlink", "acme", "ns", 5) in ops
    assert all(r["uid"] == 0 and r["pid"] > 0 for r in recs)


def test_audit_records_from_worker_threads_are_never_lost(tmp_path):
    """The keys' life is audited from worker threads while the event loop takes the buffer
    to write it: every record lands in exactly one take (an append to the list being taken
    was lost before the buffer had a lock: about 20 of 80,000 here)."""
    import threading

    from kvfs.daemon.audit import Audit

    a = Audit(str(tmp_path / "audit.jsonl"))
    n, threads = 20_000, 4

    def work(t: int) -> None:
        for i in range(n):
            a.record(uid=0, pid=t, tenant="t", model="", op="key-create", path="", key_id=i)

    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    taken = []
    while any(t.is_alive() for t in ts):
        taken.append(a._take())
    for t in ts:
        t.join()
    taken.append(a._take())
    a.close()
    recs = [json.loads(line) for chunk in taken for line in chunk.splitlines()]
    assert len(recs) == n * threads
    assert {(r["pid"], r["key_id"]) for r in recs} == {(t, i) for t in range(threads)
                                                       for i in range(n)}


def test_systemd_readiness(mount_factory, tmp_path):
    m = mount_factory(start=False)
    sock_path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(sock_path)
        sock.settimeout(30)
        env = dict(os.environ, NOTIFY_SOCKET=sock_path)
        proc = subprocess.Popen([*KVFS, "mount", "--foreground", str(m.backing), str(m.mnt),
                                 "--log", str(m.log)], env=env)
        try:
            assert sock.recv(100) == b"READY=1"
            assert os.path.ismount(m.mnt)
            proc.terminate()  # what systemctl stop does
            assert sock.recv(100) == b"STOPPING=1"
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    assert not os.path.ismount(m.mnt)


def test_top_and_status(mount):
    kvfs("tenant", "add", str(mount.mnt), "acme", "--uid", "0", "--gid", "0")
    (mount.mnt / "acme" / "ns").mkdir()
    (mount.mnt / "acme" / "ns" / "f").write_bytes(b"y" * 4096)
    out = kvfs("top", str(mount.mnt), "--interval", "0.2", "--count", "2").stdout
    assert "acme" in out and "HIT%" in out
    out = kvfs("status", str(mount.mnt)).stdout
    assert "acme" in out and "4.0 KiB" in out


def test_fstab_helper_translates_options():
    from kvfs.cli.fstab import translate

    assert translate("/b", "/m", "rw,_netdev,capacity=500G,shared=s3://k/p?region=x,debug,"
                     "x-systemd.automount,noauto") == [
        "mount", "/b", "/m", "--capacity", "500G", "--shared", "s3://k/p?region=x", "--debug"]
    with pytest.raises(ValueError, match="capacty"):
        translate("/b", "/m", "capacty=1G")


def test_mount_t_fuse_kvfs(mount_factory, tmp_path):
    helper = os.path.join(os.path.dirname(sys.executable), "mount.fuse.kvfs")
    if not os.path.exists(helper):
        pytest.skip("kvfs is not installed with its console scripts")
    m = mount_factory(start=False)
    link = "/sbin/mount.fuse.kvfs"
    made = False
    if not os.path.lexists(link):
        os.symlink(helper, link)
        made = True
    try:
        res = subprocess.run(["mount", "-t", "fuse.kvfs", str(m.backing), str(m.mnt), "-o",
                              f"capacity=64M,log={m.log},noauto,_netdev"],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        assert os.path.ismount(m.mnt)
        assert m.stats()["capacity_bytes"] == 64 << 20
        res = subprocess.run(["mount", "-t", "fuse.kvfs", str(m.backing), str(tmp_path), "-o",
                              "bogus=1"], capture_output=True, text=True)
        assert res.returncode != 0 and "bogus" in res.stderr
    finally:
        if made:
            os.unlink(link)


def test_systemd_unit_verifies(tmp_path):
    import shutil

    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    unit = open(os.path.join(here, "systemd", "kvfs@.service")).read()
    kvfs_bin = os.path.join(os.path.dirname(sys.executable), "kvfs")
    path = tmp_path / "kvfs@cache.service"
    path.write_text(unit.replace("/usr/local/bin/kvfs", kvfs_bin))
    res = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                         text=True)
    assert res.returncode == 0 and "kvfs@cache.service" not in res.stderr, res.stderr
    assert "Type=notify" in unit
