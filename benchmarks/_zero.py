"""DeepSpeed ZeRO with CPU offload, as every benchmark here configures it: the one place its settings live."""

from __future__ import annotations

from typing import Any


def zero_offload(stage: int, capped: bool, **extra: Any) -> Any:
    """ZeRO-Offload (stage 2: the optimizer states and step on the host) or ZeRO-3 with the parameters offloaded
    too, pinned. Large buckets are DeepSpeed's fast setting on a full card; under a memory cap (``capped``) they
    cost it memory, so smaller ones there."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if stage not in (2, 3):
        raise ValueError(f"ZeRO offload is stage 2 or 3, not {stage}")
    bucket = int(2e8) if capped else int(5e8)
    offload = {"offload_parameters": True} if stage == 3 else {}
    return DeepSpeedStrategy(
        stage=stage, offload_optimizer=True, pin_memory=True, allgather_bucket_size=bucket, reduce_bucket_size=bucket,
        **offload, **extra,
    )  # fmt: skip
