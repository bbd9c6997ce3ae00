"""Numbers as the command lines and the model card print them: byte sizes in binary units, counts with their noun."""

from __future__ import annotations


def size_text(nbytes: int) -> str:
    """A byte count for people: ``B`` below 1 KiB, else KiB / MiB / GiB with one decimal (``1,536.0 GiB``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes} B"


def plural(noun: str, n: int) -> str:
    """``noun`` for a count of one, else ``noun + "s"`` (regular plurals only: "layer", "MLA layer", "file")."""
    return noun if n == 1 else noun + "s"


def counted(n: int, noun: str) -> str:
    """A count and its noun: ``1 MLA layer``, ``0 files``, ``3 commits``."""
    return f"{n} {plural(noun, n)}"
