"""PURE: the performance model of the update phase. A Calibration (this machine's rates) and a Plan
give predicted lane times; `choose` searches the best Plan (online refinement: dos/refine.py).

Units: update rates in elements/s, copies in bytes/s, times in seconds. One update phase, as
dos/lanes.py runs it (n_j: elements of subgroup j; S: staging slots; t: CPU threads):

  resident  t_res = N_res / R_gpu, first on the compute stream.
  staged    a 3-stage pipeline over `staged_order`, one stream per stage, S slots:
              H_j = max(H_{j-1}, D_{j-S}) + 12 n_j / B_h2d     (a slot is refilled once written back)
              G_j = max(G_{j-1}, H_j)     + n_j / R_gpu        (G_{-1} = t_res)
              D_j = max(D_{j-1}, G_j)     + 12 n_j / B_d2h
            its span P = D_last (the last write-back is inside). Copies run at the duplex rates:
            in a pipeline both directions are busy nearly all the time.
  overlap   while the CPU lane and the staged copies both run they slow each other down (host DRAM):
            the CPU updates at R_cpu_dma(t), the copies move at B_h2d_cpu(t) - u and B_d2h_cpu(t),
            u = param_bytes * R_cpu_dma(t) being the uploads of CPU-updated weights, which share the
            H2D direction. Whichever finishes first, the other does the rest of its work alone
            ("fluid" model): with Pc, Pu the pipeline spans at contended / alone copy rates and
            Cc = N_cpu / R_cpu_dma(t),
              Cc >= Pc:  T_staged = Pc,  T_cpu = Pc + (N_cpu - Pc R_cpu_dma) / R_cpu
              Cc <  Pc:  T_cpu = Cc,     T_staged = Cc + (1 - Cc / Pc) Pu
  head start  with the CPU lane overlapped with backward (`overlap_backward`), it has had H
            seconds when `step()` starts (measured then, from its first update; `refine.head_start`):
            min(N_cpu - n_last, R_cpu(t - 1) H) elements are done (one core is left to
            backward; the last CPU subgroup's gradient is the last to arrive), and only the rest
            enters the overlap above and the H2D bound (the GPU lanes start at once; the
            worker's backlog overlaps them).
  tail      the last CPU subgroup's upload, param_bytes n_last / B_h2d, after T_cpu.
  total     max(T_cpu + tail, T_staged, t_gpu, H2D bytes / B_h2d, D2H bytes / B_d2h); the last
            two are lower bounds at the alone rates. Gradient D2H of CPU subgroups runs during
            backward and is reported, not counted.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple

from .plan import CPU, RESIDENT, STAGED, STATE_BYTES, Plan, state_bytes

SCRATCH_BYTES = 4  # fp32 widening buffer of a low-precision gradient, per subgroup element
MAX_STRIDE = 16
THREAD_MARGIN = 0.05  # a plan with fewer CPU threads must be predicted this much faster


@dataclass(frozen=True)
class Calibration:
    """Measured rates of one machine (dos/calibrate.py). GPU fields are None on a CPU-only machine."""

    cpu_threads: Tuple[int, ...]
    """Thread counts the CPU rates were measured at, ascending."""
    cpu_rate: Tuple[float, ...]
    """CPU AdamW (bf16 grad in, fp32 state, bf16 weights out), elements/s, per thread count, alone."""
    cpu_rate_dma: Optional[Tuple[float, ...]] = None
    """The same while pinned duplex H2D+D2H copies run (host DRAM contention)."""
    h2d_bw_cpu: Optional[Tuple[float, ...]] = None
    """Pinned H2D bytes/s in duplex while CPU AdamW runs with that many threads."""
    d2h_bw_cpu: Optional[Tuple[float, ...]] = None
    """Pinned D2H bytes/s in duplex while CPU AdamW runs with that many threads."""
    gpu_rate: Optional[float] = None
    """Fused GPU AdamW with bf16 grad widening and the cast to bf16 weights, elements/s."""
    h2d_bw: Optional[float] = None
    """Pinned H2D bytes/s, alone."""
    d2h_bw: Optional[float] = None
    """Pinned D2H bytes/s, alone."""
    h2d_duplex_bw: Optional[float] = None
    """Pinned H2D bytes/s while D2H runs too."""
    d2h_duplex_bw: Optional[float] = None
    """Pinned D2H bytes/s while H2D runs too."""
    host_mem_bw: Optional[float] = None
    """Peak host-memory traffic, bytes/s, the update phase can move (CPU AdamW and the copies
    share DRAM; docs/DESIGN.md §9.3): the most the calibration saw combined. None: no cap."""
    cpu_rate_spread: Optional[Tuple[float, ...]] = None
    """(max - min) / median of the repeated CPU AdamW measurements, per thread count."""
    warnings: Tuple[str, ...] = ()
    """What looked wrong when measured (a non-monotone or noisy profile)."""
    gpu_name: Optional[str] = None
    """torch.cuda.get_device_name (None: no GPU). Part of the machine key."""
    cpu_model: str = ""
    """CPU model name (/proc/cpuinfo). Part of the machine key."""
    torch_version: str = ""
    """torch.__version__. Part of the machine key."""
    cpu_impl: str = ""
    """CPU AdamW implementation measured (dos.adam.cpu_impl())."""
    host_cores: int = 0
    """Cores this process could use when measured."""
    created: str = ""
    """When it was measured (ISO 8601)."""
    source: str = "measured"
    """'measured' | 'refined' (by online updates) | 'assumed' (numbers from DESIGN.md) | 'derated'
    (a 1-rank profile scaled to several local ranks, `hostshare.derate`)."""
    local_ranks: int = 1
    """Processes of one job sharing this host (its DRAM, PCIe root ports, cores) the rates are
    for: measured with all of them running (`hostshare`), each rate the slowest rank's, each rank
    on its share of the cores. Part of the machine key when > 1."""
    per_rank: Optional[Tuple[dict, ...]] = dataclasses.field(default=None, hash=False)
    """local_ranks > 1, measured: each rank's own rates (JSON values: lists, floats, None)."""

    def __post_init__(self):
        if not (isinstance(self.local_ranks, int) and self.local_ranks >= 1):
            raise ValueError(f"local_ranks must be an int >= 1, got {self.local_ranks!r}")
        n = len(self.cpu_threads)
        if n == 0 or list(self.cpu_threads) != sorted(set(self.cpu_threads)) or self.cpu_threads[0] < 1:
            raise ValueError(f"cpu_threads must be ascending distinct counts >= 1, got {self.cpu_threads}")
        for name in ("cpu_rate", "cpu_rate_dma", "h2d_bw_cpu", "d2h_bw_cpu"):
            v = getattr(self, name)
            if v is not None and (len(v) != n or min(v) <= 0):
                raise ValueError(f"{name} needs {n} positive values (one per thread count), got {v}")
        for name in ("gpu_rate", "h2d_bw", "d2h_bw", "h2d_duplex_bw", "d2h_duplex_bw", "host_mem_bw"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be positive or None, got {v}")

    @property
    def has_gpu(self) -> bool:
        return None not in (self.gpu_rate, self.h2d_bw, self.d2h_bw, self.h2d_duplex_bw, self.d2h_duplex_bw)

    @property
    def key(self) -> str:
        return machine_key(self.gpu_name, self.cpu_model, self.torch_version, self.local_ranks)

    # Rates against the thread count are read through a monotone envelope: more CPU threads never
    # update slower and never copy faster. Single calibration points are noisy (docs/DESIGN.md
    # §10), and a dip would make the planner pick it.
    def cpu(self, threads: int, dma: bool = False) -> float:
        """CPU AdamW elements/s at `threads` (alone, or while duplex DMA runs)."""
        ys = self.cpu_rate_dma if dma and self.cpu_rate_dma is not None else self.cpu_rate
        return _interp(self.cpu_threads, _running(ys, max), threads)

    def h2d_cpu(self, threads: int) -> float:
        """Duplex H2D bytes/s while the CPU lane runs with `threads`."""
        ys = self.h2d_bw_cpu
        return _interp(self.cpu_threads, _running(ys, min), threads) if ys is not None else self.h2d_duplex_bw

    def d2h_cpu(self, threads: int) -> float:
        ys = self.d2h_bw_cpu
        return _interp(self.cpu_threads, _running(ys, min), threads) if ys is not None else self.d2h_duplex_bw

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        if self.local_ranks == 1 and self.per_rank is None:  # a 1-rank profile: the format of before
            del d["local_ranks"], d["per_rank"]
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        d = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names}
        return cls(**d)


