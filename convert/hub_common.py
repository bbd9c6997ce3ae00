"""Small helpers shared by the Hub reader (hub_source) and the Hub writer (push): endpoint and error text."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from glm_pack.packing.errors import HubError

DEFAULT_ENDPOINT = "https://huggingface.co"
HUB_PREFIX = "hf://"  # forces the Hub for a SRC, even where a local folder has the name
NO_LOCAL_DIRECTORY = "(and no local directory of that name)"  # where a mistyped folder was taken for a Hub repo id


def resolve_endpoint(endpoint: str | None) -> str:
    """``--endpoint``, else ``HF_ENDPOINT`` (read now, not at import), else the public Hub; HubError naming where it
    came from for one that is no http(s) URL with a host (the client failed on it with a misleading error)."""
    given = "--endpoint" if endpoint else "HF_ENDPOINT" if os.environ.get("HF_ENDPOINT") else None
    raw = endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    try:
        parts = urlsplit(raw)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is no number or out of range (parts.port raises)
        valid = False
    if not valid:
        raise HubError(f"{given} must be an http(s) URL such as {DEFAULT_ENDPOINT}, got {raw!r}")
    return raw.rstrip("/")


def hub_taken(src) -> str:
    """How a SRC came to name a Hub repo: forced by ``hf://``, or taken for one as no local folder has its name."""
    return "a Hub repo" if os.fspath(src).startswith(HUB_PREFIX) else f"taken for a Hub repo {NO_LOCAL_DIRECTORY}"


def offline_variable() -> str:
    """The variable that put huggingface_hub offline, read as it reads them: ``HF_HUB_OFFLINE`` when set, else
    ``TRANSFORMERS_OFFLINE`` (which engine images often set)."""
    return "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"


def token_or_none() -> str | None:
    """The token huggingface_hub would send now, None without one; its lookup's own failure (an OIDC exchange,
    ``HF_OIDC_RESOURCE``) as one HubError line."""
    from huggingface_hub import get_token

    try:
        return get_token()
    except Exception as err:
        raise HubError(f"could not get a Hugging Face token: {type(err).__name__}: {first_line(err)}") from err


def exception_chain(err: BaseException):
    """``err`` and its causes/contexts, each once (client errors wrap transport errors)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def is_kind(err: BaseException, *names: str) -> bool:
    """Whether ``err``'s class or a base is named one of ``names`` (httpx/requests/OS errors alike)."""
    return any(cls.__name__ in names for cls in type(err).__mro__)


def _lines(text: str) -> list[str]:
    """The non-blank lines of ``text``, stripped."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def first_line(err: BaseException, skip: int = 0) -> str:
    lines = _lines(str(err))
    return lines[min(skip, len(lines) - 1)] if lines else type(err).__name__


def _server_reason(err: BaseException) -> str | None:
    """The first line of ``HfHubHTTPError.server_message`` (the Hub's X-Error-Message or JSON error), if any."""
    lines = _lines(getattr(err, "server_message", None) or "")
    return lines[0] if lines else None


def hub_reason(err: BaseException) -> str:
    """The Hub's own reason for a failed request, else the error's first line (e.g. a proxy's answer):
    huggingface_hub's own first line says only "Bad request for commit endpoint:" or "Server error '503 ...'"."""
    return _server_reason(err) or first_line(err)


def hub_says(err: BaseException) -> str:
    """``"; the Hub says: REASON"`` when the Hub gave a reason, else ``""``: appended to glm-pack's own line for
    401/403/429, whose reasons vary (a namespace the token may not write to, the commit rate limit and when to
    retry it)."""
    reason = _server_reason(err)
    return f"; the Hub says: {reason}" if reason else ""


def auth_failed(endpoint: str, err: BaseException) -> str:
    """The line for a 401: the endpoint refused the token (or its absence)."""
    return (
        f"authentication failed (401) at {endpoint}: the token was rejected; check HF_TOKEN or run `hf auth login`"
        f"{hub_says(err)}"
    )


def unreachable(endpoint: str, what: str = "") -> str:
    """The line for a connection that could not be made (``what``: for what, e.g. " for org/name")."""
    return f"cannot connect to {endpoint}{what}: connection refused or unreachable"


def answered(status: int, repo_id: str, endpoint: str, err: BaseException) -> str:
    """The line for an HTTP status glm-pack has no more specific words for."""
    return f"the Hub answered {status} for {repo_id} at {endpoint}: {hub_reason(err)}"
