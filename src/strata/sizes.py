"""Byte counts as people read them in logs and reports."""
from __future__ import annotations


def size_text(num_bytes: float) -> str:
    """'512 B', '3.50 KiB', '12.25 MiB', '1.50 GiB': the largest unit that keeps the figure
    at 1 or more (GiB the largest)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")
