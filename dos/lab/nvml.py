"""Background sampler of GPU (NVML) and host memory, on the same clock as the phase markers.

One thread samples at `hz` (default 100): GPU memory used, GPU and memory-controller utilization,
PCIe traffic each way, and host RSS (this process and its children, e.g. SuperOffload's CPU-Adam
worker). Times are `time.perf_counter()` seconds minus the run's `t0`, the clock the timing protocol
stamps its phase markers with, so a trace and its phases line up without conversion.

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
           "pcie_rx_mbps", "host_rss_mib", "gpu_alloc_mib")
"""pcie_tx: GPU -> host (D2H); pcie_rx: host -> GPU (H2D); MB/s = 1e6 bytes per second.
gpu_mem_used is what NVML sees (the caching allocator's reservations: it rarely falls);
gpu_alloc is what PyTorch's tensors hold (torch.cuda.memory_allocated): the rise and fall."""

_MIB = 1 << 20


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


def _total_rss(proc: psutil.Process) -> int:
    rss = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            rss += child.memory_info().rss
        except psutil.Error:
            pass
    return rss


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
        next_t = time.perf_counter()
        while not self._stop.is_set():
            t = time.perf_counter()
            gpu = (None,) * 5
            if self._handle is not None:
                try:
                    gpu = self._gpu_sample(t, prev)
                except Exception as e:
                    self.nvml_status = f"absent: sampling failed: {type(e).__name__}: {e}"
                    self._handle = None
            if k % self.host_every == 0:
                try:
                    rss = _total_rss(proc) / _MIB
                except psutil.Error:
                    pass
            self.rows.append((t - self.t0, *gpu, rss, self._allocated()))
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
        return {
            "nvml": self.nvml_status,
            "pcie_source": self.pcie_source,
            "samples": len(rows),
            "sample_hz": round((len(rows) - 1) / span, 1) if span > 0 else None,
            # a C++ call that holds the GIL (e.g. DeepSpeedCPUAdam) stalls this thread: show it
            "max_gap_s": max((b[0] - a[0] for a, b in zip(rows, rows[1:])), default=None),
            "peak_gpu_nvml_gib": max(gpu_mem) / 1024 if gpu_mem else None,
            "peak_host_sampled_gib": max(host) / 1024 if host else None,
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
