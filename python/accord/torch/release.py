"""One backward's release of reduce-scatters (docs/PARTICIPATION.md, "One
order during the backward").

During autograd a group's post-backward never reduce-scatters: it keeps the
gradient, as FSDP2 does without gradient sync. Each group is reduce-scattered
at its *turn*: groups go in release order (module order reversed), each once,
at release points placed among the backward's all-gathers the same way on
every rank (accord.torch.plan.ReleaseSchedule). A turn carries the layout the
group's history gives (accord.torch.plan.turn_layout), with zeros where this
rank has no gradient, and FSDP2 frees the unsharded gradient right after, as
it does alone. A group whose gradient is not there at its turn (late) sends
zeros. A group late on some rank in its last step takes its turn *at the
end*, at the end-of-backward point, after the others, until a step in which
it would have been on time everywhere (a branch that autograd runs after the
layers that follow it in module order pays its gradient's memory to the end,
not a second reduce-scatter every step).

At the end-of-backward point (FSDP2's final callback, which every rank
reaches once per backward) the remaining groups take their turns, then the
step's manifests go up as one batch with one more item, `~late`: which groups
this rank was late for. Once the decisions are in, each group is completed
the same way on every rank: a delta reduce-scatter of what some rank has not
sent yet, and trims of parameters no rank used.
"""

from __future__ import annotations

from typing import Optional

from accord.torch import fsdp2
from accord.torch.plan import ReleaseSchedule, complete


class Release:
    """One backward's turns and completion. Training thread only."""

    def __init__(self, installation, release_order: list, expected: Optional[int]):
        """`release_order`: every group; those without gradient sync this
        backward (set_requires_gradient_sync(False)) take no turn."""
        self.inst = installation
        self.order = [h for h in release_order if fsdp2.reduces(h.group)]
        order = self.order
        self.index = {id(h): i for i, h in enumerate(order)}
        self.schedule = ReleaseSchedule(len(order), expected)

    # ------------------------------------------------------------ release points

    def before_all_gather(self, hooked) -> None:
        i = self.index.get(id(hooked))
        if i is not None:
            turns = self.schedule.before_all_gather(i)
            if turns:
                self._turns(turns, in_backward=True)

    def after_all_gather(self, hooked) -> None:
        i = self.index.get(id(hooked))
        if i is not None:
            self.schedule.after_all_gather(i)

    def post_backward(self, hooked) -> bool:
        """At a group's post-backward: the turns it allows. True when they
        include the group's own: it was reduce-scattered right there, by
        FSDP2's post-backward, called once, as without accord."""
        i = self.index.get(id(hooked))
        if i is None:
            return False
        turns = self.schedule.at_post_backward(i)
        if not turns:
            return False
        own = i in turns
        if own:
            hooked.post_backward_ran()
        self._turns(turns, in_backward=True)
        return own

    def pre_backward(self, hooked) -> None:
        i = self.index.get(id(hooked))
        if i is not None:
            turns = self.schedule.at_pre_backward(i)
            if turns:
                self._turns(turns, in_backward=True)

    def _turns(self, indices, in_backward: bool, queue: Optional[list] = None) -> None:
        timing = self.inst.timing
        for i in indices:
            h = self.order[i]
            if h.history.turn_at_end:
                h.turn_passed(in_backward)
                continue
            turn = h.take_turn(in_backward, queue)
            if in_backward and not turn.late:
                timing.during += 1
            elif not in_backward:
                timing.at_end += 1

    # ------------------------------------------------------------ the end

    def finish(self) -> None:
        """The end-of-backward point: remaining turns, the step's batch, and
        each group's completion, in release order."""
        if not self.order:
            return
        inst = self.inst
        index = inst.released(self.schedule.all_gathers)
        for h in self.order:
            if not h.post_backwarded:
                h.hold()
        # The rest of the turns, then the groups whose turn is at the end,
        # then the batch: the guard's window of the step closes with the
        # batch, after every turn on every rank (turns of the last interval
        # come before the end on some ranks only). The turns taken here are
        # recorded first and issued after the batch, in the same order: their
        # reduce-scatters hide the batch's round trip, and nothing they
        # change is in it.
        queue = []
        self._turns(self.schedule.at_end(), in_backward=False, queue=queue)
        for h in self.order:
            if h.history.turn_at_end:
                h.take_turn(in_backward=False, queue=queue)
                inst.timing.at_end += 1
        try:
            closing = [h.closing() for h in self.order]  # (unsent, manifest, late here)
            manifests = [(h.group_id, h.turn.step, dtypes)
                         for h, (_, dtypes, _) in zip(self.order, closing)]
            negotiation = inst.negotiation
            handles = negotiation.submit_step(index, manifests, negotiation.late_item(
                index, self.order, [late for _, _, late in closing]))
        finally:
            # Recorded: issued on every rank whatever happened to the batch.
            for h, send, args in queue:
                h.issue(send, args)
        late_any = negotiation.wait_late()
        for h, decision, (unsent, dtypes, _) in zip(self.order, negotiation.wait_all(handles),
                                                    closing):
            real = h.layout_of(decision)
            late_somewhere = late_any.get(h.group_id, False)
            if unsent is None and not late_somewhere and real is h.turn.applied:
                h.settle_steady(decision, real)  # exactly what was sent: nothing to complete
                continue
            # A turn at the end came after the gradient: the group's `~late`
            # slot only says whether to keep its turn at the end.
            completion = complete(h.turn.applied, real, late_somewhere and not h.history.turn_at_end)
            h.complete(completion, unsent)
            if not completion.exact:
                inst.timing.repairs += 1
                h.stats.repaired += 1
                if completion.delta:
                    inst.timing.redone += 1
            h.settle(decision, real, dtypes, late_somewhere)
        negotiation.report()

    def end(self) -> None:
        for h in self.order:
            h.end_backward()
