"""dos: Deep Optimizer States — interleaved CPU/GPU optimizer-state offloading for PyTorch."""
from .buffers import HostMemoryError
from .config import EngineConfig
from .ddp import ddp_comm_hook, register_ddp
from .engine import DeepOptimizerStates
from .plan import Plan

__version__ = "0.1.0"
__all__ = ["DeepOptimizerStates", "EngineConfig", "HostMemoryError", "Plan", "__version__", "ddp_comm_hook",
           "register_ddp"]
