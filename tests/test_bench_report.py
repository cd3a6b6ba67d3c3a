"""Plots of benchmark records and `kvfs bench report`, from small hand-built records."""

from __future__ import annotations

import json
import os
import struct
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from kvfs.bench import common, harness, plot, records, report

from .conftest import kvfs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def conditions(tmp_path: Path) -> dict:
    return harness.conditions([str(tmp_path)])


def hitrate_record(tmp_path: Path, concurrency: bool = False) -> dict:
    rows = []
    for conc in ([1, 8, 32] if concurrency else [None]):
        for fraction, blocks, lru, kv, opt in ((0.1, 4392, 26.10, 27.21, 50.63),
                                               (0.25, 10981, 44.28, 46.81, 62.60)):
            for policy, hit in (("lru", lru), ("kvfs", kv)):
                row = {"policy": policy, "fraction": fraction, "capacity_blocks": blocks,
                       "block_hit": hit - (conc or 1) / 10, "token_hit": hit + 0.5,
                       "simulated_block_hit": hit, "optimum_block_hit": opt, "evictions": 9}
                if conc is not None:
                    row["sessions"] = conc
                rows.append(row)
    return {"benchmark": "hitrate", "trace": "/data/mooncake_synthetic_trace.jsonl",
            "requests": 3993, "distinct_blocks": 43924, "block_kib": 4,
            "scale": "each 512-token block stored as 4 KiB of payload", "rows": rows,
            "command": ["/usr/local/bin/kvfs", "bench", "hitrate", "--trace",
                        "mooncake_synthetic_trace.jsonl", "--policy", "lru"],
            "conditions": conditions(tmp_path)}


def crossover_record(tmp_path: Path) -> dict:
    rows = [{"tokens": t, "restored_tokens": t - 16, "recompute_ms": rec, "restore_ms": res,
             "speedup": round(rec / res, 2), "first_token": 7, "identical": True}
            for t, rec, res in ((16, 15.2, 16.6), (64, 23.9, 44.0), (128, 31.0, 10.4),
                                (1024, 265.1, 27.6))]
    return {"benchmark": "crossover", "block_size": 16, "page_cache": "warm", "repeats": 3,
            "rows": rows, "crossover_tokens": 128, "conditions": conditions(tmp_path)}


def restore_record(tmp_path: Path) -> dict:
    """The shape `kvfs bench restore` writes (flat rows with `path`)."""
    rows = []
    for mib in (1, 4, 16):
        for threads in (1, 4):
            for cache in ("cold", "warm"):
                for k, path in enumerate(("raw", "direct", "mount", "torch.load")):
                    gbps = (3.0 if cache == "warm" else 0.8) * mib ** 0.2 / (1 + k / 2)
                    rows.append({"path": path, "block_mib": mib, "threads": threads,
                                 "cache": cache, "gbps": gbps, "x_raw": 1 / (1 + k / 2),
                                 "p50_ms": 10.0 * mib * (1 + k / 2), "p99_ms": 30.0 * mib,
                                 "amplification": 1.0 if path != "raw" else None})
    record = {"benchmark": "restore", "rows": rows, "params": {"repeats": 5, "request_mib": 64},
              "control": {"blocks": 64, "payload_bytes": 8, "requests": 300,
                          "request_ms": 6.3, "request_p90_ms": 9.0, "request_p99_ms": 12.5,
                          "raw_preadv_ms": 0.35, "overhead_ms": 5.96, "client_cpu_ms": 2.1,
                          "control_calls_per_request": 2, "lookup_ms": 1.4, "load_ms": 4.9,
                          "setxattr_ms": 0.15, "setxattr_64_ms": 0.38},
              "verdicts": [{"target": "control overhead < 1 ms per 64-block request",
                            "met": False, "measured": 5.96}],
              "command": ["kvfs", "bench", "restore", "--quick", "--dir", "DIR"],
              "conditions": conditions(tmp_path)}
    return record


