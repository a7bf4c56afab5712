"""state_dict <-> subgroup storage, in `torch.optim.AdamW`'s per-parameter format.

`state[i]` holds `step`, `exp_avg`, `exp_avg_sq` shaped like parameter i (as torch's AdamW), plus
`master` (fp32 weights) for parameters that are not fp32 — for fp32 parameters the parameter is
the master. Tensors are views of the live state where a parameter lies in one subgroup (no copy of
a 7B model's state to save it); a parameter spanning subgroups is gathered into a new tensor.
A state_dict therefore loads into a dos optimizer of any placement or subgroup size.

State formats (dos/state_format.py): the moments are saved in the optimizer's format — fp32, or
bf16 views — and `state_dict()["dos"]["state_dtype"]` records it. int8 moments are block-quantized
across parameter boundaries, so each parameter's entry holds them decoded (fp32 copies, not views)
and `["dos"]["int8"]` holds every subgroup's codes and scales with a fingerprint of the layout: an
optimizer of the same layout loads those bytes (a bitwise resume); any other re-encodes the fp32
values. Loading into another format converts (bf16 rounds to nearest even; int8 re-quantizes) and
warns once; bf16 and bf16-split share their moments and both masters are exact fp32 (bf16-split's
is joined from hi:lo, a copy rather than a view of the live state): no conversion, no warning.

DTensor (FSDP2) parameters: each tensor is a DTensor sharded as its parameter, over this rank's
local shard (`opt.binding.like`), so `torch.distributed.checkpoint` saves and loads it sharded and
the state dict is `get_optimizer_state_dict` / `set_optimizer_state_dict` compatible (these key it
by parameter FQN). `opt.state` (`LiveState`) maps each parameter to the same entry, read from the
live storage, as torch's optimizers do (DCP's `_init_optim_state` takes an empty `opt.state` for
an optimizer that has never stepped).
"""
from __future__ import annotations

import hashlib
import warnings
import weakref
from collections.abc import Mapping
from typing import Dict, List, Optional, Tuple

import torch

from . import surface
from .partition import ParamSlot
from . import split_master
from .state_format import decode, encode_, set_master_

KINDS = ("master", "exp_avg", "exp_avg_sq")


def _segments(opt, slot: ParamSlot) -> List[Tuple[int, int, int]]:
    """(subgroup, start inside the subgroup, length) pieces of a parameter, in order."""
    out, lo, hi = [], slot.offset, slot.offset + slot.numel
    for sg in opt.layout.subgroups:
        if sg.bucket != slot.bucket or sg.stop <= lo or sg.start >= hi:
            continue
        a, b = max(lo, sg.start), min(hi, sg.stop)
        out.append((sg.index, a - sg.start, b - a))
    return out


def _pieces(opt, slot: ParamSlot, kind: int, decoded: Optional[dict] = None) -> List[torch.Tensor]:
    """Views of the parameter's pieces of state `kind` (0 master, 1 exp_avg, 2 exp_avg_sq); for
    int8 moments, pieces of the subgroups' decoded fp32 moments (`decoded`: subgroup -> (m, v),
    filled on demand)."""
    out = []
    for s, a, n in _segments(opt, slot):
        views = opt.state_views(s)
        if kind == 0 and opt.state_format.split:  # hi:lo joined: a copy, not the live state
            out.append(split_master.join(views.hi[a: a + n], views.lo[a: a + n]))
        elif kind and opt.state_format.quantized:
            if decoded is None:
                decoded = {}
            if s not in decoded:
                decoded[s] = decode(opt.state_format, views, opt.layout.subgroups[s].numel)
            out.append(decoded[s][kind - 1][a: a + n])
        else:
            out.append(views[kind][a: a + n])
    return out


def layout_fingerprint(opt) -> str:
    """What makes two optimizers' int8 codes interchangeable: subgroups and parameter places."""
    key = repr(([(sg.bucket, sg.start, sg.stop) for sg in opt.layout.subgroups],
                sorted((s.group, s.index, s.bucket, s.offset, s.numel) for s in opt.param_slots())))
    return hashlib.sha1(key.encode()).hexdigest()[:16]


