"""The agreement step behind a small protocol.

The FSDP2 adapter (accord.torch) only needs two calls: register a group once,
and, per reduce-scatter, submit this rank's manifest and get the decision that
every rank receives. `ClientAgreement` does that through the accord client and
daemons; tests may supply another implementation of the same protocol.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, Tuple, runtime_checkable

from accord import _accord

ParamTuple = Tuple[str, int, int]  # (name, dim0, numel)


@runtime_checkable
class Agreement(Protocol):
    """What the adapter needs from an agreement service (one per rank)."""

    rank: int
    world_size: int

    def register(
        self,
        group_id: str,
        params: Sequence[ParamTuple],
        reduce_dtype: Optional[str],
        reduce_dtype_exact: bool,
        members: Optional[Sequence[int]] = None,
    ) -> None:
        """Registers a group once; raises accord.Error on mismatch across its
        members (the ranks that reduce it, ascending; None: every rank)."""

    def submit(
        self, group_id: str, step: int, dtypes: Sequence[Optional[str]]
    ) -> "_accord.Decision":
        """Submits this rank's manifest (dtype name or None per parameter) and
        returns the decision, identical on every rank; raises accord.Error."""


class ClientAgreement:
    """The agreement through the accord client: sidecar and coordinator decide."""

    def __init__(self, client: "_accord.Client", timeout_s: float = 300.0):
        self.client = client
        self.timeout_s = timeout_s
        self.rank = client.rank
        self.world_size = client.world_size

    def register(self, group_id, params, reduce_dtype, reduce_dtype_exact, members=None):
        self.client.register_group(
            group_id,
            list(params),
            reduce_dtype=reduce_dtype,
            reduce_dtype_exact=reduce_dtype_exact,
            timeout_s=self.timeout_s,
            members=None if members is None else list(members),
        )

    def submit(self, group_id, step, dtypes):
        future = self.client.submit(group_id, step, list(dtypes))
        return self.client.wait(future, timeout_s=self.timeout_s)

    # Optional part of the protocol, used by accord.torch to overlap the
    # round trip with backward compute: submit now, wait later.
    def submit_async(self, group_id, step, dtypes):
        """Submits one manifest without blocking; returns a handle for wait()."""
        return self.client.submit(group_id, step, list(dtypes))

    def wait(self, handle, timeout_s=None) -> "_accord.Decision":
        """The decision of a submit_async handle (blocks until it is there, or
        for timeout_s: then accord.Error DEADLINE_EXCEEDED with local_timeout
        set, handle not ready)."""
        return self.client.wait(handle, timeout_s=self.timeout_s if timeout_s is None
                                else timeout_s)

    def ready(self, handle) -> bool:
        return handle.ready()

    def submit_batch(self, items, sync_key=0):
        """Submits many (group_id, step, dtypes) as one message; handles in
        order. A non-zero `sync_key` (64-bit) marks the batch as one of this
        rank's releases: the sidecar sends what the n-th releases with one key
        of its ranks complete upstream together (docs/MEMBERS.md 2.11)."""
        return self.client.submit_batch([(g, s, list(d)) for g, s, d in items],
                                         sync_key=sync_key)

    def report(self, speculated: int, repaired: int, redone: int) -> None:
        """Adds accord.torch's speculation and repair counts since its last
        report to the rank's tally at the sidecar, which exports them
        (accord_speculated_reduces_total, accord_repairs_total); never blocks."""
        self.client.add_adapter_counts(speculated, repaired, redone)

    def register_all(self, registrations):
        """Registers many groups with one round trip where the client can.
        Items are (group_id, params, reduce_dtype, reduce_dtype_exact) with an
        optional fifth element, the members (None: every rank)."""
        items = [tuple(r) + (None,) * (5 - len(r)) for r in registrations]
        batch = getattr(self.client, "register_groups", None)
        if callable(batch):
            members = [None if m is None else list(m) for *_, m in items]
            batch([(g, list(p), rd, exact) for g, p, rd, exact, _ in items],
                  timeout_s=self.timeout_s,
                  members=members if any(m is not None for m in members) else None)
            return
        for r in items:
            self.register(*r)

    def wait_verdict(self, timeout_s: float) -> None:
        """Raises the job's verdict (accord.Error) once the job failed; returns
        None when it has not failed within timeout_s."""
        self.client.wait_verdict(timeout_s)


def as_agreement(obj, timeout_s: float = 300.0) -> Agreement:
    """Accepts an Agreement or an accord client and returns an Agreement."""
    if getattr(_accord, "HAVE_CLIENT", False) and isinstance(obj, _accord.Client):
        return ClientAgreement(obj, timeout_s=timeout_s)
    if isinstance(obj, Agreement):
        return obj
    raise TypeError(
        f"expected an accord client (accord.connect(...)) or an accord.Agreement, got "
        f"{type(obj).__name__}"
    )
