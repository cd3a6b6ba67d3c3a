"""``python -m kvfs.integrations.vllm``: the one-engine driver (:mod:`.driver`)."""

from __future__ import annotations

from .driver import main

if __name__ == "__main__":
    raise SystemExit(main())
