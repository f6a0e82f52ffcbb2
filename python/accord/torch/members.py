"""Member sets: the ranks that reduce a group (docs/MEMBERS.md, 2.1 and
3.1). Pure: tags, ids and the prefix count; no torch.

A member set is a sorted tuple of the accord job's ranks, or None for every
rank (sent absent on the wire: a 1-D job registers exactly as without
members). Ids are made unique per member set by a tag computed from the
list alone, so every member computes the same one."""

from __future__ import annotations

import hashlib
import threading
from typing import Iterable, Optional, Tuple

Members = Optional[Tuple[int, ...]]


def canonical(ranks: Iterable[int], world_size: int) -> Members:
    """The member set of `ranks` in a job of `world_size` ranks: sorted,
    without duplicates; None when it is every rank. Raises ValueError for a
    rank outside the job or an empty set."""
    out = tuple(sorted({int(r) for r in ranks}))
    if not out:
        raise ValueError("accord.torch: a group with no members")
    if out[0] < 0 or out[-1] >= world_size:
        raise ValueError(f"accord.torch: members {list(out)} are not all ranks of the accord "
                         f"job of {world_size}")
    return None if len(out) == world_size else out


def stride(ranks: Tuple[int, ...]) -> int:
    """The common step of an ascending list: 1 for one rank, 0 when it is
    not an arithmetic progression (as core/members.cc)."""
    if len(ranks) < 2:
        return 1
    step = ranks[1] - ranks[0]
    return step if all(b - a == step for a, b in zip(ranks, ranks[1:])) else 0


def tag(members: Members) -> str:
    """The id suffix of a member set: "" for every rank, `@ranks<a>..<b>`
    for consecutive ranks, `@ranks<a>..<b>/<s>` for stride s, else
    `@m<12 hex digits>` of a hash of the list."""
    if members is None:
        return ""
    s = stride(members)
    if s == 1:
        return f"@ranks{members[0]}..{members[-1]}"
    if s > 1:
        return f"@ranks{members[0]}..{members[-1]}/{s}"
    digest = hashlib.blake2b(",".join(map(str, members)).encode(), digest_size=6)
    return f"@m{digest.hexdigest()}"


def union(sets: Iterable[Members], world_size: int) -> Members:
    """The ranks of every set (None: every rank), as a member set."""
    ranks = set()
    for m in sets:
        if m is None:
            return None
        ranks.update(m)
    return canonical(ranks, world_size)


def count(members: Members, world_size: int) -> int:
    return world_size if members is None else len(members)


def ranks_of(members: Members, world_size: int) -> Tuple[int, ...]:
    return tuple(range(world_size)) if members is None else members


def registration(reg: tuple, members: Members) -> tuple:
    """A registration item with its members: the fifth element only when
    there are members, so that a 1-D job's calls are today's."""
    return tuple(reg) if members is None else tuple(reg[:4]) + (list(members),)


def sync_key(prefix: str, base_ids: Iterable[str], stage: Optional[int]) -> int:
    """The release batch's sync_key (docs/MEMBERS.md 2.11): a 64-bit blake2b
    of the installation's prefix, its group ids without member tags in
    order, and the pipeline stage index of the installed module (None: no
    schedule drives it). Equal keys mean the same layout at the same stage,
    i.e. the same action list; never 0 (0 is "no key" on the wire)."""
    text = "\n".join([prefix, *base_ids, "-" if stage is None else f"stage {int(stage)}"])
    key = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return key or 1


class Prefixes:
    """Live installations per (prefix, member set) in this process: the n-th
    at once (n >= 1) uses `<prefix>.<n>` (two chunks of one rank under an
    interleaved schedule, both with the same DP peers; 2.1). Members run
    the same program, so they install in the same order and agree on n."""

    def __init__(self):
        self._mu = threading.Lock()
        self._live: dict = {}  # (prefix, members) -> set of n in use

    def take(self, prefix: str, members: Members) -> str:
        with self._mu:
            used = self._live.setdefault((prefix, members), set())
            n = next(i for i in range(len(used) + 1) if i not in used)
            used.add(n)
        return prefix if n == 0 else f"{prefix}.{n}"

    def give_back(self, prefix: str, members: Members, taken: str) -> None:
        n = 0 if taken == prefix else int(taken.rsplit(".", 1)[1])
        with self._mu:
            self._live.get((prefix, members), set()).discard(n)


PREFIXES = Prefixes()
