"""Background sampler of GPU (NVML) and host memory, on the same clock as the phase markers.

One thread samples at `hz` (default 100): GPU memory used, GPU and memory-controller utilization,
PCIe traffic each way, host RSS (this process and its children, e.g. SuperOffload's CPU-Adam
worker) and the host's CPU use (`HostCpu`: busy, stolen by the hypervisor, and used by anything
but this process tree), so that a run slowed by its host says so. Times are
`time.perf_counter()` seconds minus the run's `t0`, the clock the timing protocol stamps its phase
markers with, so a trace and its phases line up without conversion.

PCIe: NVML's cumulative byte counters (field values) when the driver has them, differenced per
sample; otherwise `nvmlDeviceGetPcieThroughput`, which averages over ~20 ms per call and so runs in a
second thread and is forward-filled. Without NVML, a driver or a GPU, the GPU columns stay empty and
`summary()["nvml"]` says why; nothing raises.
"""
from __future__ import annotations

import csv
import threading
import time
from typing import Optional

import psutil

COLUMNS = ("t_s", "gpu_mem_used_mib", "gpu_util_pct", "gpu_mem_util_pct", "pcie_tx_mbps",
           "pcie_rx_mbps", "host_rss_mib", "gpu_alloc_mib", "host_cpu_busy_pct", "host_cpu_steal_pct",
           "host_cpu_other_pct", "gpu_sm_mhz", "gpu_power_w", "gpu_clock_events")
"""pcie_tx: GPU -> host (D2H); pcie_rx: host -> GPU (H2D); MB/s = 1e6 bytes per second.
gpu_mem_used is what NVML sees (the caching allocator's reservations: it rarely falls);
gpu_alloc is what PyTorch's tensors hold (torch.cuda.memory_allocated): the rise and fall.
host_cpu_*: % of all the host's logical CPUs since the previous host sample (`HostCpu`).
gpu_sm_mhz, gpu_power_w: the SM clock and the board's power draw; gpu_clock_events: NVML's bitmask
of why the clocks are held below their maximum (`CLOCK_EVENTS`; 0 none, 1 idle), so that a run
slowed by its GPU (a power cap, a thermal slowdown, an application clock) says so: runs of one
configuration on one machine spread up to 36% in forward + backward with no host episode
(headline-3b, torch without offload 0.187-0.255 s/iter, session 20). Columns only ever grow at
the end (older traces have fewer)."""

CLOCK_EVENTS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap",
                0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal",
                0x80: "hw_power_brake", 0x100: "display_clocks"}
"""nvmlClocksEventReasons bits (NVML's nvml.h; "throttle reasons" before driver 535)."""


def clock_event_names(mask: int) -> list:
    """The named reasons in an NVML clock-event bitmask (unknown bits as hex)."""
    names = [n for bit, n in CLOCK_EVENTS.items() if mask & bit]
    rest = mask & ~sum(CLOCK_EVENTS)
    return names + ([hex(rest)] if rest else [])

_MIB = 1 << 20
CHILDREN_S = 1.0
"""The sampler finds the run's child processes (DeepSpeed's workers, a compiler) this often; in
between it reads the ones it knows. Scanning every process at each host sample (20 Hz) held the
GIL the training loop's Python needs (the scan was ~9% of a DeepSpeed run's init profile)."""


def _open_nvml(cuda_index: Optional[int], uuid: Optional[str]):
    """(pynvml module, handle) or raise with the reason NVML cannot be used."""
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    if uuid:
        try:
            return pynvml, pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except pynvml.NVMLError:
            pass
    return pynvml, pynvml.nvmlDeviceGetHandleByIndex(cuda_index or 0)


def _tree_usage(proc: psutil.Process, children: Optional[list] = None) -> tuple:
    """(RSS bytes, CPU seconds) of `proc` and its live children (children reaped already count in
    its children_* times); `children`: the list to use instead of a fresh scan (a scan reads every
    process's /proc entry, holding the GIL most of that time: 1.5 ms with 65 processes)."""
    def cpu(t) -> float:
        return t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)

    rss, cpu_s = proc.memory_info().rss, cpu(proc.cpu_times())
    for child in proc.children(recursive=True) if children is None else children:
        try:
            rss += child.memory_info().rss
            cpu_s += cpu(child.cpu_times())
        except psutil.Error:
            pass
    return rss, cpu_s