# CPU-lane speed of a state format relative to the fp32 kernel the calibration timed, where the lane
# is bound by host memory: bytes per element moved (state read and written, gradient in, weights out)
# 2*12+2+2 = 28 for fp32 against 2*8+2+2 = 20 with bf16 moments. int8's decode/encode costs compute
# (0.62x fp32 on one core): 1.0 until measured (DESIGN.md §10). bf16-split writes no separate weights:
# 18 B (its kernel ran 1.43x fp32 at 16 threads on the H200 host; 28/18 = 1.56 is the bytes bound).
CPU_FORMAT_SPEEDUP = {"fp32": 1.0, "bf16": 28 / 20, "int8": 1.0, "bf16-split": 28 / 18}

def host_traffic_peak(calib: Calibration, grad_bytes: int = 2, param_bytes: int = 2) -> Optional[float]:
    """The most host-memory bytes/s the calibration saw moved (docs/DESIGN.md §9.3): over thread
    counts, CPU AdamW (24 B of state read and written, the gradient in, the weights out per
    element) alone and beside the duplex copies, and the duplex copies alone."""
    per = 2 * STATE_BYTES + grad_bytes + param_bytes
    seen = [per * r for r in calib.cpu_rate]
    if calib.cpu_rate_dma is not None and calib.h2d_bw_cpu is not None and calib.d2h_bw_cpu is not None:
        seen += [per * r + h + d for r, h, d in zip(calib.cpu_rate_dma, calib.h2d_bw_cpu, calib.d2h_bw_cpu)]
    if calib.h2d_duplex_bw and calib.d2h_duplex_bw:
        seen.append(calib.h2d_duplex_bw + calib.d2h_duplex_bw)
    return max(seen) if seen else None


