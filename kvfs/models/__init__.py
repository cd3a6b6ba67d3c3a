"""The offline models: traces, the cache simulator, the eviction policies, the demo model.

- :mod:`.trace`: request traces (Mooncake's format, kvfs's agentic generator);
- :mod:`.simulate`: the hot tier's hit rate on a trace, offline, by policy and capacity;
- :mod:`.policy`: the eviction and admission policies (the daemon runs the same objects);
- :mod:`.tinylm`: a tiny deterministic transformer whose KV goes through the client;
- :mod:`.demo`: the demo that the README's first command runs.

Imports: :mod:`kvfs.format` and :mod:`kvfs.client` (the demo and the tiny model save and load
through it); never the daemon, the benchmarks or the command line.
"""
