"""The record of `kvfs bench door` (kvfs.bench.door): its targets, each figure's floor (the
best ratio a daemon sent the requests kvfs was sent could reach, answering each at the
measured round trip: see the method in kvfs.bench.door), the rows with their ratios, the
table printed and the plot."""

from __future__ import annotations

from typing import Any

#: Targets of issue "the mount door at kernel speed" (FUSE passthrough): whole files (the
#: `file-*` patterns) >= 0.9x of the plain directory, written and read warm and cold; the
#: engines' patterns >= 0.8x; small creates <= 5x the plain directory's time.
CREATES_TARGET = ("<= 5x the time", 5.0, True)
WHOLE_TARGET = (">= 0.9x", 0.9, False)
ENGINE_TARGET = (">= 0.8x", 0.8, False)


def target(pattern: str, what: str) -> tuple[str, float, bool]:
    """(text, bound, lower-is-better) of a figure: `what` is creates, write, warm or cold."""
    if what == "creates":
        return CREATES_TARGET
    return WHOLE_TARGET if pattern.startswith("file-") else ENGINE_TARGET


#: Requests the caller does not wait for one round trip each: read-ahead `read`s overlap, a
#: `write` or `read` is counted by its bytes (two copies), `release` and `forget` are not
#: waited for.
NOT_WAITED = frozenset({"read", "write", "release", "releasedir", "forget", "batch_forget",
                        "thread_release"})


def floor(s: dict[str, Any], what: str, rt_us: float, one_copy_us: float,
          thread_rt_us: float | None = None, thread_open_us: float | None = None
          ) -> dict[str, Any] | None:
    """The least time the mount can take for a phase (`write`, `warm`, `cold`) at this round
    trip: the plain directory's time, plus per file one round trip per request waited for
    (the request thread's, `thread_<kind>`, at its own round trip; its opens at the time of
    an open and close it answers, less a plain one) and two copies of each byte that crossed
    the channel. None without the figures, or for an O_DIRECT pattern (the plain side's I/O
    is not the daemon's)."""
    per = s.get(f"{what}_per_file")
    plain_s = s.get(f"plain_{what}_s")
    if not per or not plain_s or not rt_us or any(s["direct"].values()):
        return None
    waited = {k: v for k, v in per["requests"].items() if k not in NOT_WAITED}
    by_thread = sum(v for k, v in waited.items() if k.startswith("thread_"))
    by_daemon = sum(waited.values()) - by_thread
    opens = waited.get("thread_open", 0)
    copies = 2 * per["bytes"] / (s["file_kib"] << 10)  # two per byte crossed (module text)
    trips = (by_daemon * rt_us + (by_thread - opens) * (thread_rt_us or rt_us)
             + opens * (thread_open_us or thread_rt_us or rt_us))
    floor_s = plain_s + s["files"] * (trips + copies * one_copy_us) / 1e6
    return {"seconds": round(floor_s, 4), "waited_requests": round(by_daemon + by_thread, 2),
            "by_thread": round(by_thread, 2), "copies": round(copies, 2)}


def _wake_note(v: dict[str, Any]) -> dict[str, str]:
    """The host's FUSE wake-ups in the run (kvfs.daemon.wakeup), where the record says."""
    wake = v.get("fuse_wake") or {}
    return {"note": f"fuse.wake_here {wake['wake_here']}"} if wake.get("wake_here") else {}


def _with_floor(row: dict[str, Any], s: dict[str, Any], what: str, v: dict[str, Any],
                p: str, creates: bool = False) -> dict[str, Any]:
    """`row` with its floor (see the module's text): `floor` (the best ratio at this round
    trip), `reachable` (whether the floor meets the target) and a note saying how."""
    trips = v.get("round_trip_us") or {}
    rt, thread_rt = trips.get("mount"), trips.get("thread")
    thread_open = (trips["thread_open"] - trips.get("plain_open", 0.0)
                   if "thread_open" in trips else None)
    f = floor(s, what, rt or 0.0, (v.get("copy_us") or {}).get(p, 0.0), thread_rt, thread_open)
    if f is None:
        return row
    plain_s = s[f"plain_{what}_s"]
    ratio = f["seconds"] / plain_s if creates else plain_s / f["seconds"]
    _, bound, lower = target(p, "creates" if creates else what)
    row["floor"] = round(ratio, 3)
    row["reachable"] = ratio <= bound if lower else ratio >= bound
    by_thread = (f" ({f['by_thread']:g} of them the request thread's, x {thread_rt:.0f} us, "
                 f"an open and close x {thread_open:.0f} us)"
                 if f["by_thread"] and thread_rt and thread_open else "")
    row["note"] = (f"floor {ratio:.3g}x: {f['waited_requests']:g} requests waited for x "
                   f"{rt:.0f} us{by_thread} + {f['copies']:g} copies of {s['file_kib']} KiB "
                   "per file" + ("" if row["reachable"] else "; out of reach at this round trip"))
    return row


