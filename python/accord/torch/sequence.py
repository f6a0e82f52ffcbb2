"""Which of a rank's collectives are new: the training thread's part of the
collective-sequence guard (docs/PARTICIPATION.md, "The collective-sequence
guard"). Pure: no I/O, no threads; unit-tested directly
(tests/python/test_guard.py).

A transition is (prefix, entry): the hash of the step's records so far and
the next record. It is new until every rank agreed on it (agree()). Paths make
the steady state cheap: the last PATHS distinct steps whose transitions were
all agreed, each as its entries and the prefix before each (prefixes[p]
before entry p). While a step follows one, a record is one comparison
(follows()); where it differs, another path with the same prefix that goes on
with the record takes over (a few step patterns, as with gradient
accumulation's microbatches); otherwise the step leaves the paths and each
record is looked up in the agreed set (off_path()). Paths change which lookup
answers, never the answer."""

from __future__ import annotations

from typing import List, Tuple

PATHS = 4


class StepSequence:
    def __init__(self):
        self.position = 0  # of the next record in this step
        self.prefix = 0  # off the paths: the running hash of this step's records
        self.known: set = set()  # agreed transitions
        self.off_path = 0  # records looked up in the agreed set
        self._paths: List[Tuple[List[str], List[int]]] = []  # most recent first
        self._path: List[str] = []  # the one followed
        self._path_prefix: List[int] = [0]
        self._on = True
        self._seq: List[str] = []  # off the paths: this step so far
        self._seq_prefix: List[int] = [0]
        self._seq_agreed = True  # every transition of this step agreed

    def follows(self, entry: str) -> bool:
        """Whether the next record, `entry`, is on an agreed path (then it is
        counted); False leaves the paths for the rest of the step."""
        if not self._on:
            return False
        p = self.position
        path = self._path
        if (p < len(path) and path[p] == entry) or self._switch(p, entry):
            self.position = p + 1
            return True
        self._on = False
        self._seq, self._seq_prefix = path[:p], self._path_prefix[:p + 1]
        self.prefix = self._path_prefix[p]
        return False

    def _switch(self, p: int, entry: str) -> bool:
        prefix = self._path_prefix[p]
        for entries, prefixes in self._paths:
            if (entries is not self._path and p < len(entries) and prefixes[p] == prefix
                    and entries[p] == entry):
                self._path, self._path_prefix = entries, prefixes
                return True
        return False

    def off_path_record(self, entry: str) -> Tuple[tuple, bool]:
        """Counts a record off the paths; returns (its transition, whether
        it is new)."""
        self.off_path += 1
        transition = (self.prefix, entry)
        # Which transitions this rank saw agreed is local state: Python's
        # hash (the same within the process) serves.
        self.prefix = hash(transition)
        self.position += 1
        self._seq.append(entry)
        self._seq_prefix.append(self.prefix)
        return transition, transition not in self.known

    def agree(self, transition: tuple) -> None:
        self.known.add(transition)

    def unagreed(self) -> None:
        """This step has a record whose transition was never agreed (it was
        repaired): the step never becomes a path."""
        self._seq_agreed = False

    def end_step(self) -> None:
        """After the step's last record (its end included): a step off the
        paths whose transitions were all agreed becomes the most recent
        path; one that followed a path makes it the most recent."""
        if self._on:
            followed = next((i for i, (e, _) in enumerate(self._paths) if e is self._path), 0)
            if followed > 0:  # not already the most recent
                self._paths.insert(0, self._paths.pop(followed))
        elif self._seq_agreed:
            self._paths.insert(0, (self._seq, self._seq_prefix))
            del self._paths[PATHS:]
        self._path, self._path_prefix = self._paths[0] if self._paths else ([], [0])
        self._on, self._seq_agreed = True, True
        self.position, self.prefix = 0, 0
