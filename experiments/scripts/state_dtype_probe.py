"""Development probe for issue 17 (not a criterion measurement: one run per configuration, not
round-robin): dos's update phase at a preset model with each state format, all-CPU and
interleaved (stride auto), in one process on one GPU. Rows (JSON lines) go to argv[2].

    python experiments/scripts/state_dtype_probe.py 3B $OUT/probe.jsonl [deadline_s]
"""
import json
import os
import socket
import subprocess
import sys
import time

import torch

import dos
from dos.lab.bench import models

name, out = sys.argv[1], sys.argv[2]
deadline = time.time() + float(sys.argv[3] if len(sys.argv) > 3 else 1e9)
p = models.preset(name)
model = models.build_model(p, torch.device("cuda"), 2048, torch.bfloat16, True)
data = models.synthetic_batches(8, 1, 2048, p.vocab, 0)
sha = os.environ.get("DOS_GIT_SHA") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                      capture_output=True, text=True).stdout.strip()
uuid = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                      text=True).stdout.strip()
boot = open("/proc/sys/kernel/random/boot_id").read().strip()
for placement in ("cpu", "interleaved"):
    for fmt in ("fp32", "bf16", "int8"):
        if time.time() > deadline:
            break
        t0 = time.time()
        opt = dos.DeepOptimizerStates(model.parameters(), lr=1e-4, placement=placement, state_dtype=fmt)
        steps = []
        for i, ids in enumerate(data):
            loss = model(input_ids=ids.cuda(), labels=ids.cuda()).loss
            loss.backward()
            torch.cuda.synchronize()
            a = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - a)
            opt.zero_grad(set_to_none=False)
        d = opt.describe()
        row = {"model": name, "n_params": d["n_params"], "placement": placement, "state_dtype": fmt,
               "step_s": sorted(steps[2:])[len(steps[2:]) // 2], "steps_s": [round(x, 4) for x in steps],
               "loss_last": loss.item(), "host_bytes_per_param": d["host_bytes_per_param"],
               "plan": d["plan"], "online": d["online"], "cpu_impl": d["cpu_impl"], "git_sha": sha,
               "gpu_uuid": uuid, "boot_id": boot, "host": socket.gethostname(), "wall_s": time.time() - t0}
        print(placement, fmt, round(row["step_s"], 3), d["plan"]["stride"], d["host_bytes_per_param"], flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        opt.close()
        del opt
        torch.cuda.empty_cache()