def degraded_record(tmp_path: Path) -> dict:
    """The shape `kvfs bench degraded` writes."""
    return {"benchmark": "degraded", "requests": 50, "tokens": 2048, "recompute_ms": 250.0,
            "fetch_timeout_s": 1.0, "tier_cooldown_s": 2.0, "rows": [
                {"condition": "miss", "count": 50, "p50_ms": 4.0, "p90_ms": 5.0,
                 "p99_ms": 8.0, "max_ms": 9.0, "hit_blocks": 0, "asked_blocks": 3200,
                 "latencies_ms": [4.0] * 50},
                {"condition": "s3-slow", "count": 50, "p50_ms": 60.0, "p90_ms": 90.0,
                 "p99_ms": 160.0, "max_ms": 170.0,
                 "hit_blocks": 3200, "asked_blocks": 3200, "paid_deadline": 0,
                 "paid_deadline_bound": 4},
                {"condition": "dead-silent", "count": 50, "p50_ms": 5.0, "p99_ms": 1009.0,
                 "hit_blocks": 0, "asked_blocks": 3200, "paid_deadline": 3,
                 "paid_deadline_bound": 4}],
            "skipped": {"s3": "SeaweedFS's weed binary is not installed"},
            "conditions": conditions(tmp_path)}


def mount_record(tmp_path: Path) -> dict:
    return {"benchmark": "mount", "params": {"files": 8, "size_mib": 128},
            "command": ["tools/bench_mount.py", "--json", "mount.json"],
            "rows": [{"figure": "seq read, warm cache, 1 thread", "kvfs": 3.46, "baseline": 3.96,
                      "unit": "GB/s", "baseline_name": "same files on the backing fs",
                      "target": ">= 0.6x", "ok": True, "ratio": 3.46 / 3.96},
                     {"figure": "ls -l (again), 100000 files in one dir", "kvfs": 25.95,
                      "baseline": 1.20, "unit": "s", "baseline_name": "plain dir",
                      "target": "<= 3x", "ok": False, "ratio": 25.95 / 1.20},
                     {"figure": "lookup p50, cold dentries", "kvfs": 85, "baseline": 10,
                      "unit": "us", "baseline_name": "stat", "target": "", "ok": None,
                      "ratio": 8.5}],
            "conditions": conditions(tmp_path)}


def tiers_record(tmp_path: Path) -> dict:
    return {"benchmark": "tiers", "command": "python tools/bench_tiers.py --quick",
            "params": {"repeats": 2, "blocks": 8},
            "restore": {"blocks": 8, "block_mib": 1,
                        "hot": {"gbps": 1.11, "baseline_gbps": 3.62},
                        "cold": {"gbps": 0.39, "baseline_gbps": 3.42, "copy_gbps": 1.48},
                        "s3": {"gbps": 0.16, "baseline_gbps": 0.35, "copy_gbps": 0.26}},
            "delays": [{"delay_ms": d, "latency_ms": {"p50": 63 + d, "p99": 164 + d},
                        "baseline_ms": {"p50": 50 + d, "p99": 136 + d}} for d in (0, 50, 200)],
            "rows": [{"figure": "restore from hot", "value": "1.11 GB/s",
                      "baseline": "3.62 GB/s (preadv of the hot files)", "ratio": 0.34,
                      "note": "8 x 1 MiB, 1 request"},
                     {"figure": "store down: later requests p50", "value": "5.0 ms",
                      "baseline": "78 ms (first)", "ratio": 0.064, "note": ""}],
            "problems": ["large restore: 34 fetched block files are not in the index"],
            "conditions": conditions(tmp_path)}


def unknown_record(tmp_path: Path) -> dict:
    return {"benchmark": "novel", "rows": [{"what": "x", "ms": 1.5}, {"what": "y"}],
            "conditions": conditions(tmp_path)}


KINDS = {"hitrate": hitrate_record, "crossover": crossover_record, "restore": restore_record,
         "degraded": degraded_record, "mount": mount_record, "tiers": tiers_record,
         "novel": unknown_record,
         "hitrate-concurrency": lambda p: hitrate_record(p, concurrency=True)}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("name", sorted(KINDS))
