"""PNG plots of benchmark records (matplotlib, optional: `pip install kvfs[bench]`)."""

from __future__ import annotations

from typing import Any


def draw(record: dict[str, Any], png: str) -> bool:
    """Draw `record` into `png`; False (and nothing written) when matplotlib is absent."""
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.set_title(record["benchmark"])
    fig.savefig(png, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return True