class HostCpu:
    """The host's CPU use between two `sample(cpu_s)` calls, in % of all its logical CPUs (from
    /proc/stat through psutil): `busy` (user, system, irq: every process and the kernel), `steal`
    (time the hypervisor ran something else on this VM's CPUs: a neighbour), and `other` = busy
    minus `cpu_s`'s increase (this process tree's CPU seconds): what else ran here (kernel threads
    such as page compaction, other processes). Why: runs of one configuration on one machine
    differed by up to 27% with the same GPU work (planner-deep-3.5b, forward + backward 0.21-0.36 s
    between runs); these columns tell a host episode from the run's own work."""

    def __init__(self, cpu_s: float = 0.0):
        self.prev = self._read(cpu_s)

    @staticmethod
    def _read(cpu_s: float) -> tuple:
        t = psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        steal = getattr(t, "steal", 0.0)
        # guest / guest_nice are inside user / nice on Linux: not added again
        total = (t.user + getattr(t, "nice", 0.0) + t.system + idle + getattr(t, "irq", 0.0)
                 + getattr(t, "softirq", 0.0) + steal)
        return total, idle, steal, cpu_s

    def sample(self, cpu_s: float) -> tuple:
        """(busy %, steal %, other %) since the last call; Nones when no tick passed."""
        cur, (t0, i0, s0, c0) = self._read(cpu_s), self.prev
        dt = cur[0] - t0
        if dt <= 0:
            return None, None, None
        self.prev = cur
        steal = 100.0 * (cur[2] - s0) / dt
        busy = 100.0 * (dt - (cur[1] - i0) - (cur[2] - s0)) / dt
        mine = 100.0 * (cur[3] - c0) / dt  # CPU seconds over all CPUs' seconds (dt sums them)
        return busy, steal, max(0.0, busy - mine)