def machine_key(gpu_name: Optional[str], cpu_model: str, torch_version: str, local_ranks: int = 1) -> str:
    """File-name-safe key of a machine profile: GPU, CPU model, torch version, and the local ranks
    sharing the host when more than one (a 1-rank profile keeps its key of before)."""
    parts = (gpu_name or "nogpu", cpu_model or "cpu", "torch" + torch_version)
    key = "__".join(re.sub(r"[^A-Za-z0-9.]+", "-", p).strip("-") for p in parts)
    return key + (f"__{local_ranks}ranks" if local_ranks > 1 else "")


def _running(ys: Sequence[float], f) -> List[float]:
    """Running max (f=max) or min (f=min) of `ys`: the monotone envelope of a noisy curve."""
    out: List[float] = []
    for y in ys:
        out.append(y if not out else f(out[-1], y))
    return out


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear in the thread count, flat beyond the measured ones."""
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


# DESIGN.md §8 (H200 host, 16 cores). Counts other than 8 and 16 are scaled guesses: a prior, and
# the test fixture of a realistic machine; real runs use a measured profile.
DESIGN_H200 = Calibration(
    cpu_threads=(1, 2, 4, 8, 16),
    cpu_rate=(0.36e9, 0.72e9, 1.4e9, 2.65e9, 4.1e9),
    cpu_rate_dma=(0.3e9, 0.55e9, 1.0e9, 1.74e9, 2.9e9),
    h2d_bw_cpu=(49e9, 48e9, 45e9, 40e9, 36e9),
    d2h_bw_cpu=(50e9, 50e9, 50e9, 50e9, 50e9),
    gpu_rate=121e9, h2d_bw=55.4e9, d2h_bw=55.3e9, h2d_duplex_bw=50e9, d2h_duplex_bw=50e9,
    gpu_name="NVIDIA H200", cpu_model="16-core Xeon (DESIGN.md)", torch_version="2.11",
    host_cores=16, source="assumed")


@dataclass(frozen=True)
class Prediction:
    """Predicted update phase of one Plan (seconds from the start of `step()`)."""

    cpu_s: float
    """CPU lane busy time (contention included)."""
    h2d_s: float
    """Staged prefetch copies, busy time."""
    d2h_s: float
    """Staged write-back copies, busy time."""
    gpu_s: float
    """Compute stream busy time: resident and staged updates."""
    upload_s: float
    """Uploads of CPU-updated weights, busy time at the alone H2D rate."""
    staged_s: float
    """End of the staged lane (its last D2H)."""
    cpu_end_s: float
    """End of the CPU lane, its last upload included."""
    grad_d2h_s: float
    """Gradient D2H of CPU subgroups (overlapped with backward; not in total_s)."""
    total_s: float
    """The update phase: the latest lane end, or a copy direction's / host memory's lower bound."""
    bottleneck: str
    """'cpu' | 'h2d' | 'gpu' | 'd2h' | 'host_mem' | 'none': what bounds total_s."""


@dataclass(frozen=True)
class Pipe:
    span: float
    h2d: float
    gpu: float
    d2h: float


def pipeline(numels: Sequence[int], slots: int, h2d_bw: float, d2h_bw: float, gpu_rate: float,
             gpu_start: float = 0.0, sb: float = STATE_BYTES) -> Pipe:
    """The staged lane: H2D -> GPU update -> D2H per subgroup, `slots` subgroups in flight;
    `sb` state bytes per element."""
    h_end, g_end, d_ends = 0.0, gpu_start, []
    h2d = gpu = d2h = 0.0
    for j, n in enumerate(numels):
        h, g, d = sb * n / h2d_bw, n / gpu_rate, sb * n / d2h_bw
        slot_free = d_ends[j - slots] if j >= slots else 0.0
        h_end = max(h_end, slot_free) + h
        g_end = max(g_end, h_end) + g
        d_ends.append(max(d_ends[-1] if d_ends else 0.0, g_end) + d)
        h2d, gpu, d2h = h2d + h, gpu + g, d2h + d
    return Pipe(d_ends[-1] if d_ends else 0.0, h2d, gpu, d2h)


def overlap(cpu_work: float, r_alone: float, r_dma: float, p_dma: float, p_alone: float):
    """Fluid overlap of the CPU lane and the staged copies -> (T_cpu, T_staged, share of the
    staged lane that ran under contention)."""
    if cpu_work <= 0:
        return 0.0, p_alone, 0.0
    if p_dma <= 0:
        return cpu_work / r_alone, 0.0, 0.0
    c_dma = cpu_work / r_dma
    if c_dma >= p_dma:
        return p_dma + (cpu_work - p_dma * r_dma) / r_alone, p_dma, 1.0
    frac = c_dma / p_dma
    return c_dma, c_dma + (1 - frac) * p_alone, frac


def head_start_work(plan: Plan, calib: Calibration, head_start_s: float) -> float:
    """CPU-lane elements done during the last `head_start_s` seconds of backward (see above)."""
    if head_start_s <= 0 or not plan.cpu_order:
        return 0.0
    rest = plan.numel(CPU) - plan.numels[plan.cpu_order[-1]]
    return min(rest, calib.cpu(max(1, plan.cpu_threads - 1)) * head_start_s)


def predict(plan: Plan, calib: Calibration, *, grad_bytes: int = 2, param_bytes: int = 2,
            head_start_s: float = 0.0) -> Prediction:
    """Predicted lane times of `plan` on the machine `calib` describes (see the module docstring).
    `head_start_s`: backward time the CPU lane overlaps (`overlap_backward`; 0: none); the CPU
    lane's times are then what is left for `step()`."""
    n_res = plan.numel(RESIDENT)
    n_cpu = plan.numel(CPU) - head_start_work(plan, calib, head_start_s)
    staged = [plan.numels[s] for s in plan.staged_order]
    if (staged or n_res) and not calib.has_gpu:
        raise ValueError("the plan updates on the GPU but the calibration has no GPU rates")
    t, sb = plan.cpu_threads, state_bytes(plan)
    # The calibration timed the fp32 kernel. Another state format moves fewer bytes per element;
    # where the CPU lane is bound by host memory (16 threads on the H200 host) its rate scales with
    # the traffic: CPU_FORMAT_SPEEDUP (an assumption until measured in situ: DESIGN.md §10; the
    # online refinement and the exploration correct it from the lane timelines).
    f = CPU_FORMAT_SPEEDUP.get(plan.state_dtype, 1.0)
    r_alone, r_dma = f * calib.cpu(t), f * calib.cpu(t, dma=True)
    t_res = n_res / calib.gpu_rate if n_res else 0.0
    if staged:
        u = param_bytes * r_dma if n_cpu else 0.0
        h2d_c = max(calib.h2d_cpu(t) - u, 0.1 * calib.h2d_cpu(t))
        p_dma = pipeline(staged, plan.staging_slots, h2d_c, calib.d2h_cpu(t), calib.gpu_rate, t_res, sb)
        p_alone = pipeline(staged, plan.staging_slots, calib.h2d_duplex_bw, calib.d2h_duplex_bw,
                           calib.gpu_rate, t_res, sb)
    else:
        p_dma = p_alone = Pipe(0.0, 0.0, 0.0, 0.0)
    t_cpu, t_staged, frac = overlap(n_cpu, r_alone, r_dma, p_dma.span, p_alone.span)
    h2d = frac * p_dma.h2d + (1 - frac) * p_alone.h2d
    d2h = frac * p_dma.d2h + (1 - frac) * p_alone.d2h
    gpu = t_res + p_alone.gpu
    bw_up = calib.h2d_bw or float("inf")  # no GPU: the CPU writes the weights in place
    bw_down = calib.d2h_bw or float("inf")
    tail = param_bytes * plan.numels[plan.cpu_order[-1]] / bw_up if n_cpu else 0.0
    lanes = {"cpu": t_cpu + tail, "staged": t_staged, "gpu": gpu,
             "h2d": (sb * sum(staged) + param_bytes * n_cpu) / bw_up,
             "d2h": sb * sum(staged) / bw_down}
    if calib.host_mem_bw:  # host DRAM: CPU AdamW's traffic, staged state both ways, uploads
        lanes["host_mem"] = host_bytes(plan, grad_bytes, param_bytes, n_cpu) / calib.host_mem_bw
    total = max(lanes.values())
    return Prediction(cpu_s=t_cpu, h2d_s=h2d, d2h_s=d2h, gpu_s=gpu, upload_s=param_bytes * n_cpu / bw_up,
                      staged_s=t_staged, cpu_end_s=lanes["cpu"],
                      grad_d2h_s=grad_bytes * plan.numel(CPU) / bw_down,
                      total_s=total, bottleneck=_bottleneck(lanes, total, h2d, p_alone.gpu, d2h))


