"""One engine, one process, prompts served one after the other: the driver of the tests and of
``kvfs bench engine`` (``python -m kvfs.integrations.vllm --help``); prints a JSON record."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from .connector import _INSTANCES


def _transfer_config(args: Any) -> dict[str, Any] | None:
    if args.connector == "none":
        return None
    if args.connector == "example":
        return {"kv_connector": "PrefixExampleConnector",
                "kv_connector_module_path": "kvfs.integrations.vllm", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": args.storage}}
    extra = {"mount": args.mount, "tenant": args.tenant, **json.loads(args.extra or "{}")}
    return {"kv_connector": "KVFSConnector", "kv_connector_module_path": "kvfs.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": args.failure_policy,
            "kv_connector_extra_config": extra}


def _prompt_tokens(llm: Any, path: str) -> list[int]:
    """A prompt file: a JSON list of token ids, or ``{"parts": [[text, max_tokens], ...]}``:
    each text tokenized alone (no special tokens), cut to max_tokens (null: all) and the
    pieces concatenated, so that a prompt extended by a question starts with exactly the
    tokens of the prompt without it."""
    with open(path) as f:
        doc = json.load(f)
    if isinstance(doc, list):
        return [int(t) for t in doc]
    tok = llm.get_tokenizer()
    out: list[int] = []
    for text, limit in doc["parts"]:
        ids = tok.encode(text, add_special_tokens=False)
        out += ids if limit is None else ids[:limit]
    return out


def _recording(take: Any, into: list[dict[str, Any]]) -> Any:
    """``take_events`` that also notes what it gives the scheduler."""

    def take_events() -> Any:
        events = list(take())
        for ev in events:
            stored = type(ev).__name__ == "BlockStored"
            into.append({"type": "stored" if stored else "removed",
                         "hashes": [h.hex() for h in ev.block_hashes], "medium": ev.medium,
                         "parent": (ev.parent_block_hash.hex() if stored
                                    and ev.parent_block_hash else None),
                         "tokens": list(ev.token_ids) if stored else []})
        return events

    return take_events


def _gated(lookup: Any, gate: str) -> Any:
    """``get_num_new_matched_tokens`` that, when it found blocks, stops at a gate."""
    count = [0]

    def gated(*args: Any, **kwargs: Any) -> Any:
        got = lookup(*args, **kwargs)
        if got is not None and got[0]:
            count[0] += 1
            _wait_gate(gate, count[0], ready="looked-up", go="go-lookup")
        return got

    return gated


def _wait_gate(gate: str, i: int, timeout: float = 600.0, *, ready: str = "ready",
               go: str = "go") -> None:
    with open(os.path.join(gate, f"{ready}-{i}"), "w"):
        pass
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(gate, f"{go}-{i}")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {gate}/{go}-{i} after {timeout} s")
        time.sleep(0.05)


def _result(out: Any, seconds: float, counters: dict[str, Any], after: dict[str, Any],
            logprobs: int) -> dict[str, Any]:
    """One request's entry of the record (``_after``: the counters after it, dropped
    before the record is printed)."""
    r = {"prompt_tokens": len(out.prompt_token_ids or []), "seconds": seconds,
         "counters": counters, "_after": after, "cached_tokens": out.num_cached_tokens,
         "prompt_token_ids": list(out.prompt_token_ids or []), "text": out.outputs[0].text,
         "token_ids": list(out.outputs[0].token_ids)}
    if logprobs:  # per generated token: [[token id, logprob], ...], best first
        r["logprobs"] = [sorted(([int(t), float(lp.logprob)] for t, lp in pos.items()),
                                key=lambda x: -x[1])
                         for pos in out.outputs[0].logprobs or []]
    return r


def main(argv: list[str] | None = None) -> int:
    """Run one engine (vLLM, this process) on prompts and print a JSON record."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m kvfs.integrations.vllm", description=main.__doc__)
    p.add_argument("--model", required=True, help="model directory (or id)")
    p.add_argument("--connector", choices=("kvfs", "example", "none"), default="kvfs")
    p.add_argument("--mount", help="kvfs mount (connector kvfs)")
    p.add_argument("--tenant", help="kvfs tenant (connector kvfs)")
    p.add_argument("--extra", help="more kv_connector_extra_config keys, as JSON")
    p.add_argument("--failure-policy", default="recompute", choices=("recompute", "fail"))
    p.add_argument("--storage", help="directory of the ExampleConnector (connector example)")
    p.add_argument("--prompt-file", action="append", required=True,
                   help="a prompt (JSON: token ids, or {\"parts\": [[text, max_tokens]]}); "
                        "repeat for several requests, run one after the other")
    p.add_argument("--together", action="store_true",
                   help="submit every prompt at once (one generate call: they arrive together "
                        "and vLLM batches them as it can); each request's seconds are the "
                        "batch's, its counters the batch's (on the first)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--logprobs", type=int, default=0, metavar="N",
                   help="record the top N logprobs of each generated token")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--warmup", type=int, default=0, metavar="TOKENS",
                   help="first serve one untimed prompt of this many tokens, unrelated to the "
                        "others (the first forward passes of a process are slow)")
    p.add_argument("--drop-caches", action="store_true",
                   help="drop the kernel's page cache before each prompt (root only)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="turn vLLM's own prefix cache off (every request asks the connector)")
    p.add_argument("--dump-loaded", help="write the pages the last load filled to this .pt")
    p.add_argument("--events", action="store_true",
                   help="record the KV events the scheduler takes from the connector, and "
                   "where each request's begin")
    p.add_argument("--gate", metavar="DIR",
                   help="before each prompt but the first, create DIR/ready-<i> and wait for "
                        "DIR/go-<i> (a test acts on the mount between two requests)")
    p.add_argument("--lookup-gate", metavar="DIR",
                   help="after each scheduler lookup that found blocks, create "
                        "DIR/looked-up-<k> (k = 1, 2, ...) and wait for DIR/go-lookup-<k> (a "
                        "test acts on the mount between a lookup and its load)")
    args = p.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # connectors in this process
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    tc = _transfer_config(args)
    if tc is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**tc)
    if args.block_size:
        kwargs["block_size"] = args.block_size
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_model_len, max_num_seqs=4, seed=0,
              enforce_eager=True, enable_prefix_caching=not args.no_prefix_cache, **kwargs)
    start_s = time.perf_counter() - started
    # Greedy; with --max-tokens 1 a request's time is its time to first token.
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                            logprobs=args.logprobs or None)
    if args.warmup:
        vocab = llm.get_tokenizer().vocab_size
        warm = [(7919 * i + 13) % (vocab - 1000) + 500 for i in range(args.warmup)]
        llm.generate([TokensPrompt(prompt_token_ids=warm)], params, use_tqdm=False)
    def snapshot() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for c in _INSTANCES:
            out.update({f"{c.role.name.lower()}.{k}": v for k, v in c.counters()["connector"]
                        .items()})
            if c.role == KVConnectorRole.WORKER:
                out.update({f"client.{k}": v for k, v in c.cache.stats.items()
                            if isinstance(v, int | float)})
        return out

    events: list[dict[str, Any]] = []
    if args.events:
        for c in _INSTANCES:
            if c.role == KVConnectorRole.SCHEDULER:
                c.take_events = _recording(c.take_events, events)  # type: ignore[method-assign]
    if args.lookup_gate:
        for c in _INSTANCES:
            if c.role == KVConnectorRole.SCHEDULER:
                c.get_num_new_matched_tokens = _gated(  # type: ignore[method-assign]
                    c.get_num_new_matched_tokens, args.lookup_gate)
    results: list[dict[str, Any]] = []
    snapshot_0 = snapshot()
    if args.together:
        prompts = [TokensPrompt(prompt_token_ids=_prompt_tokens(llm, p))
                   for p in args.prompt_file]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = snapshot()
        delta = {k: v - snapshot_0.get(k, 0) for k, v in after.items()
                 if v != snapshot_0.get(k, 0)}
        results += [_result(out, seconds, delta if i == 0 else {}, after, args.logprobs)
                    for i, out in enumerate(outs)]
    for i, path in enumerate([] if args.together else args.prompt_file):
        if args.gate and i:
            _wait_gate(args.gate, i)
        tokens = _prompt_tokens(llm, path)
        if args.events:  # where this request's events begin
            events.append({"type": "request", "index": i})
        if args.drop_caches:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        before, after = (results[-1]["_after"] if results else snapshot_0), snapshot()
        delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        results.append(_result(out, seconds, delta, after, args.logprobs))
    for r in results:
        del r["_after"]
    record: dict[str, Any] = {"connector": args.connector, "start_s": start_s,
                              "requests": results}
    workers = [c for c in _INSTANCES if c.role == KVConnectorRole.WORKER]
    scheds = [c for c in _INSTANCES if c.role == KVConnectorRole.SCHEDULER]
    if workers:
        w = workers[-1]
        w.cache.flush()
        record["worker"] = w.counters()
        record["namespace"] = w.spec.namespace
        record["direct"] = w.cache.direct
        record["spec"] = json.loads(w.spec.manifest_json())
        if args.dump_loaded and w.last_loads:
            pages = {}
            for ld in w.last_loads:
                idx = torch.tensor(ld.block_ids, dtype=torch.long)
                pages[ld.req_id] = {"hashes": [h.hex() for h in ld.hashes],
                                    "kv": torch.stack([t.index_select(0, idx)
                                                       for t in w._layers], dim=1).clone()}
            torch.save(pages, args.dump_loaded)
    if scheds:
        record["scheduler"] = scheds[-1].counters()["connector"]
    if args.events:
        record["events"] = events
    json.dump(record, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    for c in _INSTANCES:
        c.shutdown()
    return 0

