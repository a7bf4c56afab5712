"""Developer sanity check (not a record): the engine at 1.3B on a real GPU, every placement,
a few steps, with the step's lane timeline summarised. Records come from `python -m dos sweep`."""
import sys
import time

import torch

import dos
from dos.lab.bench.models import build_model, preset
from dos.trace import lane_totals

SETTINGS = [dict(placement="cpu"), dict(placement="interleaved", stride=2),
            dict(placement="interleaved", stride=1), dict(placement="static", gpu_fraction=0.5),
            dict(placement="gpu")]
name = sys.argv[1] if len(sys.argv) > 1 else "1.3B"
p = preset(name)
model = build_model(p, torch.device("cuda"), 2048)
ids = torch.randint(0, p.vocab, (1, 2048), device="cuda")
for kw in SETTINGS:
    t = time.perf_counter()
    opt = dos.DeepOptimizerStates(model.parameters(), lr=1e-4, trace=True, **kw)
    init = time.perf_counter() - t
    losses, steps = [], []
    for i in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        opt.zero_grad()
        losses.append(round(loss.item(), 3))
        steps.append((round(t1 - t0, 3), round(t2 - t1, 3)))
    tot = {k: round(v, 3) for k, v in lane_totals(opt.timeline()).items()}
    print(kw, f"init {init:.1f}s", "fwdbwd/step", steps, "loss", losses, "lanes", tot,
          "B/param", round(opt.host_bytes_per_param, 3), dos.adam.cpu_impl(), flush=True)
    opt.close()
    del opt
    torch.cuda.empty_cache()
