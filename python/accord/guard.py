"""Kept for imports written before accord.torch became a package: the guard
is accord.torch.guard."""

from accord.torch.guard import AccordDivergenceError, SequenceGuard  # noqa: F401
