"""The pure parts of the collective-sequence guard (docs/PARTICIPATION.md,
"The collective-sequence guard"): how a window is encoded into a manifest,
how a decision says the ranks' windows differed, and how every rank words the
same divergence from every rank's records. No I/O; unit-tested directly."""

from __future__ import annotations

import hashlib
import threading
from typing import Dict, List, NamedTuple, Optional, Tuple

GUARD_BITS = 64


class Wording(NamedTuple):
    """How describe() names the framework's collectives, its units and the fix."""

    collectives: str = "FSDP"
    units: str = "unit"
    install: str = "accord.torch.install(..., optional=[...])"


def hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


_BYTE_SLOTS = [
    tuple(s for i in range(8) for s in (("float32", None) if (b >> i) & 1 else (None, "float32")))
    for b in range(256)
]


def slots(h: int) -> List[Optional[str]]:
    """A 64-bit hash as a manifest: slot 2i used when bit i is 1, 2i+1 when 0."""
    out: List[Optional[str]] = []
    for k in range(8):
        out.extend(_BYTE_SLOTS[(h >> (8 * k)) & 0xFF])
    return out


def slot_params() -> list:
    return [(f"bit{i // 2}.{'one' if i % 2 == 0 else 'zero'}", 1, 1)
            for i in range(2 * GUARD_BITS)]


def diverged(included) -> bool:
    """Some rank used both slots of a bit: the windows' hashes differ."""
    return any(a and b for a, b in zip(included[0::2], included[1::2]))


def first_difference(entries: Dict[int, dict], prefix_only: bool = False) -> Optional[int]:
    """The first position (in the window) where the ranks' records differ.
    A rank with fewer records differs where it has none, unless prefix_only
    (then only positions every rank has count); None when they agree."""
    lists = [e["records"] for e in entries.values()]
    shortest = min(len(x) for x in lists)
    for p in range(shortest):
        if len({x[p] for x in lists}) > 1:
            return p
    if not prefix_only and len({len(x) for x in lists}) > 1:
        return shortest
    return None


def past_final(entries: Dict[int, dict]) -> Optional[int]:
    """Where the shortest *final* window ends (closed: its rank waits for its
    verdict, so it gets no more records) while another rank's window has
    records beyond it; None when there is no such window. Used once the
    ranks' windows agree at every common position: the rank whose window is
    final went on (to its release, say) without the others' collective."""
    ends = [len(e["records"]) for e in entries.values() if e.get("final")]
    if ends and min(ends) < max(len(e["records"]) for e in entries.values()):
        return min(ends)
    return None


def describe(entries: Dict[int, dict], wording: Wording = Wording()) -> str:
    """The same text on every rank: what each rank issued where they first
    differ."""
    p = first_difference(entries)
    seen: Dict[str, List[int]] = {}
    for r in sorted(entries):
        records = entries[r]["records"]
        what = records[p] if p is not None and p < len(records) else (
            f"nothing more after {records[-1]}" if records else "nothing")
        seen.setdefault(what, []).append(r)
    parts = [f"{'rank' if len(rs) == 1 else 'ranks'} {','.join(map(str, rs))} issued {what}"
             for what, rs in sorted(seen.items(), key=lambda kv: kv[1][0])]
    return (f"accord: the ranks' {wording.collectives} collectives diverged: " + "; ".join(parts)
            + f". A {wording.units} ran on some ranks only, or in another order, or with "
              f"other sizes; mark {wording.units}s whose forward runs on some ranks only "
              f"with {wording.install}")


MICROBATCH = "forward of microbatch"


def microbatch_record(chunk: int) -> str:
    """The guard's record at the start of a pipeline schedule's later
    microbatch (chunk > 0): a rank that skipped a unit in the microbatch
    before reaches it where another rank all-gathers the unit."""
    return f"{MICROBATCH} {chunk}"


def other_stage_record(chunk: int, stage: Optional[int]) -> str:
    """The guard's record of another stage module's microbatch forward on
    this rank (a schedule with several stages per rank): a rank that skipped
    a unit in its last forward here reaches it where another rank
    all-gathers the unit."""
    return f"{MICROBATCH} {chunk} of stage {stage}"


def repairable_units(entries: Dict[int, dict], world_size: int) -> Optional[List[str]]:
    """The units whose forward all-gathers diverged at every rank's first
    occurrence, or None when this divergence is an error: every rank must
    report, differ at the last record of its window, be waiting before it
    (a new record) and be at a forward all-gather of a unit or at the start
    of a schedule's next microbatch (at least one rank at a unit)."""
    if len(entries) != world_size:
        return None
    p = first_difference(entries)
    if p is None or any(p != len(e["records"]) - 1 for e in entries.values()):
        return None
    units = set()
    for e in entries.values():
        if not e["waiting"]:
            return None
        if e["forward_all_gather"] and e["unit"]:
            units.add(e["unit"])
        elif not e["records"][-1].split(": ", 1)[-1].startswith(MICROBATCH + " "):
            return None
    return sorted(units) or None


class Window:
    """Records of one guard window; closed by the training thread, checked by
    the guard's thread (its `checked` event)."""

    __slots__ = ("index", "entries", "starts", "waiting", "unit", "forward_all_gather",
                 "handle", "checked", "repair", "closed_at", "group", "group_step")

    def __init__(self, index: int, step: int = 0, position: int = 0):
        self.index = index  # windows closed before this one, on this rank
        # One entry per collective: the per-collective path only appends; the
        # steps and positions are in `starts`, (first entry, step, its
        # position) per step the window spans, and the text below is built
        # per window, when it is needed.
        self.entries: List[str] = []
        self.starts: List[Tuple[int, int, int]] = [(0, step, position)]
        self.group: Optional[str] = None  # where it was submitted, and at which step
        self.group_step = 0
        self.waiting = False  # closed at a new collective: the training thread waits
        self.unit: Optional[str] = None  # of the last record, when closed at a new one
        self.forward_all_gather = False  # ... and whether it is a forward all-gather
        self.handle = None
        self.checked = threading.Event()
        self.repair: Optional[List[str]] = None
        self.closed_at = 0.0

    def begin(self, step: int) -> None:
        """The next entry is position 0 of `step`."""
        if self.entries:
            self.starts = self.starts + [(len(self.entries), step, 0)]
        else:
            self.starts = [(0, step, 0)]

    def located(self) -> List[Tuple[int, int, str]]:
        """(step, position, entry) per collective. A copy, safe while the
        training thread appends."""
        entries, starts = list(self.entries), self.starts
        out: List[Tuple[int, int, str]] = []
        for k, (first, step, position) in enumerate(starts):
            last = starts[k + 1][0] if k + 1 < len(starts) else len(entries)
            out.extend((step, position + i - first, entries[i])
                       for i in range(first, min(last, len(entries))))
        return out

    def shape(self) -> tuple:
        """What the digest depends on: the entries and where each step starts."""
        return tuple(self.entries), tuple((first, position) for first, _, position in self.starts)

    @property
    def records(self) -> List[str]:
        """"step s position p: entry" per collective (what ranks compare)."""
        return [f"step {s} position {p}: {e}" for s, p, e in self.located()]

    def digest(self) -> int:
        """The hash of "position p: entry" lines (the same every steady step),
        what the window's manifest carries."""
        return hash64("\n".join(f"position {p}: {e}" for _, p, e in self.located()))
