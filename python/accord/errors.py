"""What accord's errors carry besides their message."""

from __future__ import annotations

from typing import Optional

from accord import _accord


def error_code(e: BaseException) -> Optional[str]:
    """The canonical status code an accord.Error carries ("DEADLINE_EXCEEDED"),
    or None for any other exception. Branch on this, never on the message."""
    code = getattr(e, "code", None) if isinstance(e, _accord.Error) else None
    return code if isinstance(code, str) else None
