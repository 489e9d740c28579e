"""Where tasks run, with several devices: the one place that decides it.

* Data-parallel: device ``d`` runs every pack on a contiguous share of the microbatches
  (``data_parallel_microbatches``: 6 microbatches over 4 devices are ``(0, 1) (2, 3) (4,) (5,)``).
* The wrap-around pipeline (Harmony-PP): pack *p*'s forward runs on device ``p mod N`` and its
  backward on ``(2(P-1) - p) mod N``, so the last pack's backward stays where its forward kept its
  graph and weights, and consecutive tasks sit on neighbouring devices.
"""
from __future__ import annotations

__all__ = ["forward_device", "backward_device", "data_parallel_microbatches"]


def forward_device(pack: int, num_devices: int) -> int:
    return pack % num_devices


def backward_device(pack: int, num_packs: int, num_devices: int) -> int:
    return (2 * (num_packs - 1) - pack) % num_devices


def data_parallel_microbatches(num_microbatches: int, num_devices: int) -> list[tuple[int, ...]]:
    """The microbatches each device runs: contiguous shares, as even as they can be."""
    if num_microbatches < num_devices:
        raise ValueError(f"microbatches={num_microbatches} is fewer than the {num_devices} devices: "
                         "data-parallel needs at least one microbatch per device.")
    shares, start = [], 0
    for device in range(num_devices):
        count = num_microbatches // num_devices + (1 if device < num_microbatches % num_devices else 0)
        shares.append(tuple(range(start, start + count)))
        start += count
    return shares
