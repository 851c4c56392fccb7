"""The serving-cost model of the AttentionStore paper: GPU hours plus the storage the cache occupies."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    """Prices of the paper's evaluation (AWS-style on-demand rates).

    Args:
        gpu_per_hour: One A100 GPU, $/h.
        dram_per_gb_hour: Host memory, $/(GB·h).
        ssd_per_gb_hour: SSD capacity, $/(GB·h).

    Example:
        >>> prices = CostModel()
        >>> prices.cost(gpu_seconds=3600)["total"]  # one A100-hour, no storage
        5.0
        >>> CostModel(gpu_per_hour=2.0).cost(1800)["gpu"]
        1.0
    """

    gpu_per_hour: float = 5.0
    dram_per_gb_hour: float = 0.0088
    ssd_per_gb_hour: float = 0.000082

    def cost(self, gpu_seconds: float, dram_bytes: float = 0.0, ssd_bytes: float = 0.0,
             duration_s: float = 0.0) -> dict[str, float]:
        """Dollars for `gpu_seconds` of compute plus tiers of the given sizes kept for `duration_s`.

        Storage is charged for the capacity provisioned, not the bytes in use: a deployment pays for the
        DRAM and SSD it reserves for the cache whether or not they are full.

        Returns:
            ``{"gpu": ..., "dram": ..., "ssd": ..., "total": ...}`` in dollars.

        Example:
            >>> parts = CostModel().cost(gpu_seconds=3600, dram_bytes=100e9, ssd_bytes=1e12, duration_s=3600)
            >>> {name: round(dollars, 3) for name, dollars in parts.items()}  # 100 GB DRAM, 1 TB SSD, one hour
            {'gpu': 5.0, 'dram': 0.88, 'ssd': 0.082, 'total': 5.962}
        """
        if min(gpu_seconds, dram_bytes, ssd_bytes, duration_s) < 0:
            raise ValueError("times and sizes must be non-negative")
        hours = duration_s / 3600
        parts = {
            "gpu": gpu_seconds / 3600 * self.gpu_per_hour,
            "dram": dram_bytes / 1e9 * hours * self.dram_per_gb_hour,
            "ssd": ssd_bytes / 1e9 * hours * self.ssd_per_gb_hour,
        }
        parts["total"] = sum(parts.values())
        return parts