def _packed(opt) -> dict:
    """int8: every subgroup's codes and scales (the bytes after the master), and the layout."""
    fmt, out = opt.state_format, []
    for sg in opt.layout.subgroups:
        _, m_off, *_ = fmt.offsets(sg.numel)
        out.append(opt.state_storage(sg.index)[m_off: fmt.nbytes(sg.numel)].cpu().clone())
    return {"layout": layout_fingerprint(opt), "subgroups": out}


def _numbering(opt) -> Dict[int, int]:
    """id(param) -> its index in torch's state_dict numbering: every position counts; a parameter
    repeated inside a group takes its last position there (as torch.optim.Optimizer.state_dict)."""
    out, start = {}, 0
    for group in opt.param_groups:
        out.update({id(p): i for i, p in enumerate(group["params"], start) if id(p) not in out})
        start += len(group["params"])
    return out


def _param_index(opt) -> Dict[Tuple[int, int], Tuple[int, int]]:
    """(group, position among its distinct trainable params) -> (index in torch's state_dict
    numbering, position in the group's full parameter list)."""
    out, number = {}, _numbering(opt)
    for g, group in enumerate(opt.param_groups):
        k, seen = 0, set()
        for pos, p in enumerate(group["params"]):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out[(g, k)] = (number[id(p)], pos)
                k += 1
    return out


def param_state(opt, slot: ParamSlot, p: torch.Tensor, step: int, decoded: Optional[dict] = None) -> dict:
    """Parameter p's entry, as torch's AdamW has it (the caller waited for the host state)."""
    entry = {"step": torch.tensor(float(step))}
    for k, kind in enumerate(KINDS):
        if kind == "master" and p.dtype == torch.float32:
            continue
        pieces = _pieces(opt, slot, k, decoded)
        if len(pieces) == 1:
            flat = pieces[0]
        else:
            flat = torch.cat([x.cpu() for x in pieces]) if pieces else torch.zeros(0)
        entry[kind] = opt.binding.like(p, flat)
    return entry


class LiveState(Mapping):
    """`opt.state`: parameter -> its entry (`param_state`), built from the live storage at each
    access (tensors are views of it where a parameter lies in one subgroup: writing into them
    changes the state); parameters that have not stepped (per-parameter steps: one never given a
    gradient) have none, as torch. A parameter repeated in a group is one key. Holds the
    optimizer weakly (no reference cycle keeps its pinned memory alive)."""

    def __init__(self, opt):
        self._opt = weakref.ref(opt)

    def _slots(self) -> dict:
        opt = self._opt()
        if opt is None or not getattr(opt, "_ready", False):
            return {}
        steps = opt.param_steps
        return {p: slot for slot, p in opt.param_slots().items() if steps[slot] > 0}

    def __getitem__(self, p):
        slot = self._slots()[p]
        opt = self._opt()
        opt.require_idle("opt.state")  # overlap_backward: not between backward and step()
        opt.wait_host_state()
        return param_state(opt, slot, p, opt.param_steps[slot])

    def __iter__(self):
        return iter(self._slots())

    def __len__(self) -> int:
        return len(self._slots())


def state_dict(opt) -> dict:
    opt.wait_host_state()
    index = _param_index(opt)
    state, steps, decoded = {}, opt.param_steps, {}  # per parameter, as torch's
    for slot, p in opt.param_slots().items():
        if steps[slot] == 0:
            continue  # as torch: no state before the parameter's first step
        state[index[(slot.group, slot.index)][0]] = param_state(opt, slot, p, steps[slot], decoded)
    groups, number = [], _numbering(opt)
    for group in opt.param_groups:
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = [number[id(p)] for p in group["params"]]
        groups.append(g)
    extra = {"state_dtype": opt.state_format.name}
    if opt.state_format.quantized:
        extra["int8"] = _packed(opt)
    return {"state": state, "param_groups": groups, "dos": extra}


def _saved_dtype(sd: dict, state: dict) -> str:
    """The state format a state_dict was saved in (recorded by dos; else the moments' dtype)."""
    saved = (sd.get("dos") or {}).get("state_dtype")
    if saved:
        return saved
    for entry in state.values():
        m = entry.get("exp_avg") if isinstance(entry, Mapping) else None
        if isinstance(m, torch.Tensor):
            return "bf16" if m.dtype == torch.bfloat16 else "fp32"
    return "fp32"


