"""How the collective-sequence guard's ranks compare their windows through
the coordinator's key-value store (docs/PARTICIPATION.md, "The
collective-sequence guard"): after a diverged verdict, every rank's window at
that index (the same on every rank); after a stall, the windows ranks are
stuck in, which differ at a common position only when they diverged."""

from __future__ import annotations

import json
from typing import Dict, List, Optional

from accord.torch import members as member_sets
from accord.torch.windows import Window, Wording, describe, first_difference, past_final


class WindowComparison:
    """One rank's side: writes its own window under a key of the run, then
    reads every member's (every rank's when `members` is None)."""

    def __init__(self, client, group_id: str, rank: int, world_size: int, timeout_s: float,
                 wording: Wording = Wording(), members: member_sets.Members = None):
        self.client = client
        self.wording = wording  # of describe()
        self.group_id = group_id
        self.rank = rank
        self.world_size = world_size
        self.ranks = member_sets.ranks_of(members, world_size)  # whose windows are compared
        # A Get that times out names only the members that did not write.
        self._expected = {} if members is None else {"expected": list(self.ranks)}
        self.timeout_s = timeout_s
        self._stall_written = -1  # the window index whose stall this rank wrote

    def _all(self, key: str, timeout_s: float) -> Dict[int, dict]:
        values = self.client.kv_get([f"{key}/{r}" for r in self.ranks], timeout_s=timeout_s,
                                    **self._expected)
        return {r: json.loads(bytes(v).decode()) for r, v in zip(self.ranks, values)}

    def describe(self, entries: Dict[int, dict]) -> str:
        return describe(entries, self.wording)

    def gather(self, window: Window) -> Dict[int, dict]:
        """Every rank's window at this index; only this rank's, with a note,
        when some rank did not answer in time."""
        key = f"{self.group_id}/diverged/{window.index}"
        mine = {"records": window.records, "waiting": window.waiting, "unit": window.unit,
                "forward_all_gather": window.forward_all_gather}
        try:
            self.client.kv_set(f"{key}/{self.rank}", json.dumps(mine).encode())
            return self._all(key, min(self.timeout_s, 10.0))
        except Exception as e:  # noqa: BLE001 - some rank did not answer in time
            mine["records"] = mine["records"] + [f"(the other ranks did not report: {e})"]
            return {self.rank: mine}

    def stalled(self, records: List[str], index: int, timeout_s: float,
                final: bool = False) -> Optional[str]:
        """Compares the window this rank is stuck in (`records`, window
        `index`; `final` when it is closed and waits for its verdict) with the
        other ranks' of the same index: a message when they differ at a
        common position, or when another rank's goes on past a final one;
        None when they agree so far or some rank is not stuck there (it has
        not written)."""
        if not records and not final:
            return None  # stuck before its window's first collective: nothing to compare
        key = f"{self.group_id}/stalled/{index}"
        try:
            # Keys are write-once per run: a window's first stall is written,
            # a later one in the same window compares that (a true prefix).
            if self._stall_written != index:
                self.client.kv_set(f"{key}/{self.rank}",
                                   json.dumps({"records": records, "final": final}).encode())
                self._stall_written = index
            entries = self._all(key, timeout_s)
        except Exception:  # noqa: BLE001 - a rank that is not stuck has not written
            return None
        p = first_difference(entries, prefix_only=True)
        if p is None:
            p = past_final(entries)
        if p is None:
            return None  # the common prefix agrees: slow, not diverged
        return self.describe({r: {"records": e["records"][: p + 1]} for r, e in entries.items()})