def host_bytes(plan: Plan, grad_bytes: int = 2, param_bytes: int = 2,
               n_cpu: Optional[float] = None) -> float:
    """Host-memory bytes one update phase moves (docs/DESIGN.md §9.3): per CPU element the state
    read and written, the gradient read, the weights written and read again by their upload; per
    staged element the state each way. `n_cpu`: CPU elements left for step() (head start)."""
    n_cpu = plan.numel(CPU) if n_cpu is None else n_cpu
    sb = state_bytes(plan)
    return (2 * sb + grad_bytes + 2 * param_bytes) * n_cpu + 2 * sb * plan.numel(STAGED)


def _bottleneck(lanes: Dict[str, float], total: float, h2d: float, gpu: float, d2h: float) -> str:
    if total <= 0:
        return "none"
    name = max(lanes, key=lambda k: (lanes[k], k == "cpu"))  # ties: the CPU lane
    if name == "staged":
        return max((h2d, "h2d"), (gpu, "gpu"), (d2h, "d2h"))[1]
    return name


# -- choosing a plan ----------------------------------------------------------------------------

def spread(count: int, share: Fraction) -> Tuple[bool, ...]:
    """Which of `count` positions go to the staged lane, spread evenly (Bresenham): position p is
    staged iff floor((p+1) share) > floor(p share). share = 1/k stages every k-th position — exactly
    `make_plan`'s stride k; share = 1 - 1/k puts every k-th position (the first one first) on the CPU."""
    a, b = share.numerator, share.denominator
    return tuple((p + 1) * a // b > p * a // b for p in range(count))


def build_plan(numels: Sequence[int], *, resident: int, staged_share: Fraction, cpu_threads: int,
               staging_slots: int, placement: str = "interleaved", state_dtype: str = "fp32") -> Plan:
    """A Plan with the first `resident` subgroups (flat order, as `plan.resident_subgroups`) resident
    and `staged_share` of the others staged, spread over the gradient-ready order. Memoized (Plans
    are immutable): the online search rebuilds the same candidates every step."""
    return _build_plan(tuple(numels), resident, Fraction(staged_share), cpu_threads, staging_slots,
                       placement, state_dtype)


@functools.lru_cache(maxsize=4096)
def _build_plan(numels: Tuple[int, ...], resident: int, staged_share: Fraction, cpu_threads: int,
                staging_slots: int, placement: str, state_dtype: str) -> Plan:
    n = len(numels)
    rest = [i for i in reversed(range(n)) if i >= resident]  # gradient-ready order, as make_plan
    share = staged_share
    flags = spread(len(rest), share)
    staged = [i for i, f in zip(rest, flags) if f]
    cpu = [i for i, f in zip(rest, flags) if not f]
    lanes = tuple(RESIDENT if i < resident else STAGED if f else CPU
                  for i, f in zip(range(n), [False] * resident + list(flags[::-1])))
    stride = share.denominator if staged and share.numerator == 1 else None
    return Plan(placement=placement, stride=stride, lanes=lanes, numels=tuple(numels),
                cpu_order=tuple(cpu), staged_order=tuple(staged), cpu_threads=cpu_threads,
                staging_slots=min(staging_slots, len(staged)), state_dtype=state_dtype)


def shares(max_stride: int = MAX_STRIDE) -> List[Fraction]:
    """Staged shares searched: all-CPU, 1/k (stride k) and 1 - 1/k (every k-th on the CPU)."""
    out = {Fraction(0)} | {Fraction(1, k) for k in range(1, max_stride + 1)}
    out |= {1 - Fraction(1, k) for k in range(2, max_stride + 1)}
    return sorted(out)


def memory_options(numels: Sequence[int], free_gpu_bytes: float, staging_slots: int,
                   subgroup_numel: int, grad_bytes: int = 2,
                   resident: Optional[int] = None, sb: float = STATE_BYTES) -> List[Tuple[int, int]]:
    """(resident subgroups, staging slots) pairs that fit `free_gpu_bytes`: for each slot count the
    most resident subgroups that fit (or the given `resident`). Resident state costs 12 B/element,
    a slot 12 B x subgroup_numel, and any GPU update of low-precision gradients a 4 B scratch."""
    prefix = [0]
    for n in numels:
        prefix.append(prefix[-1] + sb * n)
    # fp32 scratch: widening a low-precision gradient (4 B), decoding compressed moments (12 B)
    scratch = (SCRATCH_BYTES * (3 if sb < STATE_BYTES else 1) * subgroup_numel
               if grad_bytes < 4 or sb < STATE_BYTES else 0)
    out = set()
    for slots in range(staging_slots + 1):
        fixed = slots * sb * subgroup_numel
        candidates = [resident] if resident is not None else range(len(numels), -1, -1)
        for r in candidates:
            need = fixed + prefix[r] + (scratch if slots or r else 0)
            if need <= free_gpu_bytes:
                out.add((r, slots))
                break
    return sorted(out)


def fill_resident(plan: Plan, free_gpu_bytes: float, *, staging_slots: int, subgroup_numel: int,
                  grad_bytes: int = 2) -> Optional[Plan]:
    """gpu_fraction="auto" without a calibration (no rates to weigh lanes by): the most resident
    subgroups that fit `free_gpu_bytes` beside the staging slots the plan's staged lane uses
    (`staging_slots` allocated), the rest split as `plan` splits them (its stride; all-CPU
    otherwise). A resident subgroup moves nothing and updates on the GPU, so more of them is never
    slower; None when not even the slots fit."""
    from .state_format import state_format

    slots = staging_slots if plan.staged_order else 0
    fits = {s: r for r, s in memory_options(plan.numels, free_gpu_bytes, slots, subgroup_numel, grad_bytes,
                                           sb=state_format(plan.state_dtype).bytes_per_element)}
    r = fits.get(slots)
    if r is None:
        return None
    share = Fraction(1, plan.stride) if plan.stride else Fraction(0)
    return build_plan(plan.numels, resident=r, staged_share=share, cpu_threads=plan.cpu_threads,
                      staging_slots=slots, placement=plan.placement, state_dtype=plan.state_dtype)


def thread_options(calib: Calibration, max_threads: int) -> List[int]:
    return sorted({t for t in calib.cpu_threads if t <= max_threads} | {max_threads})


def choose(numels: Sequence[int], calib: Calibration, *, free_gpu_bytes: float, max_threads: int,
           staging_slots: int = 3, subgroup_numel: Optional[int] = None, grad_bytes: int = 2,
           param_bytes: int = 2, resident: Optional[int] = None,
           placement: str = "interleaved", staged_shares: Optional[Sequence[Fraction]] = None,
           threads: Optional[Sequence[int]] = None, exact_slots: bool = False,
           head_start_s: float = 0.0, state_dtype: str = "fp32") -> Tuple[Plan, Prediction]:
    """The Plan with the least predicted update phase, and its prediction.

    Searches the resident share (as much as `free_gpu_bytes` holds beside each slot count 0..
    `staging_slots`; or exactly `resident` subgroups), the staged share of the rest (`shares()`)
    (or only `staged_shares`: [1/k] for a fixed stride k, [0] for no staged lane) and the CPU
    threads (the calibrated counts up to `max_threads`, or `threads`). `exact_slots`: only plans
    that use all `staging_slots` (or stage nothing) — online, where the slots are allocated already
    and fewer never predicts faster. `head_start_s`: as `predict` (overlap_backward).
    `free_gpu_bytes`: GPU memory
    the optimizer may still take for the whole run (free at the iteration's peak, minus a margin).
    Fewer threads than `max_threads` only for a predicted gain above THREAD_MARGIN: the thread
    dimension is where the calibration is least sure (docs/DESIGN.md §10). Without GPU rates only
    all-CPU plans are considered."""
    numels = tuple(numels)
    sg = subgroup_numel or max(numels, default=0)
    if calib.has_gpu:
        from .state_format import state_format
        memory = memory_options(numels, free_gpu_bytes, staging_slots, sg, grad_bytes, resident,
                                state_format(state_dtype).bytes_per_element)
    else:
        memory = [(0, 0)]
    if exact_slots:
        memory = [(r, slots) for r, slots in memory if slots == staging_slots]
    searched = shares() if staged_shares is None else [Fraction(x) for x in staged_shares]
    threads = (sorted({t for t in threads if t < max_threads} | {max_threads}) if threads
               else thread_options(calib, max_threads))
    best, best_all = None, None  # at max_threads; at any thread count
    for r, slots in memory or [(0, 0)]:
        if r < len(numels) and not slots and 0 not in searched:
            continue  # the staged share asked for needs a staging slot
        for share in (searched if slots and r < len(numels) else [Fraction(0)]):
            for t in threads:
                plan = build_plan(numels, resident=r, staged_share=share, cpu_threads=t,
                                  staging_slots=slots, placement=placement, state_dtype=state_dtype)
                pred = predict(plan, calib, grad_bytes=grad_bytes, param_bytes=param_bytes,
                               head_start_s=head_start_s)
                key = (pred.total_s, -t, -r)
                if best_all is None or key < best_all[0]:
                    best_all = (key, plan, pred)
                if t == threads[-1] and (best is None or key < best[0]):
                    best = (key, plan, pred)
    if best_all is not None and best_all[0][0] < (1 - THREAD_MARGIN) * best[0][0]:
        best = best_all
    if best is None:
        raise ValueError(f"no plan with staged shares {[str(x) for x in searched]} fits "
                         f"{free_gpu_bytes / 2**30:.2f} GiB of free GPU memory")
    _, plan, pred = best
    return plan.replace(predicted_step_s=pred.total_s), pred
