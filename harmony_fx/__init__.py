"""harmony_fx: train PyTorch models larger than GPU memory, as a torch.fx compiler (Harmony, VLDB'22)."""
from harmony_fx.api import HarmonyModule, compile
from harmony_fx.frontend.capture import CaptureError
from harmony_fx.config import CompileOptions
from harmony_fx.compiler.packing import BudgetTooSmallError
from harmony_fx.compiler.capture_cache import reset
from harmony_fx.compiler.driver import MicrobatchesComputeApart, RandomDrawsPerMicrobatch
from harmony_fx.runtime.devices import CudaDevice, DeviceOutOfMemoryError, HostDevice
from harmony_fx.program.verify import ProgramError
from harmony_fx.distributed.cluster import PeerError
from harmony_fx.runtime.tier import TierCorrupted
from harmony_fx.trainer import NonFiniteLossError, Trainer


def _register_the_backend_without_an_install() -> None:
    """``torch.compile(backend="harmony")`` finds harmony through the package's entry point; run
    from a checkout (``PYTHONPATH=.``) there is none, and Dynamo would not know the name. Registered
    here then (importing Dynamo only in that case: it costs half a second)."""
    from importlib.metadata import entry_points

    if not any(point.name == "harmony" for point in entry_points(group="torch_dynamo_backends")):
        from torch._dynamo import register_backend

        from harmony_fx.backend import harmony

        register_backend(harmony, name="harmony")


_register_the_backend_without_an_install()

__all__ = [
    "compile", "HarmonyModule", "Trainer", "CompileOptions", "HostDevice", "CudaDevice",
    "CaptureError", "BudgetTooSmallError", "DeviceOutOfMemoryError", "ProgramError", "reset",
    "RandomDrawsPerMicrobatch", "MicrobatchesComputeApart", "NonFiniteLossError", "PeerError", "TierCorrupted",
]
