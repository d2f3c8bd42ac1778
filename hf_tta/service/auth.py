"""Bearer-token access control: gallery edits and admin operations need the token; search needs it by configuration.

The token comes from an environment variable (``HF_TTA_SERVICE_TOKEN`` by default) or a file (its first line; a
secret mounted by the platform). Without a token the protected endpoints are refused (403, naming how to set one):
a service is never editable by anyone by default. Tokens are compared in constant time (:func:`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

TOKEN_ENV = "HF_TTA_SERVICE_TOKEN"


def load_token(env: str = TOKEN_ENV, file: str | os.PathLike | None = None) -> str | None:
    """The token from ``file`` (first line) if given, else from the environment variable ``env`` (``None``: unset)."""
    if file is not None:
        lines = Path(file).read_text(encoding="utf-8").splitlines()
        token = lines[0].strip() if lines else ""
        if not token:
            raise ValueError(f"token file {file} is empty: write the token on its first line")
        return token
    token = os.environ.get(env, "").strip()
    return token or None


class AccessDenied(Exception):
    """``status`` 401 (no or wrong token) or 403 (no token configured) with a one-line message."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def check(token: str | None, authorization: str | None, what: str) -> None:
    """Raise :class:`AccessDenied` unless ``authorization`` is ``Bearer <token>``."""
    if token is None:
        raise AccessDenied(f"{what} is disabled: start the service with a token ({TOKEN_ENV} or --token-file)", 403)
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise AccessDenied(f"{what} needs 'Authorization: Bearer <token>'", 401)
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise AccessDenied("the bearer token is wrong", 401)


__all__ = ["TOKEN_ENV", "AccessDenied", "check", "load_token"]