def test_draw_writes_a_png_for_each_kind(tmp_path, name):
    pytest.importorskip("matplotlib")
    png = tmp_path / f"{name}.png"
    assert report.draw(KINDS[name](tmp_path), str(png)) is True
    width, height = png_size(png)
    assert width > 300 and height > 200
    assert png.stat().st_size > 9_000  # axes, lines, labels: not an empty canvas (8.6 kB)
    assert [p.name for p in tmp_path.iterdir()] == [png.name]  # no temporary left behind


@pytest.mark.parametrize("name", ["hitrate", "crossover", "restore", "degraded", "tiers"])
def test_draw_takes_rows_with_missing_fields(tmp_path, name):
    pytest.importorskip("matplotlib")
    record = KINDS[name](tmp_path)
    for i, row in enumerate(record["rows"]):
        for key in list(row)[i % 3::3]:  # a different third of the fields from each row
            del row[key]
    png = tmp_path / "partial.png"
    assert report.draw(record, str(png)) is True
    png_size(png)


def test_draw_without_matplotlib_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    png = tmp_path / "x.png"
    assert report.draw(crossover_record(tmp_path), str(png)) is False
    assert plot.draw(crossover_record(tmp_path), str(png)) is False
    assert not png.exists()


def write_records(directory: Path, names: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        record = KINDS[name](directory)
        with_plot = report.draw(record, str(directory / f"{name}.png"))
        record["plot"] = f"{name}.png" if with_plot else None
        (directory / f"{name}.json").write_text(json.dumps(record))


def test_report_renders_each_section_table_and_image(tmp_path):
    pytest.importorskip("matplotlib")
    records = tmp_path / "docs" / "bench"
    write_records(records, ["hitrate", "crossover", "restore", "mount", "tiers", "novel"])
    (records / "mount.notes.md").write_text("**Why, as measured**: the per-request cost.\n")
    out = tmp_path / "docs" / "benchmarks.md"
    res = kvfs("bench", "report", "--records", str(records), "--output", str(out))
    assert "6 records" in res.stdout and "not yet measured: degraded" in res.stdout
    text = out.read_text()
    for title in ("## Crossover", "## Restore", "## Hit rate", "## Degraded tiers", "## Tiers",
                  "## Mount", "## Novel", "## GPU restore"):
        assert title in text
    for name in ("hitrate", "crossover", "restore", "mount", "tiers", "novel"):
        assert f"](bench/{name}.png)" in text  # relative to the document
    # the head: how to reproduce each, from the record's own command
    assert "`kvfs bench hitrate --trace mooncake_synthetic_trace.jsonl --policy lru`" in text
    assert "`python tools/bench_mount.py --json mount.json`" in text
    assert "`kvfs bench restore --quick --dir DIR`" in text
    # tables, with ratios against the baseline of the same run
    assert "| 10 % (4,392 blocks) | kvfs | 27.11 |" in text
    assert "| 25 % (10,981 blocks) | lru | 44.18 |" in text
    assert "4.5 %" in text  # kvfs closes (27.11 - 26.00) / (50.63 - 26.00) of LRU's gap
    assert "| 128 | 31.0 | 10.4 | 2.98x | yes |" in text
    assert "Restoring beats recomputing from **128 tokens** on." in text
    assert "| 4 MiB | warm | 4 | " in text and "(0.67x)" in text
    assert "5.960 ms of overhead" in text and "**missed**: control overhead" in text
    assert "(p90 9.000 ms, p99 12.500 ms) against 0.350 ms" in text
    assert "Latency per request of 64 MiB, p50 / p99 (ms):" in text
    assert "| 16 MiB | cold | 1 | 160.0 / 480.0 | 240.0 / 480.0 |" in text
    assert "| ls -l (again), 100000 files in one dir | 25.95 s | 1.20 s (plain dir) | 21.62x" \
        in text
    assert "**Targets missed**: ls -l (again)" in text
    assert "**Why, as measured**: the per-request cost." in text  # the sidecar notes
    assert "| store down: later requests p50 | 5.0 ms | 78 ms (first) | 0.064x |" in text
    assert "- large restore: 34 fetched block files" in text
    assert "| what | ms |" in text  # an unknown kind: its rows as they are
    # the conditions beside the figures: cores, memory, kernel, filesystem, versions, load
    cond = common.conditions([str(tmp_path)])
    assert f"{cond['cores']} cores ({cond['cpu']})" in text
    assert f"Linux {cond['kernel']}" in text and f"Python {cond['versions']['python']}" in text
    assert "load average" in text and "Parameters: repeats 5" in text
    assert str(tmp_path) not in text  # no path of the machine that ran it
    # what is missing says so, with the command to run
    degraded = text.split("## Degraded tiers")[1].split("\n## ")[0]
    assert "kvfs bench degraded --out docs/bench" in degraded
    assert "Not yet measured on this machine" in degraded
    gpu = text.split("## GPU restore")[1]
    assert "Needs a GPU" in gpu


def test_report_renders_concurrency_and_degraded(tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    for name in ("hitrate-concurrency", "degraded"):
        record = KINDS[name](tmp_path)
        (records / f"{name}.json").write_text(json.dumps(record))
    out = tmp_path / "b.md"
    count, missing = report.report(str(records), str(out))
    assert count == 2 and "degraded" not in missing and "hitrate" not in missing
    text = out.read_text()
    assert "| capacity | sessions | policy |" in text
    assert "| 10 % (4,392 blocks) | 32 | kvfs | 24.01 |" in text
    assert ("| dead-silent | 50 | 5.0 | - | 1009.0 | - | 1.25x | 126.12x | 4.04x | 0 / 3200 "
            "| 3 of 50 (4) |") in text
    assert ("| miss | 50 | 4.0 | 5.0 | 8.0 | 9.0 | baseline | baseline | 0.032x | 0 / 3200 | - |"
            in text)
    assert "Recomputing the same context instead: 250.0 ms" in text
    assert "Skipped: s3: SeaweedFS's weed binary is not installed" in text
    assert "recompute_ms" not in text.split("## Degraded")[1].split("Parameters:")[1]
    assert "No plot beside this record" in text  # no PNG beside these records


@pytest.mark.parametrize("bad, why", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "not a benchmark record"),
    ('{"rows": []}', 'no "benchmark" field'),
    ('{"benchmark": "hitrate", "rows": {"a": 1}}', '"rows" must be a list'),
    ('{"benchmark": "hitrate", "rows": [{"policy": "lru", "block_hit": "high"}]}',
     "row 0: \"block_hit\" is 'high', not a number"),
    ('{"benchmark": "restore", "rows": [3]}', "row 0 is not an object"),
])
def test_a_malformed_record_is_named_and_changes_nothing(tmp_path, bad, why):
    records = tmp_path / "bench"
    records.mkdir()
    (records / "crossover.json").write_text(json.dumps(crossover_record(tmp_path)))
    (records / "zz-broken.json").write_text(bad)
    out = tmp_path / "benchmarks.md"
    out.write_text("the previous document\n")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    res = kvfs("bench", "report", "--records", str(records), "--output", str(out),
               "--redraw", check=False)
    assert res.returncode == 2
    assert "zz-broken.json" in res.stderr and why in res.stderr
    assert "Traceback" not in res.stderr
    assert out.read_text() == "the previous document\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no plot, no temporary


