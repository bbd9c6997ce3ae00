"""glm_pack.packing: the format. Pure tensor functions (MXFP4 codec, layouts, MLA split, manifest schema)."""

from .errors import (
    BackendError,
    CheckpointError,
    FormatError,
    GlmPackError,
    HubError,
    ManifestError,
    NonFiniteError,
    PlanError,
    VerifyError,
)

__all__ = [
    "BackendError",
    "CheckpointError",
    "FormatError",
    "GlmPackError",
    "HubError",
    "ManifestError",
    "NonFiniteError",
    "PlanError",
    "VerifyError",
]
