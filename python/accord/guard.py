"""Deprecated: the collective-sequence guard is accord.torch.guard (this
name is kept for imports written before accord.torch became a package)."""

import warnings

from accord.torch.guard import AccordDivergenceError, SequenceGuard  # noqa: F401

warnings.warn("accord.guard is deprecated; import accord.torch.guard (or AccordDivergenceError "
              "from accord.torch)", DeprecationWarning, stacklevel=2)
