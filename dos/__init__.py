"""dos: Deep Optimizer States — interleaved CPU/GPU optimizer-state offloading for PyTorch."""
from .buffers import HostMemoryError
from .config import EngineConfig
from .engine import DeepOptimizerStates
from .plan import Plan

__version__ = "0.1.0"
__all__ = ["DeepOptimizerStates", "EngineConfig", "HostMemoryError", "Plan", "__version__"]
