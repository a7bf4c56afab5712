"""Multi-process CPU tests: spawn `world` gloo processes on this host, run a function in each,
return what rank 0 returned (JSON). Used by tests/test_fsdp.py and tests/test_ddp.py."""
from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist


def init(rank: int, world: int, store: str) -> None:
    """One process of a `world`-rank job on this host, as torchrun would set it up (gloo)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _entry(rank, world, tmp, setup, fn, *args):
    code = 1
    try:
        init(rank, world, os.path.join(tmp, "store"))
        pre = (setup(),) if setup is not None else ()
        out = fn(*pre, tmp, *args)
        if rank == 0 and out is not None:
            with open(os.path.join(tmp, "result.json"), "w") as f:
                json.dump(out, f)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Leave without the interpreter's teardown: a native thread still joinable at exit (gloo's)
        # aborted a rank once in CI ("terminate called without an active exception") after its
        # work had finished. The exit code still says whether the work raised (spawn reports it).
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def spawn(fn, world, tmp_path, *args, setup=None) -> dict:
    """Run `fn([setup(),] tmp, *args)` on `world` ranks (module-level functions: they are pickled
    by name); rank 0's return value, through JSON."""
    torch.multiprocessing.spawn(_entry, args=(world, str(tmp_path), setup, fn, *args), nprocs=world)
    with open(tmp_path / "result.json") as f:
        return json.load(f)


def all_max(x: float) -> float:
    """The maximum of `x` over the ranks."""
    t = torch.tensor(float(x))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