def _key(k):
    return int(k) if isinstance(k, int) or (isinstance(k, str) and k.isdigit()) else k


def load_state_dict(opt, sd: dict) -> None:
    groups = sd["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"loaded state dict has {len(groups)} parameter groups, the optimizer "
                         f"has {len(opt.param_groups)}")
    for mine, theirs in zip(opt.param_groups, groups):
        if len(mine["params"]) != len(theirs["params"]):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the "
                             "size of optimizer's group")
    index = _param_index(opt)
    # Keys: torch's parameter numbers, or parameter FQNs (set_optimizer_state_dict).
    state = {_key(k): v for k, v in sd["state"].items()}
    opt.wait_host_state()
    fmt, saved = opt.state_format, _saved_dtype(sd, state)
    same_moments = {saved, fmt.name} <= {"bf16", "bf16-split"}  # the same bf16 moments, exact fp32 masters
    if saved != fmt.name and not same_moments:
        warnings.warn(f"dos: loading optimizer state saved with {saved} moments into state_dtype="
                      f"'{fmt.name}': the moments are converted"
                      + (" (rounded to bf16)" if fmt.name == "bf16" else
                         " (re-quantized)" if fmt.quantized else " (exactly)"), stacklevel=4)
    packed = (sd.get("dos") or {}).get("int8")
    raw = bool(fmt.quantized and saved == "int8" and packed
               and packed.get("layout") == layout_fingerprint(opt))
    # int8 from per-parameter values: the subgroups' fp32 moments, filled, then encoded
    decoded = {} if fmt.quantized and not raw else None
    steps, per_param = {}, opt.param_steps
    for slot, p in opt.param_slots().items():
        key = _key(groups[slot.group]["params"][index[(slot.group, slot.index)][1]])
        entry = state.get(key)
        if entry is None:  # no state (never stepped, as torch): moments zero, master = the weights
            entry = {"step": 0, "exp_avg": torch.zeros(p.shape), "exp_avg_sq": torch.zeros(p.shape),
                     "master": p.detach()}
        per_param[slot] = int(float(entry["step"]))
        steps.setdefault(slot.group, set()).add(per_param[slot])
        for k, kind in enumerate(KINDS):
            src = p.detach() if kind == "master" and p.dtype == torch.float32 else entry.get(kind)
            if src is None and kind == "master":  # a torch AdamW state of a bf16 model
                surface.missing_master(key)
                src = p.detach()
            if src is None:
                raise ValueError(f"state of parameter {key} lacks '{kind}'")
            if src.numel() != p.numel():
                raise ValueError(f"state '{kind}' of parameter {key} has {src.numel()} elements, "
                                 f"the parameter has {p.numel()}")
            if k and raw:
                continue  # the codes and scales are loaded as saved, below
            flat, at = opt.binding.local_of(p, src).reshape(-1), 0
            if k == 0 and fmt.split:  # the master goes into hi:lo (exactly)
                for s, a, n in _segments(opt, slot):
                    set_master_(fmt, opt.state_views(s), flat[at: at + n], lo=a)
                    at += n
                continue
            for piece in _pieces(opt, slot, k, decoded):
                piece.copy_(flat[at: at + piece.numel()])
                at += piece.numel()
    if raw:
        for sg, blob in zip(opt.layout.subgroups, packed["subgroups"]):
            _, m_off, *_ = fmt.offsets(sg.numel)
            opt.state_storage(sg.index)[m_off: fmt.nbytes(sg.numel)].copy_(blob)
    elif decoded:
        for s, (m32, v32) in decoded.items():
            encode_(fmt, opt.state_views(s), m32, v32)
    counts = opt.group_steps
    for g, found in steps.items():
        counts[g] = max(found)  # the group's step; each parameter's is in opt.param_steps
    opt.group_steps = counts
    for mine, theirs in zip(opt.param_groups, groups):
        mine.update({k: v for k, v in theirs.items() if k != "params"})
