"""The sweep file: a yaml grid of runs (experiments/sweeps/NAME.yaml), parsed and validated into
a `Sweep` of RunSpecs in the order they run (dos.lab.sweep runs them).

A sweep file (experiments/sweeps/NAME.yaml):

    name: smoke                 # results go to experiments/results/<name>/ unless --out
    description: free text
    defaults: {model: tiny, device: cpu, seq_len: 128, steps: 3}    # RunSpec fields
    grid: {micro_batch: [1, 2]}   # optional: crossed with every entry of `runs`
    runs:                         # entries over the defaults; a list value expands (cartesian)
      - {system: dos, placement: [cpu, interleaved]}
      - {system: deepspeed-zero-offload}
    host_memory_gib: null         # host memory the preflight may plan for (default: available)
    timeout_s: 900                # per run
    repeat: 3                     # each run 3 times, round-robin: every run once, then again, ...
    order: rotate                 # each round starts further along the list (default: fixed)
    headline: true                # refuse to run from a dirty tree (git sha ending in -dirty)
    supersedes: [RUN_ID, ...]     # rows this sweep re-measures (readers then ignore them) ...
    supersede_reason: free text   # ... and why (required with supersedes)
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import List, Optional

import yaml

from dos.lab.bench.spec import ConfigError, RunSpec

SWEEP_KEYS = {"name", "description", "defaults", "grid", "runs", "host_memory_gib", "timeout_s",
              "repeat", "order", "headline", "supersedes", "supersede_reason"}
ORDERS = ("fixed", "rotate")


@dataclass
class Sweep:
    name: str
    runs: List[RunSpec]
    host_memory_gib: Optional[float] = None
    timeout_s: float = 900.0
    description: str = ""
    repeat: int = 1
    headline: bool = False
    supersedes: List[str] = field(default_factory=list)
    supersede_reason: str = ""


# ---------------------------------------------------------------- loading

def load(path) -> Sweep:
    """Parse and validate a sweep file; raise ConfigError naming the file and the problem."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such sweep file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    try:
        return parse(doc, default_name=path.stem)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def parse(doc, default_name: str = "sweep") -> Sweep:
    if not isinstance(doc, dict):
        raise ConfigError(f"a sweep is a mapping with keys {sorted(SWEEP_KEYS)}, got {type(doc).__name__}")
    unknown = set(doc) - SWEEP_KEYS
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {sorted(unknown)}; allowed: {sorted(SWEEP_KEYS)}")
    name = str(doc.get("name") or default_name)
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ConfigError(f"name {name!r} must be letters, digits, '-', '_' or '.'")
    defaults, grid, runs = doc.get("defaults") or {}, doc.get("grid") or {}, doc.get("runs")
    for key, val in (("defaults", defaults), ("grid", grid)):
        if not isinstance(val, dict):
            raise ConfigError(f"'{key}' must be a mapping, got {type(val).__name__}")
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) for r in runs):
        raise ConfigError("'runs' must be a non-empty list of mappings (each with a 'system')")
    specs, seen = [], set()
    for i, entry in enumerate(runs):
        for spec in _expand_entry(defaults, grid, entry, i):
            if spec.run_id() not in seen:
                seen.add(spec.run_id())
                specs.append(spec)
    host = doc.get("host_memory_gib")
    if host is not None and not (isinstance(host, (int, float)) and host > 0):
        raise ConfigError(f"host_memory_gib must be a positive number, got {host!r}")
    timeout = doc.get("timeout_s", 900)
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ConfigError(f"timeout_s must be a positive number, got {timeout!r}")
    repeat = doc.get("repeat", 1)
    if not (isinstance(repeat, int) and not isinstance(repeat, bool) and repeat >= 1):
        raise ConfigError(f"repeat must be an int >= 1, got {repeat!r}")
    order = doc.get("order", "fixed")
    if order not in ORDERS:
        raise ConfigError(f"order must be one of {list(ORDERS)}, got {order!r}")
    if repeat > 1:  # round-robin: every run once, then every run again, ...
        # `rotate` counterbalances the position in the round: round i starts i*n/repeat runs
        # along, so no configuration is always last (planner-deep-3.5b: auto, last in every
        # round, ran into the slow episodes that came at the rounds' ends; docs/DESIGN.md §10)
        n = len(specs)
        shift = [(i * n) // repeat if order == "rotate" else 0 for i in range(repeat)]
        specs = [replace(s, repeat=i + 1) for i in range(repeat) for s in specs[shift[i]:] + specs[:shift[i]]]
    headline = doc.get("headline", False)
    if not isinstance(headline, bool):
        raise ConfigError(f"headline must be true or false, got {headline!r}")
    sup, reason = doc.get("supersedes") or [], doc.get("supersede_reason")
    if isinstance(sup, str):
        sup = [sup]
    if not (isinstance(sup, list) and all(isinstance(x, str) and x for x in sup)):
        raise ConfigError(f"supersedes must be a list of run_ids, got {sup!r}")
    if sup and not (isinstance(reason, str) and reason.strip()):
        raise ConfigError("supersedes needs a supersede_reason (why the old rows are replaced)")
    return Sweep(name, specs, host, float(timeout), str(doc.get("description") or ""), repeat,
                 headline, list(sup), str(reason or ""))


def select(specs: List[RunSpec], where: dict) -> List[RunSpec]:
    """The specs whose fields match every `where` value, or one of a list of values (compared as
    strings: 3B == "3B")."""
    for k in where:
        if k not in RunSpec.__dataclass_fields__:
            raise ConfigError(f"--where: unknown field {k!r}")
    def ok(spec, k, v):
        return str(getattr(spec, k)) in {str(x) for x in (v if isinstance(v, list) else [v])}

    out = [s for s in specs if all(ok(s, k, v) for k, v in where.items())]
    if not out:
        raise ConfigError(f"--where {where} selects no run of this sweep")
    return out


def _expand_entry(defaults: dict, grid: dict, entry: dict, index: int) -> List[RunSpec]:
    base = {**defaults, **{k: v for k, v in grid.items() if k not in entry}, **entry}
    keys = list(base)
    axes = [base[k] if isinstance(base[k], list) else [base[k]] for k in keys]
    if any(len(a) == 0 for a in axes):
        raise ConfigError(f"runs[{index}]: an empty list expands to no run")
    out = []
    for combo in itertools.product(*axes):
        d = dict(zip(keys, combo))
        try:
            out.append(RunSpec.from_dict(d))
        except ConfigError as e:
            raise ConfigError(f"runs[{index}] ({_short(d)}): {e}") from None
    return out


def _short(d: dict) -> str:
    return ", ".join(f"{k}={d[k]}" for k in ("system", "placement", "stride", "gpu_fraction", "ratio",
                                             "model") if k in d)
