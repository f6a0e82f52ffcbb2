"""install()'s defaults: flags from the environment, and the process's
client when install() is given none."""

from __future__ import annotations

import os
import warnings
from typing import Optional

import accord


def env_flag(name: str, default: bool = True) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() not in ("0", "false", "off", "no")


_DEFAULT_CLIENT: list = []  # the process's accord.connect() of an install without a client


def default_client():
    """accord.connect() once per process: every install() without a client
    (a pipeline stage's modules, interleaved chunks) uses the same one
    (docs/MEMBERS.md 3.2)."""
    if not _DEFAULT_CLIENT:
        _DEFAULT_CLIENT.append(accord.connect())
    return _DEFAULT_CLIENT[0]


def speculate_flag(speculate: Optional[bool], overlap: Optional[bool]) -> bool:
    if overlap is not None or os.environ.get("ACCORD_TORCH_OVERLAP") is not None:
        warnings.warn("accord.torch: `overlap` and ACCORD_TORCH_OVERLAP are deprecated names "
                      "of `speculate` and ACCORD_TORCH_SPECULATE", DeprecationWarning,
                      stacklevel=3)
    if speculate is None:
        speculate = overlap if overlap is not None else (
            env_flag("ACCORD_TORCH_SPECULATE") and env_flag("ACCORD_TORCH_OVERLAP"))
    return bool(speculate)
