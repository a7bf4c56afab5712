"""The torch.optim.Optimizer surface clients reach for, beyond step() and zero_grad().

- Flags of torch.optim.AdamW: `foreach`, `fused`, `capturable` are accepted and ignored (dos has
  its own kernels; NOTE: its step is not CUDA-graph capturable whatever `capturable` says);
  `amsgrad`, `maximize` and `differentiable=True` are refused wherever they arrive from (the
  constructor, an edit of `param_groups`, a loaded state_dict) with a ValueError. Param groups
  carry the same keys as torch's, so state_dicts move both ways.
- Tensor `lr` / `betas` (1-element) become Python floats, as torch uses them when not capturable.
- `opt.state` (`checkpoint.LiveState`): {param: {"step", "exp_avg", "exp_avg_sq"[, "master"]}} in
  AdamW's format, read from the live state on each access (views of it where a parameter lies in
  one subgroup; a parameter spanning subgroups gets a copy), with each parameter's own step.
  Parameters that were never stepped have no entry, as in torch.
- The parameters a constructor accepts (`check_params`): dense, real, fp32/bf16/fp16, one device.
- state_dict / load_state_dict pre- and post-hooks (`register_state_dict_pre_hook` etc.) fire as
  in torch.optim.Optimizer.
- NOTE: deviation — `copy.deepcopy` / `pickle` of the optimizer raise TypeError: its state lives in
  pinned host memory and device buffers that the model's parameters alias; save `state_dict()`.
"""
from __future__ import annotations

import warnings
from typing import Callable, List

import torch

from .config import validate_hparams

REFUSED = {"amsgrad": "amsgrad", "maximize": "maximize", "differentiable": "differentiable=True"}


def torch_keys(foreach=None, fused=None, capturable=False, differentiable=False) -> dict:
    """The param-group keys torch.optim.AdamW has beyond lr/betas/eps/weight_decay."""
    return dict(amsgrad=False, maximize=False, foreach=foreach, capturable=capturable,
                differentiable=differentiable, fused=fused)


def as_float(x, name: str = "lr"):
    """A 1-element tensor hyperparameter as a Python float (torch's non-capturable use)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element")
        return float(x.item())
    return x


def check_group(group: dict, where: str = "param_groups") -> None:
    """Refuse unsupported flags; floats for tensor hyperparameters; torch's validation."""
    for key, what in REFUSED.items():
        if group.get(key):
            # NOTE: deviation from torch.optim.AdamW — these variants are not implemented.
            raise ValueError(f"dos.DeepOptimizerStates does not support {what} (found in {where})")
    if group.get("decoupled_weight_decay") is False:
        raise ValueError(f"dos.DeepOptimizerStates is AdamW (decoupled weight decay); {where} "
                         "asks for Adam's L2 weight decay (decoupled_weight_decay=False)")
    group["lr"] = as_float(group["lr"])
    if any(isinstance(b, torch.Tensor) for b in group["betas"]):
        group["betas"] = tuple(as_float(b, "betas") for b in group["betas"])
    validate_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])


def state_dict_with_hooks(opt, make: Callable[[], dict]) -> dict:
    """torch.optim.Optimizer.state_dict's hook protocol around dos's own state_dict."""
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    sd = make()
    for hook in opt._optimizer_state_dict_post_hooks.values():
        out = hook(opt, sd)
        if out is not None:
            sd = out
    return sd


def load_state_dict_with_hooks(opt, sd: dict, load: Callable[[dict], None]) -> None:
    sd = dict(sd)  # as torch: a shallow copy, so that hooks may edit it
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        out = hook(opt, sd)
        if out is not None:
            sd = out
    for g in sd["param_groups"]:
        check_group(dict(g), where="the loaded state_dict")
    load(sd)
    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)


def missing_master(key) -> None:
    warnings.warn(f"dos: the state of parameter {key} has no fp32 'master' (a torch.optim.AdamW "
                  "state_dict of a low-precision model?): the master is seeded from the parameter",
                  UserWarning, stacklevel=4)


def refuse_copy(opt):
    raise TypeError("dos.DeepOptimizerStates cannot be pickled or deep-copied: its state lives in "
                    "pinned host memory and device buffers that the model's parameters alias. Save "
                    "opt.state_dict() and load it into a new optimizer built on the model")


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_params(trainable: List[List[torch.Tensor]]) -> torch.device:
    """The device of the trainable parameters, after refusing what dos cannot hold."""
    flat = [p for ps in trainable for p in ps]
    if not flat:
        raise ValueError("dos.DeepOptimizerStates got no trainable parameters (all have "
                         "requires_grad=False)")
    for p in flat:
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"dos.DeepOptimizerStates does not support sparse parameters "
                             f"(got layout {p.layout})")
        if p.is_complex():
            raise ValueError("dos.DeepOptimizerStates does not support complex parameters")
        if p.dtype not in _DTYPES:
            raise ValueError(f"dos.DeepOptimizerStates supports parameters of dtype "
                             f"{[str(d) for d in _DTYPES]}, got {p.dtype}")
    devices = sorted({str(p.device) for p in flat})
    if len(devices) > 1:
        raise ValueError(f"dos.DeepOptimizerStates needs all trainable parameters on one device, "
                         f"got {devices}")
    device = flat[0].device
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"dos.DeepOptimizerStates runs on CUDA or CPU parameters, got {device}")
    return device
