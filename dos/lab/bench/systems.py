"""Every system behind one interface, so one timing protocol measures them all alike.

`build(spec, model, device)` returns an object with `forward(batch) -> loss`, `backward(loss)`,
`step()` (optimizer step and zero_grad), `describe() -> dict` (row fields: placement, ratio, plan,
config, cpu_impl, host_bytes_per_param, predicted_step_s), `timeline() -> list` (dos lane events of
the last step) and `close()`. The model is already on `device` in its training dtype.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from dos.lab.bench import cpuinfo_cache
from dos.lab.bench.spec import RunSpec

BETAS, EPS = (0.9, 0.999), 1e-8


class SkipRun(Exception):
    """The system cannot run on this machine (not installed, no GPU): recorded as `skipped`."""


class _Base:
    def __init__(self, spec: RunSpec, model):
        self.spec, self.model = spec, model

    def forward(self, batch):
        return self.model(input_ids=batch, labels=batch).loss

    def backward(self, loss):
        loss.backward()

    def describe(self) -> dict:
        return {}

    def timeline(self) -> list:
        return []

    def close(self) -> None:
        pass


class TorchAdamW(_Base):
    """No offload: fp32 master weights and moments on the model's device, torch fused AdamW.

    bf16 parameters get fp32 masters (and an fp32 gradient buffer: 20 B/param in all), the same
    mixed-precision contract as every other system here. # NOTE: torch has no master-weight AdamW,
    so the bf16 gradients are widened with one foreach copy before the fused kernel.
    """

    def __init__(self, spec, model):
        super().__init__(spec, model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        if self.mixed:
            self.masters = [p.detach().float().requires_grad_(True) for p in self.params]
            for m in self.masters:
                m.grad = torch.zeros_like(m)
        else:
            self.masters = self.params
        self.opt = torch.optim.AdamW(self.masters, lr=spec.lr, betas=BETAS, eps=EPS,
                                     weight_decay=spec.weight_decay, fused=True)

    def step(self):
        if self.spec.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.params, self.spec.max_grad_norm)
        if self.mixed:
            torch._foreach_copy_([m.grad for m in self.masters], [p.grad for p in self.params])
        self.opt.step()
        if self.mixed:
            torch._foreach_copy_([p.data for p in self.params], self.masters)
        self.model.zero_grad(set_to_none=True)

    def describe(self):
        return {"cpu_impl": None, "state_dtype": _state_dtype(self.opt) or "fp32",
                "config": {"optimizer": "torch.optim.AdamW(fused=True)", "fp32_master": self.mixed}}


class DosSystem(_Base):
    """dos.DeepOptimizerStates with the spec's placement, stride, resident share and sizes."""

    def __init__(self, spec, model):
        super().__init__(spec, model)
        try:
            import dos
            engine_cls = dos.DeepOptimizerStates
        except (ImportError, AttributeError) as e:
            raise RuntimeError(f"dos engine not available: {type(e).__name__}: {e}") from e
        self.sharded = shard_model(spec, model)
        kw = {k: getattr(spec, k) for k in ("stride", "gpu_fraction", "subgroup_numel", "cpu_threads",
                                            "staging_slots", "max_grad_norm", "overlap_backward",
                                            "grad_ring")
              if getattr(spec, k) is not None}
        if spec.moments is not None:  # issue 17: fp32 | bf16 | int8 moments (None: the default)
            kw["state_dtype"] = spec.moments
        # clip_by "client": the client clips (as transformers.Trainer does), dos is told nothing
        self.client_clip = spec.max_grad_norm if spec.clip_by == "client" else None
        if self.client_clip is not None:
            del kw["max_grad_norm"]
        self.opt = engine_cls(model.parameters(), lr=spec.lr, betas=BETAS, eps=EPS,
                              weight_decay=spec.weight_decay, placement=spec.placement,
                              trace=spec.trace, **kw)

    def step(self):
        if self.client_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.client_clip)
        self.opt.step()
        # zeroed in place: the next backward accumulates straight into dos's flat gradient buffers
        # (set_to_none, torch's default, makes each hook copy a fresh gradient in: as before the
        # zero_grad semantics changed, the measured path stays the in-place one)
        self.opt.zero_grad(set_to_none=False)

    def describe(self):
        d = self.opt.describe()  # the optimizer's own record: plan, config, kernel, host bytes
        cfg = {"engine": d["config"], **({"fsdp2": self.sharded} if self.sharded else {}),
               "clients": d["clients"], "clip_by": self.spec.clip_by,  # re-sends, deferred steps
               "device_state_impl": d.get("device_state_impl"),  # dos.state_kernels.impl_name
               "upload_thread": d.get("upload_thread"),  # dos.uploads (DOS_UPLOAD_THREAD)
               "host_pin": d.get("host_pin")}  # HostArena.pin: bytes, prefault, prefault_s, register_s
        return {"plan": d["plan"], "config": cfg, "state_dtype": d.get("state_dtype", "fp32"),
                "predicted_step_s": d["plan"]["predicted_step_s"], "cpu_impl": d["cpu_impl"],
                "host_bytes_per_param": d["host_bytes_per_param"], "online": d["online"]}

    def timeline(self):
        return list(self.opt.timeline()) if self.spec.trace else []


