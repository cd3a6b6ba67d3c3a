"""The native pieces of kvfs, all optional.

- kvfs.client._fastread, the host load path without the GIL. It builds against the xxhash header
  (Debian/Ubuntu: libxxhash-dev, installed by tools/setup.sh) with the compiler that builds
  pyfuse3; where it cannot, kvfs installs without it and loads blocks with the same reads in
  Python.
- kvfs.format._codec, the lossless block codec's loops (byte planes, zstd, xxh3) without the GIL;
  against libzstd (libzstd-dev). Without it kvfs stores blocks raw.
- kvfs.daemon._passthrough, the FUSE passthrough fields of the replies libfuse 3.14 cannot write.
  Without it the daemon serves every byte itself (docs/architecture.md, "The mount door").

Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]

setup(
    ext_modules=[
        Extension(
            "kvfs.client._fastread",
            ["kvfs/client/_fastread.c"],
            # Without a compiler or the header kvfs still installs, and loads in Python
            # (slower: docs/architecture.md); tests/test_fastread.py fails where it must build.
            optional=True,
            extra_compile_args=["-O3", "-std=c11", *WARNINGS],
        ),
        Extension(
            "kvfs.format._codec",
            ["kvfs/format/_codec.c"],
            # The lossless block codec (kvfs/format/codec.py), against libzstd and the xxhash header
            # (libzstd-dev, libxxhash-dev). Without it blocks are stored raw, and stored
            # encoded blocks are decoded with python-zstandard (slower).
            optional=True,
            libraries=["zstd"],
            extra_compile_args=["-O3", "-std=c11", *WARNINGS],
        ),
        Extension(
            "kvfs.format._seal",
            ["kvfs/format/_seal.c"],
            # AES-256-GCM of sealed blocks in place without the GIL (kvfs/format/seal.py), against
            # the system's libcrypto and the xxhash header (libssl-dev, libxxhash-dev). Without
            # it blocks are sealed and opened with the cryptography package (one core, a copy).
            optional=True,
            libraries=["crypto"],
            extra_compile_args=["-O3", "-std=c11", *WARNINGS],
        ),
        Extension(
            "kvfs.daemon._passthrough",
            ["kvfs/daemon/_passthrough.c"],
            # Without it every open takes the daemon's own path (tests/test_passthrough.py
            # fails where it must build).
            optional=True,
            extra_compile_args=["-O2", *WARNINGS],
        ),
    ]
)
