"""harmony_fx: train PyTorch models larger than GPU memory, as a torch.fx compiler (Harmony, VLDB'22)."""
from harmony_fx.api import HarmonyModule, compile
from harmony_fx.frontend.capture import CaptureError
from harmony_fx.config import CompileOptions
from harmony_fx.compiler.packing import BudgetTooSmallError
from harmony_fx.compiler.capture_cache import reset
from harmony_fx.compiler.driver import MicrobatchesComputeApart, RandomDrawsPerMicrobatch
from harmony_fx.runtime.devices import CudaDevice, DeviceOutOfMemoryError, HostDevice
from harmony_fx.program.verify import ProgramError
from harmony_fx.trainer import NonFiniteLossError, Trainer

__all__ = [
    "compile", "HarmonyModule", "Trainer", "CompileOptions", "HostDevice", "CudaDevice",
    "CaptureError", "BudgetTooSmallError", "DeviceOutOfMemoryError", "ProgramError", "reset",
    "RandomDrawsPerMicrobatch", "MicrobatchesComputeApart", "NonFiniteLossError",
]
