"""What accord's errors carry besides their message."""

from __future__ import annotations

from typing import Optional

from accord import _accord


def error_code(e: BaseException) -> Optional[str]:
    """The canonical status code an accord.Error carries ("DEADLINE_EXCEEDED"),
    or None for any other exception. Branch on this, never on the message."""
    code = getattr(e, "code", None) if isinstance(e, _accord.Error) else None
    return code if isinstance(code, str) else None


def is_local_timeout(e: BaseException) -> bool:
    """True for the client's own wait ending at the caller's deadline (no
    decision or registration result yet; waiting again waits for the same
    one), False for the coordinator's DEADLINE_EXCEEDED verdict and any other
    error. The message says the same for humans; branch on this."""
    return isinstance(e, _accord.Error) and getattr(e, "local_timeout", False) is True
