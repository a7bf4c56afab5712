"""PURE: exploration — plans chosen from the engine's own measurements (docs/DESIGN.md §9.6).

In the first steps of a run (stride="auto") the Planner tries plans for a few consecutive steps
each, times each step (the iteration's period, measured by the Planner), and keeps the fastest
measured. Two stages: first the `anchors`, all-CPU and stride 2 — the ends of the useful range,
whose lane times fit the rates in situ (the CPU alone; the CPU, copies and DRAM under DMA) — then
the plans the model ranks best under those fitted rates (`candidates`, not measured yet). The
model only proposes; the clock decides. Cost is bounded: at most `steps_per` steps per candidate
and `max_steps` in all (fewer candidates when they would not fit).

`candidates` ranks the plans a running engine may switch to (same resident subgroups, the slots
already allocated); `Explorer` holds one exploration's schedule and measurements. No torch, no
clock here: the Planner (dos/planner.py) feeds measured seconds in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Dict, List, Optional, Tuple

from .perfmodel import Calibration, build_plan, predict, shares
from .plan import Plan

# Steps each candidate runs. One: across 186 recorded candidates that ran two (every exploring run
# under experiments/results/ through session 24), the step that carried the switch took a median
# 0.99x the one after it (10-90%: 0.90-1.06x), so a second step adds a sample but no correction, and
# it doubled the cost, which a 22-step planner run charges to auto: ~0.7 s, 4% of its iteration
# (planner-3b 20261205T2150Z-s24; docs/DESIGN.md §10).
STEPS_PER = 1
MAX_STEPS = 12      # steps one exploration may take (the schedule)
N_BEST = 3          # the model's best plans tried, besides all-CPU and stride 2
# The second stage's plans are at least this factor apart in staged share from each other and from
# the staged plans tried (all-CPU aside): where the model's predictions are flat, its best plans
# bunch — planner-deep-3.5b (s30) and planner-wide-4b (s32) ranked strides 16, 14, 12 (or 11) within
# 0.1% of each other, so stage 2 measured three near-all-CPU plans and kept stride 16, 10-11% slower than
# the batch's best fixed stride (4 and 3), which it never tried (docs/DESIGN.md §9.6).
SPREAD = 1.5
EXPLORE_DRIFT = 0.2  # explore again once a refined rate moved this much since the last exploration
COOLDOWN = 50       # ... but not within this many steps of the last one
SETTLE = 5          # steps of the kept plan before the reference rates for drift are taken
MAX_LAG = 6         # steps past the schedule an exploration waits for its last measurements
# A candidate whose first measured step took this much longer than the best candidate measured so
# far runs no further step: its first step (which carries the switch) already rules it out, and
# each further one is pure cost. planner-3b: all-CPU's two steps were ~half of the 0.74-0.88 s an
# exploration cost (1.02 s a step against 0.84 for the kept plan). Only where `steps_per` > 1.
DROP_ABOVE = 0.15


def key(plan: Plan) -> Tuple:
    """What makes two plans the same for the update phase."""
    return plan.lanes, plan.cpu_threads, plan.staging_slots


def candidates(plan: Plan, calib: Calibration, *, staging_slots: int, max_threads: int,
               n_best: int = N_BEST, grad_bytes: int = 2, param_bytes: int = 2,
               head_start_s: float = 0.0, with_plan: bool = True) -> List[Tuple[Plan, float]]:
    """(plan, predicted update phase) to try, fastest predicted first: the `n_best` best by the
    model, `plan` itself (unless not `with_plan`), all-CPU and stride 2 (a staged plan; where slots
    are allocated). All keep `plan`'s resident subgroups and use the `staging_slots` allocated (a
    running engine can move subgroups only between the CPU and staged lanes) at the current or the
    most threads."""
    numels, r = plan.numels, len(plan.resident)
    kw = dict(grad_bytes=grad_bytes, param_bytes=param_bytes, head_start_s=head_start_s)

    def make(share: Fraction, t: int) -> Plan:
        return build_plan(numels, resident=r, staged_share=share, cpu_threads=t,
                          staging_slots=staging_slots, placement=plan.placement,
                          state_dtype=plan.state_dtype)

    if plan.resident != tuple(range(r)):  # build_plan makes the first subgroups resident
        return [(plan, predict(plan, calib, **kw).total_s)]
    threads = sorted({plan.cpu_threads, max_threads})
    if staging_slots <= 0 or r >= len(numels) or not calib.has_gpu:
        searched = [Fraction(0)] if r < len(numels) else []
    else:
        searched = shares()
    def alike(p: Plan) -> Tuple:  # plans that split the work alike: one of them is enough
        return round(p.share("staged"), 2), p.cpu_threads

    def timed(p: Plan) -> Tuple[Plan, float]:
        s = predict(p, calib, **kw).total_s
        return p.replace(predicted_step_s=s), s

    pool: Dict[Tuple, Tuple[Plan, float]] = {}
    for share in searched:
        for t in threads:
            p, s = timed(make(share, t))
            if alike(p) not in pool or s < pool[alike(p)][1]:
                pool[alike(p)] = (p, s)
    ranked = sorted(pool.values(), key=lambda e: (e[1], -e[0].cpu_threads))
    chosen: Dict[Tuple, Tuple[Plan, float]] = {alike(p): (p, s) for p, s in ranked[:n_best]}
    must = [plan] if with_plan else []
    if r < len(numels):
        must.append(make(Fraction(0), max_threads))
        if staging_slots > 0 and calib.has_gpu:
            must.append(make(Fraction(1, 2), max_threads))
    for p in must:
        chosen.setdefault(alike(p), timed(p))
    return sorted(chosen.values(), key=lambda e: (e[1], -e[0].cpu_threads))


def anchors(plan: Plan, calib: Calibration, **kw) -> List[Tuple[Plan, float]]:
    """An exploration's first stage: stride 2 (where slots are allocated; `candidates`' arguments)
    and all-CPU, in that order. Measured first because the model's ranking is only as
    good as its rates: the offline profile's drift between machine starts (docs/DESIGN.md §9.2),
    and the plans it ranks best bunch where it errs (planner-3b-repeat: all-CPU and staged shares
    of 6-7%, all within 1.5% of each other by the model, 5-18% slower than stride 2 measured).
    Their lane times fit the rates the second stage ranks with. Stride 2 runs first: all-CPU,
    measured second, runs one step only where it is ruled out (`DROP_ABOVE`). With nothing to
    stage: all-CPU alone."""
    ends = candidates(plan, calib, n_best=0, with_plan=False, **kw)
    return sorted(ends, key=lambda e: e[0].share("staged") == 0)


def refined(ex: "Explorer", plan: Plan, calib: Calibration, n_best: int = N_BEST,
            spread: float = SPREAD, **kw) -> List[Tuple[Plan, float]]:
    """An exploration's second stage: `n_best` plans the model ranks best under `calib` (the rates
    fitted in situ on the anchors' steps) that `ex` has not tried, fastest predicted first. Taken
    down the ranking, a plan whose staged share is within a factor `spread` of one taken or tried
    (all-CPU aside) waits: those fill the places left only when no farther plan remains. The
    model's best is always taken; the others cover the range instead of its neighbours, which it
    cannot tell apart where its predictions are flat (`SPREAD`)."""
    tried = {key(p) for p, _ in ex.candidates}
    ranked = [(p, s) for p, s in candidates(plan, calib, n_best=10**6, with_plan=False, **kw)
              if key(p) not in tried]
    taken_shares = [p.share("staged") for p, _ in ex.candidates if p.share("staged") > 0]

    def apart(p: Plan) -> bool:
        s = p.share("staged")
        return s == 0 or all(max(s, q) / min(s, q) >= spread for q in taken_shares)

    chosen, waiting = [], []
    for p, s in ranked:
        if len(chosen) >= n_best:
            break
        if not chosen or apart(p):  # the model's best, then the plans apart from those taken
            chosen.append((p, s))
            if p.share("staged") > 0:
                taken_shares.append(p.share("staged"))
        else:
            waiting.append((p, s))
    chosen += waiting[:n_best - len(chosen)]
    return sorted(chosen, key=lambda e: (e[1], -e[0].cpu_threads))


@dataclass
class Explorer:
    """One exploration: a schedule of candidates (each `steps_per` consecutive steps; as many
    candidates as `max_steps` holds, in the order given), their measured step times, the best."""

    candidates: List[Tuple[Plan, float]]
    start_step: int = 0
    steps_per: int = STEPS_PER
    max_steps: int = MAX_STEPS
    drop_above: Optional[float] = DROP_ABOVE  # None: every candidate runs all its steps
    times: Dict[Tuple, List[float]] = field(default_factory=dict)
    steps: int = 0  # steps measured under a candidate of this exploration
    spent: List[float] = field(default_factory=list)  # every measured step, in order
    _issued: int = 0  # schedule positions handed out
    stage: int = 1  # 1 + the number of `extend` calls
    # step -> the key of the candidate scheduled to run it (`next_plan(step=)`); once any is, a
    # sample counts only for the step it was scheduled for (`observe(step=)`): not the step before
    # the exploration, nor a step that waited for late measurements under the last candidate
    _runs: Dict[int, Tuple] = field(default_factory=dict)
    _seen: set = field(default_factory=set)  # steps of `_runs` measured

    def __post_init__(self):
        keep = max(1, self.max_steps // max(1, self.steps_per))
        self.candidates = list(self.candidates)[:keep]
        self._by_key = {key(p): p for p, _ in self.candidates}
        self._stage = {key(p): 1 for p, _ in self.candidates}
        self._order = [p for p, _ in self.candidates for _ in range(self.steps_per)]

    def extend(self, more: List[Tuple[Plan, float]]) -> int:
        """Schedule further candidates (a later stage) after those scheduled, as many as
        `max_steps` still holds, each `steps_per` steps; plans already candidates are skipped.
        Returns how many were added."""
        room = (self.max_steps - len(self._order)) // max(1, self.steps_per)
        new = [(p, s) for p, s in more if key(p) not in self._by_key][:max(0, room)]
        self.stage += 1
        for p, s in new:
            self.candidates.append((p, s))
            self._by_key[key(p)], self._stage[key(p)] = p, self.stage
            self._order += [p] * self.steps_per
        return len(new)

    def next_plan(self, step: Optional[int] = None) -> Optional[Plan]:
        """The plan for the next step of the schedule (skipping the further steps of a candidate
        already ruled out, `drop_above`); None once it is exhausted. `step`: the step it will run
        (its sample is then awaited for `finished` and accepted only for that step)."""
        while self._issued < len(self._order):
            self._issued += 1
            p = self._order[self._issued - 1]
            if not self._ruled_out(p):
                if step is not None:
                    self._runs[step] = key(p)
                return p
        return None

    def _ruled_out(self, plan: Plan) -> bool:
        """Measured already, and slower by more than `drop_above` than the best other candidate."""
        k, limit = key(plan), self.drop_above
        if limit is None or k not in self.times:
            return False
        others = [min(ts) for kk, ts in self.times.items() if kk != k]
        return bool(others) and min(self.times[k]) > (1 + limit) * min(others)

    def observe(self, plan: Plan, seconds: float, step: Optional[int] = None) -> None:
        """A measured step (seconds) run under `plan`; steps under other plans are ignored, and,
        once steps were scheduled by number (`next_plan(step=)`), steps not scheduled so."""
        k = key(plan)
        if k not in self._by_key or seconds is None or seconds <= 0:
            return
        if self._runs and step is not None:
            if self._runs.get(step) != k or step in self._seen:
                return
            self._seen.add(step)
        self.times.setdefault(k, []).append(seconds)
        self.steps += 1
        self.spent.append(seconds)

    @property
    def length(self) -> int:
        """Steps in the schedule."""
        return len(self._order)

    @property
    def scheduled(self) -> bool:
        """Every schedule position handed out."""
        return self._issued >= len(self._order)

    @property
    def finished(self) -> bool:
        """The schedule ran, every candidate has a measurement and every step scheduled by number
        its sample (the last candidate's last step included)."""
        return (self.scheduled and all(key(p) in self.times for p, _ in self.candidates)
                and len(self._seen) >= len(self._runs))

    def measured(self, plan: Plan) -> Optional[float]:
        """A candidate's step time: the least of its measured steps (the first one after a switch
        may carry the switch; a foreign hiccup only lengthens a step)."""
        ts = self.times.get(key(plan))
        return min(ts) if ts else None

    def best(self) -> Tuple[Plan, float]:
        """The fastest measured candidate (ties: the model's order) and its step time."""
        timed = [(self.measured(p), i, p) for i, (p, _) in enumerate(self.candidates)
                 if self.measured(p) is not None]
        if not timed:
            raise ValueError("no candidate was measured")
        s, _, p = min(timed)
        return p, s

    def cost_s(self, kept_s: Optional[float] = None) -> float:
        """Seconds the measured exploration steps took beyond the kept plan's step time: `kept_s`
        (the Planner passes the kept plan's median step once it ran `SETTLE` steps), else the
        least of the kept plan's exploration steps (an upper bound of the cost: every step's noise
        above that minimum counts as cost)."""
        if not self.spent or not self.times:
            return 0.0
        ref = self.best()[1] if kept_s is None else kept_s
        return max(0.0, sum(self.spent) - ref * len(self.spent))

    def to_record(self) -> dict:
        kept = self.best()[0] if self.times else None
        return {"start_step": self.start_step, "steps": self.steps, "explore_s": round(self.cost_s(), 6),
                "kept": None if kept is None else _label(kept),
                "candidates": [dict(_label(p), predicted_s=round(pred, 6),
                                    measured_s=None if self.measured(p) is None else round(self.measured(p), 6),
                                    steps=len(self.times.get(key(p), ())), stage=self._stage[key(p)])
                               for p, pred in self.candidates]}


def _label(plan: Plan) -> dict:
    return {"stride": plan.stride, "staged_share": round(plan.share("staged"), 6),
            "cpu_threads": plan.cpu_threads}