@pytest.mark.parametrize("rename, why", [
    (("rows", "table"), '"table" (now "rows")'),
    (("conditions", "load_average", "loadavg_before"),
     '"conditions.loadavg_before" (now "load_average")'),
    (("conditions", "versions", "python"), '"conditions.python" (now "versions.python")'),
])
def test_a_record_of_an_older_shape_is_refused_with_the_new_name(tmp_path, rename, why):
    """Records are migrated to the one schema, not read through synonyms: a key of an older
    shape is named, with its name now, and nothing is written."""
    records = tmp_path / "bench"
    records.mkdir()
    record = mount_record(tmp_path)
    *where, old, new = rename
    holder = record
    for key in where:
        holder = holder[key]
    if where == ["conditions", "versions"]:
        record["conditions"][new] = holder.pop(old)
    else:
        holder[new] = holder.pop(old)
    (records / "mount.json").write_text(json.dumps(record))
    out = tmp_path / "benchmarks.md"
    with pytest.raises(report.ReportError, match="older shape") as exc:
        report.report(str(records), str(out))
    assert why in str(exc.value) and not out.exists()


def test_the_committed_records_have_the_one_schema():
    """docs/bench/*.json: every conditions key is the schema's or a benchmark's extra."""
    docs = Path(__file__).resolve().parent.parent / "docs" / "bench"
    for path, record in report.load_records(str(docs), report.BY_NAME):
        assert "versions" in record["conditions"], path