def _peer(row: dict[str, Any], s: dict[str, Any], p: str, what: str, value: float
          ) -> dict[str, Any]:
    """`row` with the peer's figure (`peer`: same unit) and ratio to the plain directory
    (`peer_ratio`), and whether the peer meets the target (`peer_ok`), where it was measured."""
    ratio = s.get(f"peer_{what}_ratio")
    if ratio is None or not value:
        return row
    _, bound, lower = target(p, what)
    row.update(peer=round(value, 1), peer_ratio=ratio,
               peer_ok=ratio <= bound if lower else ratio >= bound)
    return row


def figure_rows(variants: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The record's rows: one per figure, the mount against the plain directory, with the
    floor where there is one."""
    rows: list[dict[str, Any]] = []
    for vname, v in variants.items():
        tag = f"{vname}: " if len(variants) > 1 else ""
        for p, s in v["patterns"].items():
            n, mib = s["files"], s["mib"]
            if p == "small":
                text, bound, _ = target(p, "creates")
                mount_us, plain_us = (s["mount_write_s"] / n * 1e6, s["plain_write_s"] / n * 1e6)
                rows.append(_with_floor(_peer(
                    {"figure": f"{tag}{p}: create+write+close per file", "unit": "us",
                     "kvfs": round(mount_us, 1), "baseline": round(plain_us, 1),
                     "baseline_name": "plain dir", "ratio": s["creates_ratio"],
                     "target": text, "ok": s["creates_ratio"] <= bound},
                    s, p, "creates", s.get("peer_write_s", 0) / n * 1e6), s, "write", v, p,
                    creates=True))
            metrics = ("warm", "cold") if p == "small" else ("write", "warm", "cold")
            for what in metrics:
                if f"mount_{what}_s" not in s:
                    continue
                text, bound, _ = target(p, what)
                ratio = s[f"{what}_ratio"]
                label = {"write": "write", "warm": "warm read", "cold": "cold read"}[what]
                peer_s = s.get(f"peer_{what}_s")
                rows.append(_with_floor(_peer(
                    {"figure": f"{tag}{p}: {label}", "unit": "MiB/s",
                     "kvfs": round(mib / s[f"mount_{what}_s"], 1),
                     "baseline": round(mib / s[f"plain_{what}_s"], 1),
                     "baseline_name": "plain dir", "ratio": ratio, "target": text,
                     "ok": ratio >= bound}, s, p, what, mib / peer_s if peer_s else 0),
                    s, what, v, p))
            data = {what: sum(per["requests"].get(k, 0) for k in ("read", "write"))
                    for what in ("write", "warm", "cold")
                    if (per := s.get(f"{what}_per_file"))}
            if data:  # none for a file the kernel reads and writes itself (passthrough)
                rows.append({"figure": f"{tag}{p}: READ+WRITE requests per file", "unit": "",
                             "kvfs": round(sum(data.values()), 2), "baseline": None,
                             "note": ", ".join(f"{k} {x:g}" for k, x in data.items())})
        rt = v.get("round_trip_us") or {}
        if rt:
            rows.append({"figure": f"{tag}bare FUSE round trip (fstat, no attribute cache)",
                         "unit": "us", "kvfs": round(rt["mount"], 1),
                         "baseline": round(rt["plain"], 2), "baseline_name": "plain fstat",
                         "ratio": round(rt["mount"] / rt["plain"], 1)})
        if rt.get("thread"):
            rows.append({"figure": f"{tag}request thread's round trip (getxattr outside user.)",
                         "unit": "us", "kvfs": round(rt["thread"], 1),
                         "baseline": round(rt["mount"], 1), "baseline_name": "the daemon's",
                         "ratio": round(rt["thread"] / rt["mount"], 2),
                         **_wake_note(v)})
        if rt.get("thread_open"):
            rows.append({"figure": f"{tag}open+close the request thread answers", "unit": "us",
                         "kvfs": round(rt["thread_open"], 1),
                         "baseline": round(rt["plain_open"], 2), "baseline_name": "plain",
                         "ratio": round(rt["thread_open"] / rt["plain_open"], 1)})
        if rt.get("miss"):
            rows.append({"figure": f"{tag}lookup of a missing name (stat)", "unit": "us",
                         "kvfs": round(rt["miss"], 1), "baseline": round(rt["plain_miss"], 2),
                         "baseline_name": "plain", "ratio": round(rt["miss"] / rt["plain_miss"],
                                                                   1)})
        small = v["patterns"].get("small") or {}
        for what, label in (("write", "create+write+close"), ("warm", "open+read+close (warm)")):
            per = small.get(f"{what}_per_file")
            if not per:
                continue
            req = per["requests"]
            rows.append({"figure": f"{tag}FUSE requests per {label}", "unit": "",
                         "kvfs": round(sum(req.values()), 2), "baseline": None,
                         "note": ", ".join(f"{k} {x:g}" for k, x in req.items())})
            rows.append({"figure": f"{tag}daemon CPU per {label}", "unit": "us",
                         "kvfs": per["daemon_cpu_us"], "baseline": None,
                         **({"peer": small[f"peer_{what}_cpu_us"],
                             "note": f"the peer: {small[f'peer_{what}_cpu_us']:g} us"}
                            if f"peer_{what}_cpu_us" in small else {})})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    peer = any("peer_ratio" in r for r in rows)
    lines = [f"{'figure':<58} {'kvfs':>10} {'plain':>10} {'ratio':>7}  "
             + ("peer ratio  " if peer else "") + "target"]
    for r in rows:
        def cell(x: Any) -> str:
            return "-" if x is None else f"{x:g}"
        verdict = "" if r.get("ok") is None else " ok" if r["ok"] else " MISSED"
        lines.append(f"{r['figure'][:58]:<58} {cell(r.get('kvfs')):>10} "
                     f"{cell(r.get('baseline')):>10} {cell(r.get('ratio')):>7}  "
                     + (f"{cell(r.get('peer_ratio')):>10}  " if peer else "")
                     + f"{r.get('target', '')}{verdict} {r.get('note', '')}")
    return "\n".join(lines)


def draw(record: dict[str, Any], plt: Any) -> Any:
    """Each figure's ratio to the plain directory (log scale), targets marked."""
    rows = [r for r in record["rows"] if isinstance(r.get("ratio"), int | float)
            and r.get("target")]
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(rows) + 1.5))
    ys = list(range(len(rows)))[::-1]
    colors = ["tab:green" if r.get("ok") else "tab:red" for r in rows]
    ax.barh(ys, [r["ratio"] for r in rows], color=colors)
    peer = [(y, r["peer_ratio"]) for y, r in zip(ys, rows, strict=True) if "peer_ratio" in r]
    if peer:
        ax.scatter([x for _, x in peer], [y for y, _ in peer], marker="D", s=18, zorder=3,
                   color="tab:blue", label=f"{(record.get('peer') or {}).get('name')}")
        ax.legend(fontsize=7, loc="lower right")
    ax.set_yticks(ys, [r["figure"] for r in rows], fontsize=7)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    for y, r in zip(ys, rows, strict=True):
        bound = next((b for t, b, _ in (CREATES_TARGET, WHOLE_TARGET, ENGINE_TARGET)
                      if t == r["target"]), None)
        if bound is not None:
            ax.plot([bound, bound], [y - 0.4, y + 0.4], color="black", linewidth=1.5)
    ax.set_xlabel("mount / plain directory (creates: time ratio; else throughput ratio); "
                  "bar: target")
    c = record.get("conditions") or {}
    ax.set_title(f"kvfs bench door: the mount against a plain directory "
                 f"({c.get('cores', '?')} cores, load {(c.get('load_average') or [0])[0]:.1f})",
                 fontsize=9)
    return fig
