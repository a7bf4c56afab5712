"""Host time of one non-blocking H2D `copy_` call, by source memory and size (issue 17: in the
engine the upload's copy_ call took 120-140 us of the CPU lane's main thread per subgroup).

    python experiments/scripts/copy_call_cost.py OUT.csv
"""
import mmap, os, statistics, sys, time
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from dos.lab.bench.records import append_script_rows, batch_columns  # noqa: E402


def registered(nbytes):
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.fill_(1)
    assert int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)) == 0
    t._keep = m
    return t


def main(out):
    big = 1 << 28  # 256 MiB
    srcs = {"registered": registered(big), "pinned": torch.empty(big, dtype=torch.uint8, pin_memory=True)}
    dst = torch.empty(big, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    rows = []
    for name, src in srcs.items():
        for size in (1 << 20, 1 << 24, 100 << 20):
            for stream in ("default", "side"):
                ts = []
                for _ in range(30):
                    torch.cuda.synchronize()
                    with torch.cuda.stream(side if stream == "side" else torch.cuda.current_stream()):
                        t = time.perf_counter()
                        dst[:size].copy_(src[:size], non_blocking=True)
                        ts.append(time.perf_counter() - t)
                torch.cuda.synchronize()
                rows.append({"source": name, "bytes": size, "stream": stream,
                             "median_us": round(statistics.median(ts[5:]) * 1e6, 2), "min_us": round(min(ts[5:]) * 1e6, 2)})
                print(rows[-1])
    base = batch_columns()
    append_script_rows(out, [{**base, **r} for r in rows])


if __name__ == "__main__":
    main(sys.argv[1])