def test_a_missing_records_directory_is_a_clear_error(tmp_path):
    res = kvfs("bench", "report", "--records", str(tmp_path / "nope"), "--output",
               str(tmp_path / "b.md"), check=False)
    assert res.returncode == 2 and "no such directory of benchmark records" in res.stderr
    assert not (tmp_path / "b.md").exists()


def test_redraw_draws_each_plot_from_its_record(tmp_path):
    pytest.importorskip("matplotlib")
    records = tmp_path / "bench"
    records.mkdir()
    (records / "crossover.json").write_text(json.dumps(crossover_record(tmp_path)))
    out = tmp_path / "benchmarks.md"
    report.report(str(records), str(out), redraw=True)
    png_size(records / "crossover.png")
    assert "](bench/crossover.png)" in out.read_text()


def test_finish_records_the_command_and_draws_the_plot(tmp_path, capsys):
    record = crossover_record(tmp_path)
    assert common.finish(record, Namespace(out=str(tmp_path), json=None), "the table") == 0
    saved = json.loads((tmp_path / "crossover.json").read_text())
    # The command as run, with this machine's paths reduced to their last component.
    assert saved["command"] == common.portable(sys.argv)
    assert not any(str(tmp_path) in json.dumps(v) for v in saved.values())
    assert "the table" in capsys.readouterr().out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert saved["plot"] is None and not (tmp_path / "crossover.png").exists()
    else:
        assert saved["plot"] == "crossover.png"
        png_size(tmp_path / "crossover.png")


def test_command_lines_read_as_typed():
    assert report.command_line(["/opt/env/bin/kvfs", "bench", "crossover", "--lengths", "16"]) \
        == "kvfs bench crossover --lengths 16"
    assert report.command_line(["/src/kvfs/cli.py", "bench", "hitrate", "--trace", "a b"]) \
        == "kvfs bench hitrate --trace 'a b'"
    assert report.command_line(["/src/repo/tools/bench_tiers.py", "--quick"]) \
        == "python tools/bench_tiers.py --quick"
    assert report.command_line("python tools/bench_restore.py ") \
        == "python tools/bench_restore.py"
    assert report.command_line(["kvfs", "bench", "restore", "--dir", "/srv/nvme0/kv",
                                "--json=/home/me/r.json"]) \
        == "kvfs bench restore --dir .../kv --json=.../r.json"
    assert report.command_line("python tools/bench_tiers.py --out /home/me/x --quick") \
        == "python tools/bench_tiers.py --out .../x --quick"
    assert report.command_line(None) is None


def test_runs_of_one_kind_are_listed_newest_first(tmp_path):
    records = tmp_path / "bench"
    records.mkdir()
    for name, when, lengths in (("a-new", "2026-12-02 10:00:00 +0000", "4096"),
                                ("b-old", "2026-11-01 10:00:00 +0000", "16")):
        record = crossover_record(tmp_path)
        record["conditions"]["time"] = when
        record["command"] = ["kvfs", "bench", "crossover", "--lengths", lengths]
        (records / f"{name}.json").write_text(json.dumps(record))
    out = tmp_path / "benchmarks.md"
    report.report(str(records), str(out))
    text = out.read_text()
    assert text.index("### Run of 2026-12-02") < text.index("### Run of 2026-11-01")
    head = text.split("## Crossover")[0]
    assert "| 2026-12-02: " in head and "`kvfs bench crossover --lengths 4096`" in head