class Sampler:
    """Samples in a daemon thread between `start()` and `stop()`; `write(path)` saves a CSV."""

    def __init__(self, t0: float, hz: float = 100.0, gpu_index: Optional[int] = None,
                 gpu_uuid: Optional[str] = None, host_every: int = 5):
        self.t0, self.interval, self.host_every = t0, 1.0 / hz, host_every
        self._cuda_index = gpu_index
        self.rows: list = []
        self._stop = threading.Event()
        self._threads: list = []
        self._pcie_latest = (None, None)
        self.nvml_status, self.pcie_source = "absent: no GPU", None
        self._nvml = self._handle = None
        self._refused: set = set()  # NVML readings this GPU refused (`_clocks`)
        if gpu_index is not None or gpu_uuid is not None:
            try:
                self._nvml, self._handle = _open_nvml(gpu_index, gpu_uuid)
                self.nvml_status = "ok"
            except Exception as e:  # library missing, no driver, no device: record, never crash
                self.nvml_status = f"absent: {type(e).__name__}: {e}"

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "Sampler":
        if self._handle is not None:
            self.pcie_source = self._probe_pcie_counters()
            if self.pcie_source is None:
                self.pcie_source = "throughput-20ms"
                self._spawn(self._pcie_loop)
        self._spawn(self._loop)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2.0)
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _spawn(self, fn):
        t = threading.Thread(target=fn, daemon=True, name=f"dos-sampler-{fn.__name__}")
        self._threads.append(t)
        t.start()

    # ------------------------------------------------------------ sampling
    def _probe_pcie_counters(self) -> Optional[str]:
        try:
            self._read_counters()
            return "counters"
        except Exception:
            return None

    def _read_counters(self):
        n = self._nvml
        vals = n.nvmlDeviceGetFieldValues(self._handle, [n.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
                                                         n.NVML_FI_DEV_PCIE_COUNT_RX_BYTES])
        if any(v.nvmlReturn != 0 for v in vals):
            raise RuntimeError("PCIe byte counters not supported")
        return vals[0].value.ullVal, vals[1].value.ullVal

    def _pcie_loop(self):
        n = self._nvml
        while not self._stop.is_set():
            try:  # each call blocks ~20 ms while NVML averages; KB/s -> MB/s
                tx = n.nvmlDeviceGetPcieThroughput(self._handle, n.NVML_PCIE_UTIL_TX_BYTES) / 1e3
                rx = n.nvmlDeviceGetPcieThroughput(self._handle, n.NVML_PCIE_UTIL_RX_BYTES) / 1e3
                self._pcie_latest = (tx, rx)
            except Exception as e:  # not supported here (some VMs): leave the columns empty
                self.pcie_source = f"unsupported: {type(e).__name__}"
                return

    def _gpu_sample(self, t: float, prev: list):
        n, h = self._nvml, self._handle
        mem = n.nvmlDeviceGetMemoryInfo(h).used / _MIB
        util = n.nvmlDeviceGetUtilizationRates(h)
        if self.pcie_source == "counters":
            tx_b, rx_b = self._read_counters()
            tx = rx = None
            if prev[0] is not None and t > prev[0]:
                tx, rx = (tx_b - prev[1]) / (t - prev[0]) / 1e6, (rx_b - prev[2]) / (t - prev[0]) / 1e6
                if tx < 0 or rx < 0:  # a counter wrapped: no reading for this interval
                    tx = rx = None
            prev[:] = [t, tx_b, rx_b]
        else:
            tx, rx = self._pcie_latest
        return mem, util.gpu, util.memory, tx, rx

    def _clocks(self) -> tuple:
        """(SM MHz, board W, clock-event bitmask); a reading NVML refuses (some VMs) is None from
        then on, without retrying it at every sample."""
        n, h, out = self._nvml, self._handle, []
        for key, read in (("sm", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
                          ("power", lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0),
                          ("events", self._clock_events)):
            if key in self._refused:
                out.append(None)
                continue
            try:
                out.append(read())
            except Exception:
                self._refused.add(key)
                out.append(None)
        return tuple(out)

    def _clock_events(self) -> int:
        n, h = self._nvml, self._handle
        get = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            n.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(get(h))

    def _allocated(self) -> Optional[float]:
        """MiB held by PyTorch tensors on the run's GPU; None without an initialized CUDA (the
        sampler never initializes CUDA itself)."""
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                return torch.cuda.memory_allocated(self._cuda_index or 0) / _MIB
        except Exception:
            pass
        return None

    def _loop(self):
        proc = psutil.Process()
        prev, rss, k = [None, 0, 0], None, 0
        children, scanned = [], -1e9  # this process's children, rescanned every CHILDREN_S
        try:
            host = HostCpu(_tree_usage(proc)[1])
        except (psutil.Error, OSError):  # no /proc/stat (some sandboxes): the columns stay empty
            host = None
        cpu = (None, None, None)
        next_t = time.perf_counter()
        while not self._stop.is_set():
            t = time.perf_counter()
            gpu, clocks = (None,) * 5, (None,) * 3
            if self._handle is not None:
                try:
                    gpu = self._gpu_sample(t, prev)
                    clocks = self._clocks()
                except Exception as e:
                    self.nvml_status = f"absent: sampling failed: {type(e).__name__}: {e}"
                    self._handle = None
            if k % self.host_every == 0:
                try:
                    if t - scanned >= CHILDREN_S:
                        children, scanned = proc.children(recursive=True), t
                    rss_b, cpu_s = _tree_usage(proc, children)
                    rss = rss_b / _MIB
                    if host is not None:
                        cpu = host.sample(cpu_s)
                except (psutil.Error, OSError):
                    pass
            self.rows.append((t - self.t0, *gpu, rss, self._allocated(), *cpu, *clocks))
            k += 1
            next_t += self.interval
            delay = next_t - time.perf_counter()
            if delay > 0:
                self._stop.wait(delay)
            else:  # fell behind (GIL, loaded host): do not try to catch up in a burst
                next_t = time.perf_counter()

    # ------------------------------------------------------------ results
    def summary(self, host_since: float = 0.0) -> dict:
        """Rate and peaks; the host peak counts samples from `host_since` on (run clock), so that
        JIT compilers run by a system's build (children of this process) do not count."""
        rows = self.rows
        span = rows[-1][0] - rows[0][0] if len(rows) > 1 else 0.0
        gpu_mem = [r[1] for r in rows if r[1] is not None]
        host = [r[6] for r in rows if r[6] is not None and r[0] >= host_since]

        def mean(i):  # over the training samples (from host_since), None without any
            v = [r[i] for r in rows if r[i] is not None and r[0] >= host_since]
            return round(sum(v) / len(v), 1) if v else None
        return {
            "nvml": self.nvml_status,
            "pcie_source": self.pcie_source,
            "samples": len(rows),
            "sample_hz": round((len(rows) - 1) / span, 1) if span > 0 else None,
            # a C++ call that holds the GIL (e.g. DeepSpeedCPUAdam) stalls this thread: show it
            "max_gap_s": max((b[0] - a[0] for a, b in zip(rows, rows[1:])), default=None),
            "peak_gpu_nvml_gib": max(gpu_mem) / 1024 if gpu_mem else None,
            "peak_host_sampled_gib": max(host) / 1024 if host else None,
            # the host's CPU while training (% of all its CPUs): stolen by the hypervisor, and
            # used by anything but this run (a host episode, not the run's own work)
            "host_cpu_steal_pct": mean(9),
            "host_cpu_other_pct": mean(10),
            # the GPU while training: its SM clock (median, least), power, and every reason NVML
            # gave for clocks below the maximum, with the share of samples that had it
            **self._clock_summary(host_since),
        }

    def _clock_summary(self, since: float) -> dict:
        rows = [r for r in self.rows if r[0] >= since]
        sm = sorted(r[11] for r in rows if len(r) > 11 and r[11] is not None)
        power = [r[12] for r in rows if len(r) > 12 and r[12] is not None]
        events = [int(r[13]) for r in rows if len(r) > 13 and r[13] is not None]
        seen: dict = {}
        for mask in events:
            for name in clock_event_names(mask):
                seen[name] = seen.get(name, 0) + 1
        return {
            "gpu_sm_mhz_median": sm[len(sm) // 2] if sm else None,
            "gpu_sm_mhz_min": sm[0] if sm else None,
            "gpu_power_w_mean": round(sum(power) / len(power), 1) if power else None,
            "gpu_clock_events": {k: round(v / len(events), 3) for k, v in sorted(seen.items())} if events else None,
        }

    def write(self, path) -> None:
        def fmt(x):
            return "" if x is None else (f"{x:.1f}" if isinstance(x, float) else x)

        from dos.lab.bench.records import open_text_out

        with open_text_out(path) as f:  # path ending in .gz: compressed
            w = csv.writer(f)
            w.writerow(COLUMNS)
            for t, *rest in self.rows:
                w.writerow([f"{t:.4f}", *(fmt(x) for x in rest)])
