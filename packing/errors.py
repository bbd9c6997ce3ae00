"""The one exception family of glm-pack.

Every error a user can cause derives from :class:`GlmPackError`. The CLI prints ``str(err)`` as one line
and exits non-zero; ``file`` and ``tensor`` name what was wrong when known.
"""

from __future__ import annotations

import re


def _names(message: str, name: str) -> bool:
    """Whether ``message`` names ``name`` whole: not as part of a longer path or dotted name (a message naming
    ``model.layers.10.w`` or ``/o/a.safetensors.tmp`` does not name ``layers.1`` or ``a.safetensors``)."""
    return re.search(rf"(?<![\w./-]){re.escape(name)}(?![\w/-]|\.\w)", message) is not None


class GlmPackError(Exception):
    """Base class: a clear, user-facing failure. ``file``/``tensor`` locate it when known."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.message = message
        self.file = None if file is None else str(file)
        self.tensor = tensor
        super().__init__(message)

    def __str__(self) -> str:
        """The message, then the file and tensor it does not already name: ``msg (file F, tensor T)``."""
        where = []
        if self.file and not _names(self.message, self.file):
            where.append(f"file {self.file}")
        if self.tensor and not _names(self.message, self.tensor):
            where.append(f"tensor {self.tensor}")
        return f"{self.message} ({', '.join(where)})" if where else self.message


class FormatError(GlmPackError):
    """A tensor or layout does not satisfy the format's rules (shape, dtype, block size, non-finite)."""


class NonFiniteError(FormatError):
    """NaN or Inf met where a finite weight is required."""


class CheckpointError(GlmPackError):
    """A source checkpoint is missing, truncated, corrupt or inconsistent with its config."""


class PlanError(GlmPackError):
    """The requested conversion cannot be planned (unknown family, bad options, output conflicts)."""


class ManifestError(GlmPackError):
    """A manifest is malformed, of an unknown schema, or disagrees with the files it describes."""


class VerifyError(GlmPackError):
    """An output failed verification (hash, error bound, geometry, untouched originals)."""


class BackendError(GlmPackError):
    """A runtime backend is unavailable or was called outside its contract."""


class HubError(GlmPackError):
    """A Hugging Face Hub operation failed (auth, not found, network, rate limit)."""
