"""Training across processes (one per server) on ``torch.distributed``: see ``Trainer``."""
from harmony_fx.distributed.cluster import Cluster, PeerError, StepFailedElsewhere

__all__ = ["Cluster", "PeerError", "StepFailedElsewhere"]
