"""The Planner: every decision about the Plan in force, and the measurements it rests on.

It owns this machine's calibration (refined online from the lane times the Timeline measures),
the CPU lane's head start under overlap_backward, the log of re-plans, and the resident sizing of
`gpu_fraction="auto"`. The engine calls `before_step` and `after_step` around each update phase;
the math lives in the pure modules (`perfmodel`: prediction and search, `refine`: online
refinement), the Planner only holds state and applies their answers.
"""
from __future__ import annotations

import os
import statistics
import time
import warnings
from fractions import Fraction
from typing import List, Optional

import torch

from . import explore, perfmodel, refine
from .config import EngineConfig
from .partition import Layout
from .plan import Plan, make_plan
from .residency import Residency

REPLAN_DRIFT = 0.02  # search again once a rate (or the head start) moved this much


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cores_per_rank(local_ranks: int = 1) -> int:
    """CPU-lane threads of one process when `local_ranks` processes of the job share this host's
    cores (FSDP2 / DDP under torchrun): an equal split, never oversubscribed."""
    return max(1, usable_cores() // max(1, local_ranks))


class Planner:
    def __init__(self, config: EngineConfig, layout: Layout, itemsize: int, device: torch.device,
                 local_ranks: int = 1):
        # every plan made here carries the config's state format (its bytes in the model)
        self.config, self.layout, self.device = config, layout, device
        self._bytes = dict(grad_bytes=itemsize, param_bytes=itemsize)
        self.max_threads = config.cpu_threads or cores_per_rank(local_ranks)
        self.local_ranks = local_ranks
        self.calibration = _calibration(device, local_ranks)
        calibrated = self.calibration is not None
        if calibrated and self.calibration.source == "derated":
            warnings.warn(f"dos: {self.calibration.warnings[-1]}", stacklevel=3)
        # Online refinement re-plans the stride and threads (stride="auto" only).
        self.refining = (config.replan and config.placement == "interleaved" and config.stride == "auto"
                         and calibrated)
        # gpu_fraction="auto": the resident share is chosen at the first step, once the
        # iteration's peak GPU memory is known.
        # Without a calibration (CUDA): as many resident subgroups as fit (perfmodel.fill_resident).
        self.sizing = config.gpu_fraction == "auto" and (calibrated or _sizes_by_memory(device))
        # Resident-first (dos.residency): while sizing is pending the host arena is reserved but
        # neither written nor pinned, so the host never holds the resident share.
        self.residency = Residency(config, layout, device, local_ranks, deferred=self.sizing)
        if config.gpu_fraction == "auto" and not calibrated:
            if self.sizing:
                warnings.warn("dos: gpu_fraction='auto' without a calibration of this machine: the "
                              "resident share is what fits the GPU after the first step, the rest "
                              "split by the stride rule (run `python -m dos calibrate` for the "
                              "performance model's plan)", stacklevel=3)
            else:
                warnings.warn("dos: gpu_fraction='auto' keeps nothing resident: the parameters are "
                              "not on a CUDA device", stacklevel=3)
        self._searched = self._searched_from = self.calibration  # (as loaded: describe())
        self._searched_head_start = 0.0  # ... and the head start (overlap_backward)
        self.head_start_s = 0.0  # backward seconds the CPU lane overlaps (moving average)
        self.replans: List[dict] = []  # {"step", "plan", "predicted_step_s"} of every re-plan
        self.plan = self._initial_plan()
        self._lanes = self._dev = self._host = self._sync = self._tl = None
        # Exploration (docs/DESIGN.md §9.6): stride="auto" keeps the plan measured fastest.
        self.exploring = self.refining and _explores(device)
        self.clock = time.perf_counter  # the host clock where no device event times a step
        self.explorer: Optional[explore.Explorer] = None  # the exploration under way
        self.explorations: List[dict] = []  # records of finished explorations
        self.explore_steps, self.explore_s = 0, 0.0
        self._explored_calib = None  # the rates once the kept plan settled after an exploration
        self._explored_step = 0  # the step the last exploration ended
        self._explored = False  # an exploration ended (or there was nothing to explore)
        # The last exploration until its kept plan ran SETTLE steps: (its Explorer, the kept plan's
        # key, that plan's measured step times since), for the cost against its median step.
        self._settling = None
        # [step, plan, mark]: each step's start (_time_steps), not yet timed
        self._marks: List[tuple] = []
        self._step_plan = self._prev_step_plan = None  # the plans of the step under way / before
        self.step_times: List[tuple] = []  # (step, seconds) measured, the last few

    @property
    def may_stage_later(self) -> bool:
        """Whether a later plan may stage subgroups that this one does not (slots to allocate)."""
        return self.refining or (self.sizing and self.config.placement == "interleaved")

    def attach(self, lanes, dev, host, sync, timeline) -> None:
        """The engine's objects a plan change acts on (lanes, buffers) or reads (lane times)."""
        self._lanes, self._dev, self._host, self._sync, self._tl = lanes, dev, host, sync, timeline

    def _initial_plan(self) -> Plan:
        """The plan the config asks for; with a calibration of this machine, stride="auto" is the
        performance model's choice (share and threads, resident share as configured) and every
        plan carries its predicted update-phase time."""
        cfg, calib = self.config, self.calibration
        plan = make_plan(self.layout, placement=cfg.placement, stride=cfg.stride,
                         gpu_fraction=cfg.fixed_fraction, cpu_threads=self.max_threads,
                         staging_slots=cfg.staging_slots, state_dtype=cfg.state_dtype)
        if calib is None:
            return plan
        if cfg.placement == "interleaved" and cfg.stride == "auto":
            plan, _ = perfmodel.choose(plan.numels, calib, free_gpu_bytes=float("inf"),
                                       max_threads=self.max_threads, staging_slots=cfg.staging_slots,
                                       resident=len(plan.resident), state_dtype=cfg.state_dtype,
                                       **self._bytes)
            return plan.replace(source="perfmodel")
        return plan.replace(predicted_step_s=perfmodel.predict(plan, calib, **self._bytes).total_s)

    # -- around each update phase --------------------------------------------------------------
    def before_step(self, step: int, progress, starts_in_backward: bool) -> None:
        """At a step's start: the head start the CPU lane had (`progress`, dos.cpu_lane.Progress,
        taken as step() began; None: it did not start in backward); at the first step the
        resident sizing (gpu_fraction="auto"); else, for a lane that starts in step(), online
        refinement on the previous step's lane times."""
        if progress is not None:
            done = sum(self.layout.subgroups[s].numel for s in progress.done)
            h = refine.head_start(progress.window_s, done, progress.backlog, self.calibration,
                                  self.plan.cpu_threads)
            self.head_start_s = h if not self.head_start_s else 0.5 * (self.head_start_s + h)
        ran = self._step_plan  # the plan the previous step ran
        if self.exploring and not starts_in_backward:
            self._time_steps(step)  # a lane started in backward: marked at after_step instead
        if self.sizing:
            self.sizing = False
            self._size_resident(step)
            self.materialize()  # nothing fitted, or no sizing possible: all of it on the host
        elif self.refining and not starts_in_backward:
            self._refine(step, ran)
            if self.exploring:
                self._explore(step)
        self._prev_step_plan, self._step_plan = ran, self.plan
        if self._marks and self._marks[-1][0] == step:
            self._marks[-1][1] = self.plan

    def after_step(self, step: int, starts_in_backward: bool) -> None:
        """A lane that starts in backward re-plans after the update instead: the next backward
        starts it by the plan in force (a re-plan at the next step's start could hand an
        already-updated subgroup to the GPU). It uses the previous step's times too."""
        if self.refining and starts_in_backward:
            self._refine(step, self._previous_plan)
            if self.exploring:
                self._explore(step, at=step + 1)
                # The next step runs from here by the plan just set: its backward starts the CPU
                # lane by it (its head start), its update follows. Marked at step() start instead,
                # a step's time would hold its update and the next plan's backward: after a switch,
                # one candidate charged with another's head start (headline-3b, 2026-12-04:
                # all-CPU measured 0.516 s, kept at 0.717; docs/DESIGN.md decision log).
                self._time_steps(step + 1)
                self._marks[-1][1] = self.plan

    # -- measuring and exploring ---------------------------------------------------------------
    def _mark(self):
        """A timestamp of now on the stream the iteration runs on: an event on the main stream
        (CUDA; it completes once the GPU got there, so a GPU-bound step is timed by the GPU and a
        host-bound one by the host) or the host clock."""
        sync = self._sync
        if sync is not None and getattr(sync, "is_async", False) and getattr(sync, "timing", False):
            return sync.record("main")
        return self.clock()

    @staticmethod
    def _elapsed(a, b) -> Optional[float]:
        if isinstance(a, float) and isinstance(b, float):
            return b - a
        if isinstance(a, float) or isinstance(b, float):
            return None
        return a.elapsed_time(b) / 1e3 if b.query() else None  # never blocks

    def _time_steps(self, step: int) -> None:
        """Where `step` starts: mark it, and time every earlier step whose end (the next one's
        start) has happened — a step's time is the iteration's period, so all of it counts: the
        update phase and what it costs the forward and backward. A step starts where its plan
        takes over: at its `step()` (the update follows at once; the next forward and backward
        wait on its weights), or, with the CPU lane started in backward, at the previous step's
        end (the plan for its backward and update is set there)."""
        self._marks.append([step, None, self._mark()])  # its plan: set once before_step decided
        while len(self._marks) >= 2:
            (s0, plan, a), (_, _, b) = self._marks[0], self._marks[1]
            dt = self._elapsed(a, b)
            if dt is None:
                break
            self._marks.pop(0)
            self.observe(s0, plan, dt)
        del self._marks[:-8]  # an unread event more than a few steps back is dropped

    def observe(self, step: int, plan, seconds: float) -> None:
        """A measured step: `seconds` for step `step`, run under `plan`. The Planner times steps
        itself (`_time_steps`); a caller with a better clock may feed them here instead."""
        if plan is None or step <= 1:
            return  # the first step warms up (allocations, first kernels): never compared
        self.step_times.append((step, seconds))
        del self.step_times[:-64]
        if self.explorer is not None and step >= self.explorer.start_step:
            self.explorer.observe(plan, seconds, step)
        elif self._settling is not None and step > self._explored_step and explore.key(plan) == self._settling[1]:
            self._settling[2].append(seconds)

    def _explore(self, step: int, at: Optional[int] = None) -> None:
        """Start, advance or end an exploration; the plan for the next update is set here.
        `at`: the step a plan set now runs (default `step`: at before_step it runs this step's
        update; at after_step, the next step). Each candidate's samples are the steps scheduled
        for it (Explorer.next_plan(step=)): not the step before the exploration (the plan in
        force: a third sample whose least beat the others' two, explore-overlap-3b 2026-12-04),
        nor steps that wait for late measurements under the last candidate, whose own second
        step the exploration waits for."""
        at = step if at is None else at
        ex = self.explorer
        if ex is None:
            if self._explored:
                # The reference rates: those once the kept plan ran SETTLE steps (the rates of the
                # lanes it runs move to it first); explore again once they drift.
                if self._explored_calib is None:
                    if step - self._explored_step >= explore.SETTLE:
                        self._explored_calib = self.calibration
                        if self.explorations:  # the kept plan under the rates fitted in situ
                            self.explorations[-1]["refined_predicted_s"] = round(perfmodel.predict(
                                self.plan, self.calibration, head_start_s=self.head_start_s,
                                **self._bytes).total_s, 6)
                        self._settle_cost()
                    return
                if (step - self._explored_step < explore.COOLDOWN
                        or refine.drift(self._explored_calib, self.calibration) <= explore.EXPLORE_DRIFT):
                    return
            elif step < 2:
                return  # the first step runs the model's choice and warms up
            ex = self.explorer = explore.Explorer(
                explore.anchors(self.plan, self.calibration, **self._explore_kw()),
                start_step=at, steps_per=explore.STEPS_PER,
                max_steps=explore.MAX_STEPS)
            if len(ex.candidates) < 2:
                self.explorer = None
                self._explored, self._explored_calib, self._explored_step = True, None, step
                return
        nxt = ex.next_plan(at)
        if nxt is None and ex.stage == 1:  # the anchors ran: rank the rest by the rates fitted on them
            ex.extend(explore.refined(ex, self.plan, self.calibration, **self._explore_kw()))
            nxt = ex.next_plan(at)
        if nxt is not None:
            if explore.key(nxt) != explore.key(self.plan):
                self.set_plan(nxt.replace(source="explore"), step)
            return
        late = step - ex.start_step >= ex.length + explore.MAX_LAG
        if not ex.finished and not late:
            return  # the last measurements are still on their way: keep the plan
        if ex.times:  # (late: the fastest of those measured; none: keep the plan)
            best, _ = ex.best()
            # kept (logged also when it is the plan running): with its prediction under the profile
            # as loaded, which the run's record calls offline (a second-stage candidate was ranked
            # under rates refitted in situ)
            offline = perfmodel.predict(best, self._searched_from, head_start_s=self.head_start_s,
                                        **self._bytes).total_s
            self.set_plan(best.replace(source="explored", predicted_step_s=offline), step)
        self.explore_steps += ex.steps
        self.explore_s += ex.cost_s()
        self.explorations.append(dict(ex.to_record(), end_step=step))
        self._settling = (ex, explore.key(self.plan), []) if ex.times else None
        self.explorer = None
        self._explored, self._explored_calib, self._explored_step = True, None, step

    def _settle_cost(self) -> None:
        """The last exploration's cost against the kept plan's median step since it ended (`kept_s`
        in its record), once that plan ran SETTLE steps: until then `explore_s` counts against the
        least of its exploration steps, which charges every step's noise above that minimum (the
        kept plan's steps in planner-3b ran a median 0.92 s after its exploration, 0.84 s at the
        least of two before; docs/DESIGN.md §10). Only steps after the one that switched to it, and
        only under it, count (a re-plan meanwhile: its steps do not); none of them: the upper bound
        stays."""
        settling, self._settling = self._settling, None
        if settling is None or not settling[2] or not self.explorations:
            return
        ex, _, times = settling
        kept_s = statistics.median(times)
        rec = self.explorations[-1]
        cost = ex.cost_s(kept_s)
        self.explore_s += cost - ex.cost_s()
        rec.update(explore_s=round(cost, 6), kept_s=round(kept_s, 6), kept_steps=len(times),
                   explore_s_least=rec["explore_s"])

    def _explore_kw(self) -> dict:
        """What ranks an exploration's candidates besides the plan and rates: the slots allocated,
        the threads, the head start and the bytes moved."""
        return dict(staging_slots=len(self._dev.slots), max_threads=self.max_threads,
                    head_start_s=self.head_start_s, **self._bytes)

    # -- decisions -----------------------------------------------------------------------------
    @property
    def _previous_plan(self):
        """The plan the step before the one under way ran (the spans `totals()` reads)."""
        return self._prev_step_plan

    def _refine(self, step: int, ran=None) -> None:
        """Online refinement: the last step's lane times move the calibrated rates; a plan
        predicted >5% faster (same resident share and slots: nothing on the GPU is reallocated)
        replaces the current one. Safe at this point: gradients routed by the old plan are
        re-sent by `GradRouter.flush` where the new one puts them on the CPU."""
        totals = self._tl.totals()
        if not totals:
            return
        self.calibration = refine.update(self.calibration, ran or self.plan, totals,
                                         split_cpu=self.exploring, **self._bytes)
        if self.exploring:
            return  # the plan is chosen by measurement (_explore); the rates rank its candidates
        # The search runs on the host, in the CPU lane's path: search again only once the rates
        # (or the head start) moved; they settle within a few steps (docs/DESIGN.md §10).
        h, h_searched = self.head_start_s, self._searched_head_start
        if (refine.drift(self._searched, self.calibration) < REPLAN_DRIFT
                and abs(h - h_searched) <= REPLAN_DRIFT * max(h, h_searched)):
            return
        self._searched, self._searched_head_start = self.calibration, h
        better = refine.replan(self.plan, self.calibration, staging_slots=len(self._dev.slots),
                               max_threads=self.max_threads, head_start_s=h, **self._bytes)
        if better is not None:
            self.set_plan(better[0].replace(source="replan"), step)

    def _size_resident(self, step: int) -> None:
        """gpu_fraction="auto", at the first step: the performance model's plan for the GPU memory
        left free at the peak of the iteration just run (resident share, staging slots, stride
        where it is "auto", threads); the new resident subgroups move to the GPU and their host
        blocks are released. Runs once, outside the steady-state loop (it synchronizes)."""
        free = free_device_bytes(self._dev)
        plan = None if free is None else self._sized_plan(free)
        if plan is None:
            return  # nothing of that shape fits (or no peak to size by): keep the plan
        self._sync.synchronize()  # no copy still reads a slot or a host block given up below
        self._lanes.keep_slots(plan.staging_slots if plan.staged_order else 0)
        self.materialize(plan.resident)
        for s in plan.resident:
            if s not in self._dev.resident:
                self._dev.add_resident(s, self._host.state[s], self.layout.subgroups[s].numel)
                self._host.release(s)
        self.set_plan(plan, step, free_gpu_bytes=free)

    def _sized_plan(self, free: float) -> Optional[Plan]:
        """The plan for `free` GPU bytes, with its source: the performance model's choice under
        the config's placement and stride ("perfmodel"), or without a calibration as many resident
        subgroups as fit ("memory", perfmodel.fill_resident); None when nothing of that shape fits."""
        cfg = self.config
        if self.calibration is None:
            plan = perfmodel.fill_resident(self.plan, free, staging_slots=len(self._dev.slots),
                                           subgroup_numel=self.layout.subgroup_numel,
                                           grad_bytes=self._bytes["grad_bytes"])
            return None if plan is None else plan.replace(source="memory")
        if cfg.placement == "static":
            staged_shares = [Fraction(0)]
        else:
            staged_shares = None if cfg.stride == "auto" else [Fraction(1, cfg.stride)]
        try:
            plan, _ = perfmodel.choose(
                self.plan.numels, self.calibration, free_gpu_bytes=free, max_threads=self.max_threads,
                staging_slots=len(self._dev.slots), subgroup_numel=self.layout.subgroup_numel,
                placement=cfg.placement, staged_shares=staged_shares, state_dtype=cfg.state_dtype,
                **self._bytes)
        except ValueError:
            return None
        return plan.replace(source="perfmodel")

    @property
    def deferred_host(self) -> bool:
        """Resident-first: the host arena is not written nor pinned yet (dos.residency)."""
        return self.residency.deferred

    def materialize(self, resident=()) -> None:
        """Resident-first: make the state real once the resident share is known (dos.residency)."""
        self.residency.materialize(self._dev, self._host, self._lanes.grads, resident)

    def host_need_bound(self, blocks: dict) -> int:
        return self.residency.host_need_bound(blocks)

    def set_plan(self, plan: Plan, step: int, free_gpu_bytes: Optional[float] = None) -> None:
        """Put `plan` in force from the next update on, and log it. A new plan may move subgroups
        between the CPU and staged lanes only: the resident ones and the slots are allocated."""
        if (plan.resident != tuple(sorted(self._dev.resident))
                or plan.staging_slots > len(self._dev.slots)):
            raise ValueError("a new plan may move subgroups between the CPU and staged lanes only")
        self.plan = plan
        self._lanes.set_plan(plan)
        entry = {"step": step, "plan": plan.to_record(), "predicted_step_s": plan.predicted_step_s}
        if free_gpu_bytes is not None:
            entry["free_gpu_gib"] = round(free_gpu_bytes / 2**30, 3)
        self.replans.append(entry)

    def calibration_record(self) -> dict:
        """Which profile the plans rest on, for a job of several ranks on this host: measured with
        them all running, derated from a 1-rank one (and why), or none."""
        c = self._searched_from
        out = {"local_ranks": self.local_ranks, "source": c.source if c is not None else None,
               "profile_local_ranks": c.local_ranks if c is not None else None}
        if c is not None and c.source == "derated":
            out["note"] = c.warnings[-1]
        return out

    def record(self, last_overlapped: int) -> dict:
        """What online planning did: each re-plan (step, stride, shares, threads, prediction), the
        head start it last planned with (overlap_backward) and the explorations (§9.6): steps
        spent, seconds spent beyond the kept plan, each candidate's prediction and measurement."""
        keep = ("stride", "staged_share", "resident_fraction", "cpu_threads", "staging_slots", "source")
        return {"head_start_s": round(self.head_start_s, 6), "last_overlapped": last_overlapped,
                "exploring": self.exploring, "explore_steps": self.explore_steps,
                "explore_s": round(self.explore_s, 6), "explorations": list(self.explorations),
                "replans": [dict({k: e["plan"].get(k) for k in keep}, step=e["step"],
                                 predicted_step_s=e["predicted_step_s"],
                                 **({"free_gpu_gib": e["free_gpu_gib"]} if "free_gpu_gib" in e else {}))
                            for e in self.replans]}


def _explores(device: torch.device) -> bool:
    """Whether stride="auto" explores its candidates on this device: CUDA parameters, unless
    DOS_EXPLORE=0. On by default since planner-3b (docs/DESIGN.md §10): exploring, auto ran 0.892
    s/iter (median of 3) where the offline model's own choice, all-CPU, ran 1.235 s. (CPU
    parameters have no staged lane worth timing; tests switch it on.)"""
    return device.type == "cuda" and os.environ.get("DOS_EXPLORE", "1") != "0"


def _calibration(device: torch.device, local_ranks: int = 1):
    """This machine's cached calibration (`python -m dos calibrate`), for CUDA parameters; with
    several ranks on this host, the profile measured with that many running, else the 1-rank one
    derated (`calibrate.load_or_none`)."""
    if device.type != "cuda" or os.environ.get("DOS_NO_CALIBRATION"):
        return None
    from .calibrate import load_or_none

    return load_or_none(local_ranks)


def _sizes_by_memory(device: torch.device) -> bool:
    """gpu_fraction="auto" without a calibration still sizes the resident share, by memory alone:
    on a CUDA device, where the first iteration's peak says what is free."""
    return device.type == "cuda"


def free_device_bytes(dev) -> Optional[float]:
    """GPU memory the optimizer may still take for the rest of the run: what the iteration's peak
    (the allocator's reservation) left free under the process's cap and on the device, minus a
    margin, plus what its staging slots and scratch hold now (a new plan may spend it otherwise).
    None on a CPU device."""
    device = dev.scratch.device
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)
    cap = total * get_fraction(device)
    peak, now = torch.cuda.max_memory_reserved(device), torch.cuda.memory_reserved(device)
    free_now, _ = torch.cuda.mem_get_info(device)
    headroom = min(cap - peak, free_now - (peak - now))
    margin = max(2**30, 0.03 * cap)
    return max(0.0, headroom - margin) + dev.transient_bytes
