"""PURE: subgroups + placement settings -> Plan. The Plan carries every decision of a step.

Each subgroup gets one lane:
- ``cpu``: state in pinned host memory, updated by the CPU; its gradient leaves the GPU as soon as
  it is complete in backward, its updated weights go back in the param dtype.
- ``staged``: state in host memory, prefetched into a GPU staging slot, updated by fused GPU Adam
  and flushed back, while the CPU updates its own subgroups (Deep Optimizer States).
- ``resident``: state lives on the GPU and is updated in place (TwinFlow's static share; "gpu").
The engine executes the Plan without branching on the placement name.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Optional, Tuple

from .partition import Layout

CPU, STAGED, RESIDENT = "cpu", "staged", "resident"
LANES = (CPU, STAGED, RESIDENT)
STATE_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq per element (a staged copy moves it each way);
# other state formats: state_bytes(plan) (dos/state_format.py)

# Until the performance model chooses it, "auto" streams every 2nd non-resident subgroup through
# the GPU: on the H200 host PCIe duplex (~4 G params/s at 12 B each way) and CPU Adam (2-4 G/s)
# are of the same order (DESIGN.md §8).
AUTO_STRIDE = 2


@dataclass(frozen=True)
class Plan:
    """Placement and order of every subgroup, and the resources of the update phase."""

    placement: str
    """The user's placement setting this plan was made from (a label; never branched on)."""
    stride: Optional[int]
    """Update stride k of the staged lane (None when nothing is staged by stride)."""
    lanes: Tuple[str, ...]
    """Lane of each subgroup, indexed like `Layout.subgroups`."""
    numels: Tuple[int, ...]
    """Elements of each subgroup (the plan is self-contained for the performance model)."""
    cpu_order: Tuple[int, ...]
    """CPU-lane subgroups in the order the CPU updates them (gradients ready first go first)."""
    staged_order: Tuple[int, ...]
    """Staged subgroups in the order they are prefetched and updated on the GPU."""
    cpu_threads: int
    """Threads of the CPU lane."""
    staging_slots: int
    """GPU staging buffers of the staged lane (0 when nothing is staged)."""
    predicted_step_s: Optional[float] = None
    """Update-phase time the performance model predicts for this plan (None: not modelled)."""
    source: str = "config"
    """Who made it: "config" (placement and stride as given), "rule" (stride="auto" without a
    calibration: AUTO_STRIDE), "perfmodel" (stride="auto": the model's choice), "memory"
    (gpu_fraction="auto" without a calibration: the resident share that fits), "replan",
    "explore" / "explored" (tried / kept by exploration)."""
    state_dtype: str = "fp32"
    """The moments' storage (dos/state_format.py): the bytes every copy and the host memory move."""

    def __post_init__(self):
        if len(self.numels) != len(self.lanes):
            raise ValueError("numels and lanes must have one entry per subgroup")
        bad = [x for x in self.lanes if x not in LANES]
        if bad:
            raise ValueError(f"unknown lanes {sorted(set(bad))}")
        if sorted(self.cpu_order) != [i for i, x in enumerate(self.lanes) if x == CPU]:
            raise ValueError("cpu_order must list every cpu subgroup once")
        if sorted(self.staged_order) != [i for i, x in enumerate(self.lanes) if x == STAGED]:
            raise ValueError("staged_order must list every staged subgroup once")
        if self.staged_order and self.staging_slots < 1:
            raise ValueError("a plan with staged subgroups needs staging_slots >= 1")

    @property
    def resident(self) -> Tuple[int, ...]:
        return tuple(i for i, x in enumerate(self.lanes) if x == RESIDENT)

    def share(self, lane: str) -> float:
        """Fraction of all elements whose subgroups are on `lane`."""
        total = sum(self.numels) or 1
        return sum(n for n, x in zip(self.numels, self.lanes) if x == lane) / total

    def numel(self, lane: str) -> int:
        return sum(n for n, x in zip(self.numels, self.lanes) if x == lane)

    def to_record(self) -> dict:
        return {
            "placement": self.placement,
            "stride": self.stride,
            "n_subgroups": len(self.lanes),
            "subgroup_numel": max(self.numels, default=0),
            "resident_fraction": round(self.share(RESIDENT), 6),
            "gpu_share": round(self.share(STAGED) + self.share(RESIDENT), 6),
            "staged_share": round(self.share(STAGED), 6),
            "cpu_threads": self.cpu_threads,
            "staging_slots": self.staging_slots,
            "predicted_step_s": self.predicted_step_s,
            "source": self.source,
            "state_dtype": self.state_dtype,
            "lanes": "".join(x[0] for x in self.lanes),
            "cpu_order": list(self.cpu_order),
            "staged_order": list(self.staged_order),
        }

    def replace(self, **kw) -> "Plan":
        return dataclasses.replace(self, **kw)

    def __str__(self) -> str:
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if k != "lanes"})


def resident_subgroups(layout: Layout, fraction: float) -> Tuple[int, ...]:
    """The first subgroups in flat order, holding as close to `fraction` of the elements as whole
    subgroups allow. Their gradients finish last in backward (embedding side), so they are the
    ones that gain least from leaving the GPU early."""
    if fraction <= 0:
        return ()
    target, acc, chosen = fraction * layout.numel, 0, []
    for s in layout.subgroups:
        if acc + s.numel / 2 > target:
            break
        chosen.append(s.index)
        acc += s.numel
    return tuple(chosen)


def make_plan(layout: Layout, *, placement: str, stride, gpu_fraction: float, cpu_threads: int,
              staging_slots: int, state_dtype: str = "fp32") -> Plan:
    """The plan a placement setting asks for. `stride="auto"` uses AUTO_STRIDE."""
    n = len(layout.subgroups)
    if placement == "gpu":
        resident = tuple(range(n))
    elif placement == "cpu":
        resident = ()
    else:
        resident = resident_subgroups(layout, gpu_fraction)
    # Candidates for the CPU and staged lanes in gradient-ready order: backward produces the last
    # parameters' gradients first.
    rest = [i for i in reversed(range(n)) if i not in set(resident)]
    k = None
    if placement == "interleaved":
        k = AUTO_STRIDE if stride == "auto" else int(stride)
        staged = [i for pos, i in enumerate(rest) if (pos + 1) % k == 0]
    else:
        staged = []
    staged_set = set(staged)
    lanes = tuple(RESIDENT if i in set(resident) else STAGED if i in staged_set else CPU for i in range(n))
    return Plan(placement=placement, stride=k, lanes=lanes,
                source="rule" if stride == "auto" and k else "config",
                numels=tuple(s.numel for s in layout.subgroups),
                cpu_order=tuple(i for i in rest if i not in staged_set),
                staged_order=tuple(staged), cpu_threads=cpu_threads,
                staging_slots=min(staging_slots, len(staged)) if staged else 0, state_dtype=state_dtype)




def state_bytes(plan: Plan) -> float:
    """Bytes of optimizer state per element of `plan`'s format (a staged copy moves them each way)."""
    from .state_format import state_format
    return state_format(plan.state_dtype).bytes_per_element
