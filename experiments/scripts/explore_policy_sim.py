"""What an exploration policy would have cost on recorded batches: each batch's fixed-plan runs
(all-CPU and integer strides of one planner/stride sweep batch) give every plan a pool of recorded
step times (steps 2 and later of every run of that plan); a simulated exploration draws one or
two steps per plan from the pools, keeps the fastest mean (optionally re-measuring the best two
with one more step each), and is charged its regret (the kept plan's median over the batch's
best median) plus its cost (the explored steps' time beyond the best median, spread over a
22-step run, as the planner criterion spreads explore_s). 2000 draws per batch.
    python experiments/scripts/explore_policy_sim.py
"""
import csv
import random
import statistics as st
from collections import defaultdict
from pathlib import Path

R = Path(__file__).resolve().parents[2] / "experiments" / "results"
RUN_STEPS = 22
POLICIES = {"1 step each": (1, 0), "2 steps each": (2, 0), "1 each + best 2 again": (1, 2),
            "1 each + best 3 again": (1, 3)}


def pools():
    for f in sorted(R.glob("planner-*/runs.csv")) + sorted(R.glob("stride-*/runs.csv")):
        by = defaultdict(lambda: defaultdict(list))
        for row in csv.DictReader(open(f)):
            if row["status"] != "ok" or row["stride"] == "auto" or not row.get("steps_file"):
                continue
            p = f.parent / row["steps_file"]
            if not p.exists():
                continue
            plan = row["placement"] + (row["stride"] or "")
            by[row.get("batch_id") or row["git_sha"]][plan] += [
                float(s["iter_s"]) for s in csv.DictReader(open(p)) if int(s["step"]) >= 2]
        for b, plans in by.items():
            if len(plans) >= 4 and min(len(x) for x in plans.values()) >= 6:
                yield f"{f.parent.name} {b}", dict(plans)


def simulate(plans, per, again, rng):
    med = {k: st.median(v) for k, v in plans.items()}
    best = min(med.values())
    seen = {k: [rng.choice(v) for _ in range(per)] for k, v in plans.items()}
    if again:
        for k in sorted(seen, key=lambda k: st.mean(seen[k]))[:again]:
            seen[k].append(rng.choice(plans[k]))
    kept = min(seen, key=lambda k: st.mean(seen[k]))
    cost = sum(sum(x - best for x in xs) for xs in seen.values()) / RUN_STEPS
    return med[kept] / best - 1, cost / best


rng = random.Random(0)
print(f"{'batch':58s} " + " ".join(f"{p:>22s}" for p in POLICIES))
tot = defaultdict(list)
for name, plans in pools():
    cells = []
    for pol, (per, again) in POLICIES.items():
        r = [simulate(plans, per, again, rng) for _ in range(2000)]
        reg, cost = st.mean(x for x, _ in r), st.mean(c for _, c in r)
        tot[pol].append(reg + cost)
        cells.append(f"{100 * reg:5.1f}% +{100 * cost:4.1f}% cost")
    print(f"{name[:58]:58s} " + " ".join(f"{c:>22s}" for c in cells))
print("mean regret + cost: " + ", ".join(f"{p} {100 * st.mean(v):.1f}%" for p, v in tot.items()))
