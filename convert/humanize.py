"""Numbers as the command lines print them: byte sizes in binary units."""

from __future__ import annotations


def size_text(nbytes: int) -> str:
    """A byte count for people: ``B`` below 1 KiB, else KiB / MiB / GiB with one decimal (``1,536.0 GiB``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes} B"
