"""Engine adapters: each module plugs kvfs's direct path into one engine's own plug-in point.

Each imports its engine lazily, only in its own module, so kvfs installs and runs without any
engine: ``kvfs.integrations.sglang`` (SGLang HiCache's dynamic storage backend) and
``kvfs.integrations.lmcache`` (an LMCache storage plugin).
"""
