"""matplotlib for the commands that draw a figure (``--plot``)."""

from __future__ import annotations


def pyplot():
    """matplotlib's pyplot, drawing to files; without matplotlib, a
    RuntimeError that says what to install."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib: pip install 'outrider[bench]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