def test_report_defaults_to_docs_bench_and_docs_benchmarks_md(tmp_path):
    records = tmp_path / "docs" / "bench"
    records.mkdir(parents=True)
    (records / "crossover.json").write_text(json.dumps(crossover_record(tmp_path)))
    res = kvfs("bench", "report", cwd=tmp_path,
               env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert "docs/benchmarks.md: 1 records from docs/bench" in res.stdout
    text = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert "JSON records in docs/bench/" in text and "| 128 | 31.0 | 10.4 |" in text


def test_verdicts_read_met_or_ok_and_a_kind_showing_them_is_not_repeated(tmp_path):
    # a record of a kind kvfs does not know: its verdicts in the generic list
    records = tmp_path / "bench"
    records.mkdir()
    base = {"conditions": common.conditions([str(tmp_path)]), "command": "kvfs bench x"}
    (records / "novel.json").write_text(json.dumps({**base, "benchmark": "novel",
        "rows": [{"what": "a", "ms": 1}],
        "verdicts": [{"target": "fast enough", "figures": "0.8x", "ok": True},
                     {"target": "small enough", "measured": "2x", "met": False},
                     {"target": "not run", "figures": "-"}]}))
    out = tmp_path / "b.md"
    kvfs("bench", "report", "--records", str(records), "--output", str(out))
    text = out.read_text()
    assert "- met: fast enough: 0.8x" in text
    assert "- **missed**: small enough: 2x" in text
    assert "- not measured: not run" in text


def test_a_damon_pageout_scheme_is_a_condition_of_the_record(tmp_path: Path) -> None:
    """A host's proactive reclaim (a DAMON scheme paging out idle page cache) is found in
    sysfs and said in the record's conditions: page cache a figure calls warm may be gone."""
    assert harness.page_reclaim(str(tmp_path)) is None  # none running
    kd = tmp_path / "kernel/mm/damon/admin/kdamonds/0"
    sch = kd / "contexts/0/schemes/0"
    files = {kd / "state": "on", kd / "contexts/0/monitoring_attrs/intervals/aggr_us": "5000000",
             sch / "action": "pageout", sch / "access_pattern/age/min": "12",
             sch / "quotas/bytes": str(128 << 20), sch / "quotas/reset_interval_ms": "1000",
             sch / "ops_filters/0/type": "anon", sch / "ops_filters/0/allow": "N"}
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    said = "DAMON pageout of page cache idle for 60 s or more, up to 128 MiB/s"
    assert harness.page_reclaim(str(tmp_path)) == said
    (kd / "state").write_text("off\n")
    assert harness.page_reclaim(str(tmp_path)) is None  # a scheme set up but not running
    cond = {**conditions(tmp_path), "page_reclaim": said}
    assert f"proactive reclaim: {said}" in records.conditions_text(cond)


def test_an_ext4_without_a_journal_is_said_in_the_conditions(tmp_path: Path) -> None:
    """Whether the ext4 under a figure has a journal (without one, creates right after many
    removals walk past every inode removed in the last minute) is found in sysfs and said."""
    from kvfs.bench import machine

    assert machine.ext4_journal("vda", str(tmp_path)) is None  # not known
    task = tmp_path / "fs/ext4/vda/journal_task"
    task.parent.mkdir(parents=True)
    task.write_text("<none>\n")
    assert machine.ext4_journal("vda", str(tmp_path)) is False
    task.write_text("jbd2/vda-8 (pid 812)\n")
    assert machine.ext4_journal("vda", str(tmp_path)) is True
    fs = {"type": "ext4", "kind": "virtio disk", "size_gib": 256, "journal": False}
    assert "no journal" in records.filesystem_text(fs)
    assert "journal" not in records.filesystem_text({**fs, "journal": True})
    assert "journal" not in records.filesystem_text({**fs, "journal": None})
