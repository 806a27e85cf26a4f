"""ZeRO: one entry, ``ZeRO(module, mesh, stage=k)``, over the stage classes it registers.

    model = ZeRO(GPT(cfg, materialize_now=False), mesh, stage=3)

Stages 1 and 2 are :class:`~mpishard.parallel.zero.stage12.ShardedStateZeRO`
(``zero1``, ``zero2``), stage 3 is
:class:`~mpishard.parallel.zero.stage3.FullyShardedZeRO` (``zero3``); what they
share is in base.py. :func:`ZeRO` looks the stage's class up in
:data:`~mpishard.parallel.STRATEGIES`, as ``--strategy zero3`` does.
"""
from __future__ import annotations

from mpishard.parallel.strategy import strategy_entry
from mpishard.parallel.zero import stage12, stage3  # noqa: F401 (register zero1, zero2, zero3)
from mpishard.parallel.zero.base import ZeroStrategy

__all__ = ["ZeRO"]


def ZeRO(module, mesh, stage: int = 3, units=None, root_unit: bool = True,  # noqa: N802
         reshard_after_forward: bool = True, prefetch: bool = True, seed=None, ledger=None,
         precision=None, offload=None) -> ZeroStrategy:
    """Shard optimizer state (stage 1), + gradients (2), + parameters (3) over ``mesh.dp``.

    Args:
        module: the model; under stage 3 build it with ``materialize_now=False``
            so no rank ever holds it whole (parameters are materialised one
            tensor at a time, from seed and name, straight into shards).
        mesh: a :class:`mpishard.comm.Mesh`.
        stage: 1, 2 or 3.
        units: module names that form units (default: the model plan's units).
        root_unit: put parameters of no unit into a root unit (default True).
        reshard_after_forward: stage 3: release a unit after its forward.
        prefetch: stage 3: gather the next unit ahead, non-blocking.
        seed: initialisation seed (default: ``module.seed``).
        ledger: where buffers are counted (default: the module's backend's).
        precision: ``"float32"`` (default), ``"float16"``, ``"bfloat16"`` or a
            :class:`~mpishard.parallel.Precision`.
        offload: ``"optimizer"`` keeps the float32 master shards and their optimizer
            state in host memory and updates them there (docs/offload.md); ``None``
            or ``"none"`` (default) keeps everything on the device.

    Returns:
        The strategy registered as ``zero{stage}``.

    Raises:
        ValueError: a stage other than 1, 2 or 3, or a stage-3 option changed at
            stage 1 or 2 (where parameters stay whole).
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
    options = dict(units=units, root_unit=root_unit, seed=seed, ledger=ledger,
                   precision=precision, offload=offload)
    if stage == 3:
        options.update(reshard_after_forward=reshard_after_forward, prefetch=prefetch)
    elif not (reshard_after_forward and prefetch):
        raise ValueError(f"reshard_after_forward and prefetch are ZeRO stage-3 options; "
                         f"stage {stage} keeps parameters whole: leave them at True or use "
                         f"stage=3")
    return strategy_entry(f"zero{stage}").build(module, mesh, **options)
