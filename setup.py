"""The one native piece of kvfs: kvfs._fastread, the host load path without the GIL.

Everything else is in pyproject.toml. It builds against the xxhash header (Debian/Ubuntu:
libxxhash-dev, installed by tools/setup.sh) with the compiler that builds pyfuse3; where it
cannot, kvfs installs without it and loads blocks with the same reads in Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvfs._fastread",
            ["kvfs/_fastread.c"],
            # Without a compiler or the header kvfs still installs, and loads in Python
            # (slower: docs/architecture.md); tests/test_fastread.py fails where it must build.
            optional=True,
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers"],
        )
    ]
)