def shard_model(spec: RunSpec, model) -> Optional[dict]:
    """gpus > 1: FSDP2 over every rank (`fully_shard` per decoder layer, then the root), with
    MixedPrecisionPolicy(bf16 compute, fp32 reduction) when the model is bf16. Returns the row's
    record of it, or None on one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device_type = next(model.parameters()).device.type
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    kw = {"mesh": mesh}
    if spec.dtype == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return {"world_size": dist.get_world_size(), "units": "decoder layers + root",
            "mp_policy": "bf16 params, fp32 reduce" if "mp_policy" in kw else None}


# Tuned for one GPU (issue 16). On one GPU there is no reduction across ranks: the "reduce" bucket
# only chunks the copy of the bf16 gradients into the pinned fp32 host buffer (stage 2 + offload:
# `async_inplace_copy_grad_to_fp32_buffer_from_gpu` per bucket), and the "allgather" bucket only
# chunks the copy of the updated parameters back. DeepSpeed's default is 5e8 elements. We take 2e8:
# each copy is still >= 400 MB (PCIe peak needs ~64 MB), while the last bucket, whose copy cannot
# overlap backward (it fills at backward's end), holds 1/7 of the gradients at 1.3B and 1/25 at ~5B
# instead of up to 1/3 and 1/10; with overlap_comm the two bf16 ipg buffers cost 2 x 400 MB of GPU
# memory, nothing on an H200. contiguous_gradients avoids fragmentation (a copy into one buffer as
# each bucket is reduced); overlap_comm runs those copies on a side stream during backward.
ZERO2_ONE_GPU = {"overlap_comm": True, "contiguous_gradients": True,
                 "reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000}
# Stage 3 on one GPU: partitioning saves no memory (the one rank holds every partition) but pays a
# gather and a release of every layer's parameters in forward, in backward and in the
# checkpointed recomputation (1.3B no-offload: 0.54 s/iter against torch's 0.26 s). A persistence
# threshold above the largest tensor (the ~5B shape's embedding holds 4096 x 32000 = 131M
# elements) keeps every parameter resident: no gather, no release, no prefetch traffic; the live
# and prefetch limits (defaults 1e9 and 5e7) are raised so that neither throttles what is left
# (the hooks still run). Buckets and overlap as stage 2 above; sub_group_size stays the spec's
# (DESIGN.md §8: 1e8), the offloaded update's granularity.
ZERO3_ONE_GPU = {"stage3_param_persistence_threshold": 1_000_000_000,
                 "stage3_max_live_parameters": 10_000_000_000,
                 "stage3_prefetch_bucket_size": 500_000_000,
                 "overlap_comm": True, "contiguous_gradients": True,
                 "reduce_bucket_size": 200_000_000}


def deepspeed_config(spec: RunSpec) -> dict:
    """DeepSpeed's config for `spec.system`: DESIGN.md §8's settings (ZeRO-3, bf16, sub_group_size
    1e8, DeepSpeed's AdamW, pinned offload) for the existing keys; ZeRO-2 + offload and ZeRO-3 +
    offload tuned for one GPU (ZERO2_ONE_GPU, ZERO3_ONE_GPU) for the issue-16 baselines;
    `spec.ds_zero` merged last."""
    bf16 = {"enabled": spec.dtype == "bf16"}
    if spec.system.startswith("deepspeed-zero2"):
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, **ZERO2_ONE_GPU}
        if spec.system == "deepspeed-zero2-offload-bf16":
            # DeepSpeed 0.19.8's low-precision mode (runtime/precision_config.py): bf16 master
            # weights and gradients, and bf16 Adam moments (its CPU Adam is then built with
            # fp32_optimizer_states=False by the engine); needs ZeRO 1-3 and, offloaded, CPU Adam.
            bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    else:
        zero = {"stage": 3, "sub_group_size": spec.sub_group_size}
        if spec.system != "deepspeed-zero3":
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True, "ratio": float(spec.ratio)}
            if spec.system == "deepspeed-superoffload":
                zero["offload_optimizer"]["super_offload"] = True
        if spec.system == "deepspeed-zero3-offload":
            zero.update(ZERO3_ONE_GPU)
    zero.update(spec.ds_zero or {})
    return {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": bf16,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": spec.lr, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": spec.weight_decay}},
        "gradient_clipping": spec.max_grad_norm or 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


STALE_LOCK_S = 600  # a torch extension build takes 1-2 min here; a lock this old has no builder


def clear_stale_extension_locks(root: Optional[str] = None, max_age_s: float = STALE_LOCK_S) -> list:
    """Remove torch-extension build locks older than `max_age_s` (returns their paths, warning).
    A build killed mid-way (a timed-out run) leaves `<ext>/lock` behind, and every later build of
    that op (DeepSpeed's cpu_adam, JIT-built at its first use) waits on it forever: a smoke sweep's
    DeepSpeed run hung 900 s on one (DESIGN.md §10)."""
    import glob
    import time
    import warnings

    root = root or os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    gone = []
    for lock in glob.glob(os.path.join(root, "*", "*", "lock")):
        try:
            if time.time() - os.path.getmtime(lock) > max_age_s:
                os.remove(lock)
                gone.append(lock)
        except OSError:
            pass
    if gone:
        warnings.warn(f"removed stale torch-extension build lock(s) {gone} (older than {max_age_s:.0f} s)")
    return gone


class DeepSpeedSystem(_Base):
    """DeepSpeed ZeRO-2 / ZeRO-3 on one process (env RANK/WORLD_SIZE/MASTER_* set by the run's parent)."""

    def __init__(self, spec, model, device):
        super().__init__(spec, model)
        try:
            import deepspeed
        except ImportError as e:
            raise SkipRun(f"deepspeed is not installed: {e}") from e
        clear_stale_extension_locks()
        cpuinfo_cache.install()  # py-cpuinfo's ~1.2 s probe, thrice a run: once per boot instead
        import logging

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo",
                                   verbose=False)
        self.ds_config = deepspeed_config(spec)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=self.ds_config)

    def forward(self, batch):
        return self.engine(input_ids=batch, labels=batch).loss

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()

    def describe(self):
        opt = getattr(self.engine, "optimizer", None)
        # DeepSpeed's own split; on its CPU accelerator the "GPU" subgroups are named 'cpu' too
        devices = getattr(opt, "subgroup_to_device", None) or {}
        plan = {"n_subgroups": len(devices) or None,
                "cpu_subgroups": sum(1 for d in devices.values() if d == "cpu") if devices else None}
        inner = getattr(opt, "optimizer", None)
        return {"ratio": self.spec.ratio, "plan": plan, "config": {"deepspeed": self.ds_config},
                "cpu_impl": type(inner).__name__ if inner is not None else None,
                "state_dtype": _state_dtype(inner) or self.spec.state_dtype()}

    def close(self):
        so = getattr(getattr(self.engine, "optimizer", None), "superoffload_cpu_optimizer", None)
        if so is not None and hasattr(so, "close"):
            so.close()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


class TorchaoOffload(_Base):
    """torchao's CPUOffloadOptimizer (pytorch/ao): states and the step on the CPU, per tensor.

    # NOTE: it keeps the optimizer state in the parameters' dtype (bf16 here), not fp32 masters.
    """

    def __init__(self, spec, model):
        super().__init__(spec, model)
        try:
            from torchao.optim import CPUOffloadOptimizer
        except ImportError as e:
            raise SkipRun(f"torchao is not installed: {e}") from e
        self.opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=False,
                                       fused=True, lr=spec.lr, betas=BETAS, eps=EPS,
                                       weight_decay=spec.weight_decay)

    def step(self):
        if self.spec.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad()

    def describe(self):
        inner = list(getattr(self.opt, "optim_dict", {}).values())  # one torch AdamW per parameter
        found = next((d for d in map(_state_dtype, inner) if d), None)
        if found is None:  # before the first step: the state takes the host copies' dtype
            p = next(iter(self.model.parameters()), None)
            found = _DTYPE_NAMES.get(p.dtype) if p is not None else None
        return {"cpu_impl": "torch.optim.AdamW(fused=True)", "state_dtype": found or self.spec.state_dtype(),
                "config": {"optimizer": "torchao.CPUOffloadOptimizer"}}


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _state_dtype(opt) -> Optional[str]:
    """The dtype of an optimizer's first moment ("exp_avg"), by name; None where it has no state."""
    for st in (getattr(opt, "state", None) or {}).values():
        t = st.get("exp_avg") if isinstance(st, dict) else None
        if isinstance(t, torch.Tensor):
            return _DTYPE_NAMES.get(t.dtype, str(t.dtype).replace("torch.", ""))
    return None


def build(spec: RunSpec, model, device: torch.device):
    if spec.system in ("torch-gpu", "torch-cpu"):
        return TorchAdamW(spec, model)
    if spec.system == "dos":
        return DosSystem(spec, model)
    if spec.system.startswith("deepspeed"):
        return DeepSpeedSystem(spec, model, device)
    if spec.system == "torchao-cpu-offload":
        return TorchaoOffload(spec, model)
    raise ValueError(f"unknown system {spec.system!r}")


def prepare_env(spec: RunSpec, device: torch.device, master_port: Optional[int] = None) -> None:
    """Environment a system reads at import: DeepSpeed's accelerator, rank variables, arch list."""
    if not spec.system.startswith("deepspeed"):
        return
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    elif "TORCH_CUDA_ARCH_LIST" not in os.environ:  # FusedAdam's JIT build fails without it (§8)
        major, minor = torch.cuda.get_device_capability(device)
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(master_port or 29500))):
        os.environ.setdefault(k, v)
