"""kvfs.client.cpus: the client's I/O threads run on every CPU the process may use, whatever
binding the thread that starts them has (vLLM's CPU build binds its main thread to the model's
cores), unless KVFS_IO_CPUS says otherwise."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvfs.client import cpus

ALL = set(range(os.cpu_count() or 1))
pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                reason="needs two CPUs to bind a thread to fewer")


def _in_bound_thread(fn):
    """fn's result in a thread bound to one CPU, as an engine's main thread is."""
    out = {}

    def run():
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        out["r"] = fn()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["r"]


def _pool_thread_cpus():
    with ThreadPoolExecutor(1, initializer=cpus.spread) as pool:
        return pool.submit(os.sched_getaffinity, 0).result()


def test_a_pool_started_by_a_bound_thread_runs_on_every_cpu(monkeypatch):
    monkeypatch.delenv(cpus.ENV, raising=False)
    allowed = os.sched_getaffinity(0)
    assert _in_bound_thread(_pool_thread_cpus) == allowed
    # without the initializer its threads inherit the one CPU: what kvfs undoes
    with_inherit = _in_bound_thread(
        lambda: ThreadPoolExecutor(1).submit(os.sched_getaffinity, 0).result())
    assert len(with_inherit) == 1


def test_kvfs_io_cpus_names_the_cpus_or_keeps_the_binding(monkeypatch):
    first = min(os.sched_getaffinity(0))
    monkeypatch.setenv(cpus.ENV, "inherit")
    assert _in_bound_thread(_pool_thread_cpus) == {first}
    other = max(os.sched_getaffinity(0))
    monkeypatch.setenv(cpus.ENV, str(other))
    assert _in_bound_thread(_pool_thread_cpus) == {other}
    monkeypatch.setenv(cpus.ENV, "3-1")  # malformed: said, and every CPU
    assert _in_bound_thread(_pool_thread_cpus) == os.sched_getaffinity(0)


def test_parse_reads_linux_cpu_lists():
    assert cpus.parse("0-3,8") == {0, 1, 2, 3, 8}
    assert cpus.parse(" 5 ") == {5}
    for bad in ("", "a", "3-1", "-1", ","):
        with pytest.raises(ValueError):
            cpus.parse(bad)

