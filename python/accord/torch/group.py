"""One FSDP2 parameter group under accord: its manifest, its turn in the
backward's release order, and the completion of its step once the real
decision is in (docs/PARTICIPATION.md, "One order during the backward")."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

import accord
from accord.agreement import ParamTuple
from accord.torch import fsdp2, members
from accord.torch.plan import Completion, History, Layout, turn_layout
from accord.torch.turn import DTYPE_NAMES, GroupStats, Turn, dtype_name, torch_dtype


class AccordFSDPError(RuntimeError):
    """The adapter could not apply a decision (names the group and rank)."""


class HookedGroup:
    """One FSDP parameter group under accord. Owned by the training thread."""

    def __init__(self, installation, group, group_id: str, names: List[str],
                 unit: Optional[str] = None, group_members: members.Members = None):
        self.installation = installation
        self.group = group
        self.group_id = group_id
        self.unit = unit if unit is not None else group_id.split("/", 1)[-1]
        self.members = group_members  # the ranks that reduce it; None: every rank
        self.params: List[ParamTuple] = []
        for name, fp in zip(names, fsdp2.group_params(group)):
            dim0, numel = fsdp2.param_shape(fp)
            self.params.append((name, dim0, numel))
        self.sizes = [p[2] for p in self.params]
        self.trainable = [fsdp2.trainable(fp) for fp in fsdp2.group_params(group)]
        # This rank's reduce-scatter dtype, then the ranks' join (agreed_wire()).
        self.wire = dtype_name(fsdp2.widest_grad_dtype(group))
        self.step = 0
        self.stats = GroupStats()
        self.history = History()
        self.turn: Optional[Turn] = None  # this backward's, once the group had it
        self.post_backwarded = False  # in this backward
        self.passed_unready = False  # turn at the end: not ready where it would have been
        self.reducing = False  # FSDP2's own post-backward is reduce-scattering
        self.held_after_turn = False  # a post-backward held a gradient after the turn
        self.found_unsent = False  # unsent() found a gradient FSDP2 still held
        self.sent_late = False  # ... of a parameter the turn kept no owed gradient for
        self.all_gather_entries: Dict[tuple, str] = {}  # the guard's records, by shape
        self.reduce_entries: Dict[tuple, tuple] = {}  # ... of reduce-scatters, by layout
        self.layouts: Dict[int, Layout] = {}  # decisions' layouts, by layout fingerprint
        # Steady turns: (layout, this rank's gradient dtypes) -> (dtype names,
        # bytes) where the layout is exactly those gradients, in one dtype.
        self.steady: Dict[tuple, tuple] = {}
        self._layout = (None, False, None)  # (history.last, grew_last, turn layout)
        self._none = (None,) * len(self.params)
        # FSDP2's own post- and pre-backward, bound to the group; accord's replace them.
        self.original, self.original_pre_backward = fsdp2.hook_group(
            group, self, self.post_backward, self.pre_backward)

    def registration(self) -> tuple:
        return members.registration((self.group_id, self.params, None, False), self.members)

    def agreed_wire(self, dtype: str) -> None:
        """The wire dtype agreed at install (`~wire`), fixed for the run."""
        self.wire = dtype

    # ------------------------------------------------------------ FSDP2's hooks

    def post_backward(self, *args, **kwargs):
        """Replaces the group's post_backward. It never reduce-scatters: it
        does what FSDP2 does without gradient sync (reshard, keep the
        gradient) and tells the backward's release, which reduce-scatters
        the group at its turn (accord.torch.release)."""
        if self.reducing or not fsdp2.reduces(self.group):
            return self.original(*args, **kwargs)
        if self.installation.backward().post_backward(self):
            return None  # its turn came now: reduce-scattered, as FSDP2 alone does
        self.hold()
        self.installation.timing.held += 1
        return None

    def hold(self) -> None:
        """FSDP2's post-backward without its reduce-scatter (reshard, keep
        the gradient)."""
        fsdp2.hold(self.group, self.original)
        self.post_backwarded = True
        if self.turn is not None:
            self.held_after_turn = True  # a gradient after the turn: unsent() looks

    def post_backward_ran(self) -> None:
        """Its post-backward is running now and its turn came there: FSDP2's
        own post-backward reduce-scatters it (accord.torch.release)."""
        self.post_backwarded = True

    def turn_passed(self, in_backward: bool) -> None:
        """Its turn is at the end; this was where it would have been: notes
        whether it would have been late."""
        self.passed_unready = in_backward and not self.post_backwarded

    def pre_backward(self, *args, **kwargs):
        release = self.installation.release_now()
        if release is not None:
            release.pre_backward(self)
        return self.original_pre_backward(*args, **kwargs)

    # ------------------------------------------------------------ the turn

    def take_turn(self, in_backward: bool, queue: Optional[list] = None) -> Turn:
        """Reduce-scatters the group now with the layout its history gives.
        A group whose post-backward has not run yet is *late*: it sends zeros
        and keeps its unit as it is (its gradient goes in the delta). With a
        `queue`, the reduce-scatter is recorded now and appended to it, to
        be issued later by issue() (the end-of-backward point)."""
        inst = self.installation
        layout = self._turn_layout()
        ready = self.post_backwarded or not in_backward
        turn = Turn(self.step, layout if any(layout.included) else None, None, self._none, {},
                    late=not ready, in_backward=in_backward)
        self.step += 1
        self.turn = turn
        # Every turn goes out before its decision; the completion repairs it.
        self.stats.speculated += 1
        inst.timing.speculated += 1
        if not ready:
            turn.was_none = fsdp2.sharded_grads_none(self.group)
            if turn.applied is not None:
                self._send(layout, None, midway=True, queue=queue)
            return turn
        local = fsdp2.local_grads(self.group)
        key = (layout, tuple([g.dtype if g is not None else None for g in local]))
        steady = self.steady.get(key)
        if steady is None:
            steady = self._steady(key, local)
        if steady:
            # The layout is the gradients FSDP2 holds, in one dtype: its
            # post-backward sends them as they are.
            turn.dtypes, turn.sent_bytes = steady
            turn.steady = True
            self._reduce(self._entries(layout, ""), queue, fsdp2.reduce_scatter_as_held,
                         self.group, self.original, torch_dtype(layout.wire_dtype))
            return turn
        names = DTYPE_NAMES
        turn.dtypes = tuple([(names.get(g.dtype) or dtype_name(g.dtype)) if g is not None
                             else None for g in local])
        turn.sent_bytes = sum([g.nbytes for g in local if g is not None])
        for i, g in enumerate(local):
            if g is not None and not layout.included[i]:
                turn.owed[i] = g
                self.stats.owed_bytes += g.numel() * g.element_size()
        turn.was_none = fsdp2.sharded_grads_none(self.group)
        if turn.applied is None:
            fsdp2.drop_local_grads(self.group)  # kept in turn.owed
        else:
            self._send(layout, local, midway=False, queue=queue)
        return turn

    def _turn_layout(self) -> Layout:
        """turn_layout() of the group's history, computed once per history."""
        h = self.history
        last, grew, layout = self._layout
        if h.last is not last or h.grew_last != grew or layout is None:
            layout = turn_layout(h, self.trainable, self.wire, self.installation.speculate)
            if layout == h.last:
                layout = h.last  # one object: the end of the backward compares by identity
            self._layout = (h.last, h.grew_last, layout)
        return layout

    def _steady(self, key: tuple, local) -> tuple:
        """Whether a turn of `key` (its layout, this rank's gradient dtypes)
        is steady: the layout is exactly this rank's gradients, in one dtype.
        Then (dtype names, bytes), else (); remembered per key."""
        layout, dtypes = key
        present = tuple([dt is not None for dt in dtypes])
        steady = ()
        if any(present) and present == layout.included and len(set(dtypes) - {None}) == 1:
            steady = (tuple([dtype_name(dt) if dt is not None else None for dt in dtypes]),
                      sum([g.nbytes for g in local if g is not None]))
        if len(self.steady) >= 16:
            self.steady.clear()
        self.steady[key] = steady
        return steady

    def layout_of(self, decision) -> Layout:
        """Layout.of(decision), one object per layout fingerprint."""
        layout = self.layouts.get(decision.layout_fingerprint)
        if layout is None:
            layout = Layout.of(decision)
            if len(self.layouts) >= 16:
                self.layouts.clear()
            self.layouts[decision.layout_fingerprint] = layout
        return layout

    def _send(self, layout: Layout, local, midway: bool, suffix: str = "",
              queue: Optional[list] = None) -> None:
        """FSDP2's own post-backward reduce-scatters `layout`: this rank's
        gradient where `local` has one, zeros for the other included
        parameters, in the group's wire dtype."""
        wire = torch_dtype(layout.wire_dtype)
        fills = []
        for i, fp in enumerate(fsdp2.group_params(self.group)):
            grad = local[i] if local is not None else None
            if not layout.included[i]:
                fills.append(None)
                continue
            if grad is None and not fsdp2.was_unsharded(fp):
                raise AccordFSDPError(
                    f"accord: group {self.group_id} rank {self.installation.rank}: parameter "
                    f"{self.params[i][0]} is used on another rank but this rank never ran "
                    f"this FSDP unit's forward, so there is nothing to zero-fill; run the "
                    f"unit's forward once on every rank (e.g. on an empty batch), or mark "
                    f"it optional")
            fills.append(grad if grad is not None else wire)
        self._reduce(self._entries(layout, suffix), queue, fsdp2.reduce_scatter, self.group,
                     self.original, fills, wire, midway)

    def _reduce(self, entries: tuple, queue: Optional[list], send, *args) -> None:
        """Records the group's reduce-scatter (and HSDP's all-reduce), its
        `entries`, with the guard and the step watch, then `send(*args)`s it,
        or appends it to `queue` for issue()."""
        inst = self.installation
        for entry in entries:
            inst.record_reduce(entry, self.group)
        if queue is not None:
            queue.append((self, send, args))
        else:
            self.issue(send, args)

    def issue(self, send, args: tuple) -> None:
        """Issues a reduce-scatter _reduce() recorded."""
        self.reducing = True
        try:
            send(*args)
        except RuntimeError as e:
            self.installation.explain(e)
            raise
        finally:
            self.reducing = False

    def _entries(self, layout: Layout, suffix: str) -> tuple:
        """The guard's records of one reduce-scatter of `layout` (cached: a
        group has a few layouts)."""
        hsdp = fsdp2.all_reduces(self.group) and fsdp2.all_reduce_enabled(self.group)
        key = (layout, suffix, hsdp)
        entries = self.reduce_entries.get(key)
        if entries is None:
            numel = layout.numel(self.sizes)
            entries = (f"reduce-scatter of '{self.unit}' ({numel} x {layout.wire_dtype}){suffix}",)
            if hsdp:
                # HSDP: FSDP2 all-reduces the shard across replicas right
                # after the reduce-scatter, in the same call.
                entries += (f"all-reduce across replicas of '{self.unit}' (shard of "
                            f"{numel} x {layout.wire_dtype}){suffix}",)
            self.reduce_entries[key] = entries
        return entries

    # ------------------------------------------------------------ the end

    def closing(self) -> tuple:
        """At the end of the backward, every post-backward done: (unsent(),
        manifest(), late_here()); unsent None when the turn was steady and
        nothing came after it."""
        turn = self.turn
        if turn.steady and not self.held_after_turn and not self.passed_unready:
            return None, turn.dtypes, False
        unsent = self.unsent()
        return unsent, self.manifest(unsent), self.late_here(unsent)

    def unsent(self) -> List[Optional[torch.Tensor]]:
        """At the end of the backward, every post-backward done: gradients of
        this step not sent at the turn (a late gradient, a second use after
        the turn, the owed ones)."""
        turn = self.turn
        if turn.in_backward and (turn.late or self.held_after_turn or self.passed_unready):
            local = fsdp2.local_grads(self.group)
            found = [i for i, g in enumerate(local) if g is not None]
            self.found_unsent = bool(found)
            self.sent_late = any([i not in turn.owed for i in found])
        else:
            # The turn carried (or, at the end, will carry) every gradient
            # there was, and a gradient after it comes only with a
            # post-backward (hold()); none comes after a turn at the end.
            local = [None] * len(self.params)
            self.found_unsent = self.sent_late = False
        for i, g in turn.owed.items():
            local[i] = g if local[i] is None else local[i] + g
        return local

    def late_here(self, unsent: List[Optional[torch.Tensor]]) -> bool:
        """This rank's `~late` slot: a gradient came after the turn (or,
        its turn at the end, would have: the turn's place passed before it came)."""
        if self.passed_unready:
            return any(dt is not None for dt in self.turn.dtypes)
        return self.sent_late

    def manifest(self, unsent: List[Optional[torch.Tensor]]) -> List[Optional[str]]:
        """This rank's manifest of the step: each parameter's gradient dtype
        (sent at the turn or not), None where it had none."""
        if not self.found_unsent and not self.turn.owed:
            return list(self.turn.dtypes)
        out = []
        for sent, late in zip(self.turn.dtypes, unsent):
            if late is None:
                out.append(sent)
            elif sent is None or sent == dtype_name(late.dtype):
                out.append(dtype_name(late.dtype))
            else:
                out.append(str(accord.join(sent, dtype_name(late.dtype))))
        return out

    def complete(self, completion: Completion, unsent) -> None:
        """The delta reduce-scatter (every rank, the same parameters) and the
        trims, in that order."""
        turn = self.turn
        n = len(self.params)
        if unsent is None:
            unsent = [None] * n
        late_here = self.late_here(unsent)
        if late_here and (turn.in_backward or self.passed_unready):
            self.stats.late += 1
            nbytes = self.turn.sent_bytes if self.passed_unready else sum(
                g.numel() * g.element_size() for i, g in enumerate(unsent)
                if g is not None and i not in turn.owed)
            self.stats.late_bytes += nbytes
            self.installation.timing.late += 1
            self.installation.timing.late_bytes += nbytes
        if self.found_unsent:
            fsdp2.drop_local_grads(self.group)  # kept in `unsent` for the delta
        if completion.delta:
            chosen = set(completion.delta)
            self._send(Layout(tuple(i in chosen for i in range(n)), self.wire), unsent,
                       midway=False, suffix=" (late)")
        if completion.trimmed and turn.was_none is None:
            raise AccordFSDPError(
                f"accord: group {self.group_id} rank {self.installation.rank}: the decision "
                f"trims parameter {self.params[completion.trimmed[0]][0]}, which this rank sent "
                f"a gradient for at its turn; the ranks disagree on the decision")
        for i in completion.trimmed:
            if turn.was_none[i]:
                fsdp2.sharded_param(fsdp2.group_params(self.group)[i]).grad = None
        turn.owed.clear()

    def settle_steady(self, decision, layout: Layout) -> None:
        """settle() of a steady turn whose decision was its layout and that
        no rank was late for: nothing trimmed, zero-filled or widened here."""
        s = self.stats
        s.reductions += 1
        s.last_decision = decision
        s.skipped += layout.included.count(False)
        self.history.last = layout
        self.history.grew_last = False
        self.history.turn_at_end = False

    def settle(self, decision, layout: Layout, dtypes: List[Optional[str]],
               late_somewhere: bool) -> None:
        """This step's stats and history, from its final decision (`layout`:
        Layout.of(decision)) and this rank's manifest of the step."""
        s = self.stats
        s.reductions += 1
        s.last_decision = decision
        included = layout.included
        applied = self.turn.applied.included if self.turn.applied else (False,) * len(dtypes)
        used = [dt for dt, inc in zip(dtypes, included) if inc]
        s.skipped += len(included) - len(used)
        s.zero_filled += used.count(None)
        present = set(used) - {None}
        if len(present) > 1:  # gradients converted beside others of another dtype
            s.widened += len([dt for dt in used if dt is not None and dt != self.wire])
        self.history.last = layout
        self.history.grew_last = any([r and not a for a, r in zip(applied, included)])
        self.history.turn_at_end = late_somewhere

    def unhook(self) -> None:
        """Gives the group FSDP2's own post- and pre-backward back."""
        fsdp2.unhook_group(self.group)

    def end_backward(self) -> None:
        self.turn = None
        self.post_backwarded = False
        self.passed_unready = False
        self.held_after_turn = False
        self.found_unsent = False
        self.sent_late = False
