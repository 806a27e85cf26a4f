"""Offload in the plan: where each category of model state lives, and what the copies and the host update cost.

    plan = estimate_memory(GPT(cfg, materialize_now=False), "zero3", 8,
                           precision="bfloat16", offload="optimizer")
    plan.steady, plan.host            # device and host bytes per rank, by category
    offload_seconds(plan.host_traffic, load_machine("h200"), ranks_on_node=8)

[Note: offload plan]
The memory plan puts each category where the run puts it (see [Note: optimizer
offload] in mpishard/parallel/offload.py and [Note: parameter offload] in
mpishard/parallel/zero/stage3.py), per rank, for the optimizer's targets of ``T``
elements (DDP: every parameter, one flat master; ZeRO: the rank's padded shards),
masters and states of ``b`` bytes, a compute copy of ``c`` bytes:

* ``offload="optimizer"``: the device keeps no optimizer state and, under mixed
  precision, no float32 master (``T b`` fewer ``params`` bytes; without mixed
  precision the values it computes with are the master's twin and stay). The host
  holds the master (``params``: ``T b``), a gradient copy (``grads``: ``T b``) and
  the optimizer's states (``optim``); under CuPy with mixed precision also a
  page-locked staging copy of ``c`` bytes per element, for casting before a copy
  (host ``comm``; NumPy and the strict module cast in place, and hold none).
* ``offload="params"`` (ZeRO-3): besides, the compute shards live on the host
  (host ``params`` gains ``T c`` under mixed precision; without, the master is what
  is gathered): the device's ``params`` are 0. Each gather first copies the shard
  into a device buffer (``comm``, released when the gather ends): the device's
  ``comm`` peak is the larger of the reductions' and the largest such copy (the root's
  embeddings, copied before the first forward while no reduction is in flight; a
  block's copy is released when its gather ends, before backward's reductions pile up:
  the ledger finds the same peak).

Per step the host link carries (:class:`HostTraffic`): to the host the reduced
gradient (ZeRO: each unit's shard in the master's dtype; DDP: its buckets in the
reduce dtype, cast on the host); to the device the compute copy (``T c``), or under
parameter offload each unit's shard per gather instead (forward and backward per
micro-batch for the blocks, once a step for the root: the gathers ZeRO-3's bus
bytes count) while the update writes the host shards in place. The host update
streams ``(3 + 2 s) b`` bytes per element for ``s`` optimizer states (AdamW in
float32: read value, gradient and two moments, write value and moments: 28 bytes)
and, under mixed precision, the cast of the compute copy (``b + c``).
:func:`offload_seconds` times them: the copies over the machine's ``host_link``
(one latency per copy), the update at the node's ``host_memory_bandwidth`` shared
by the node's ranks (the host optimizer's threads keep up with memory: see
docs/offload.md). Neither overlaps anything here: the copies run as reductions
finish and before the next forward, the update after the gradient norm.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["HostTraffic", "place_offload", "offload_seconds", "offload_untimed"]


@dataclass(frozen=True)
class HostTraffic:
    """What one rank's step moves over its host link and through host memory."""

    to_host: int = 0        # bytes per step, device -> host (reduced gradients)
    to_device: int = 0      # bytes per step, host -> device (compute copy, or shards per gather)
    copies: int = 0         # copies per step (each pays the link's latency)
    host_bytes: int = 0     # host memory traffic of the update (and the cast)


def place_offload(plan, sizes, targets: int, grad_itemsize: int, grad_copies: int,
                  arrays: int, gathers: tuple = ()):
    """Move ``plan``'s categories where ``sizes.offload`` puts them (see [Note: offload
    plan]) and set its ``host`` bytes and ``host_traffic``; ``plan`` itself, unchanged
    without offload.

    Args:
        plan: the :class:`~mpishard.planning.memory.MemoryEstimate` without offload.
        sizes: its :class:`~mpishard.planning.memory.EstimateSizes`.
        targets: elements of the optimizer's targets on this rank.
        grad_itemsize: bytes per element of the gradients copied to the host.
        grad_copies: copies those take per step (one per ZeRO unit, per DDP bucket).
        arrays: the targets' arrays (one per ZeRO unit, one DDP master): a copy back each.
        gathers: ``(shard elements, gathers per step)`` per ZeRO-3 unit (parameter offload).
    """
    if sizes.offload in (None, "none"):
        return plan
    b, c, mixed = sizes.itemsize, sizes.compute_itemsize, sizes.mixed
    params = sizes.offload == "params"
    master = targets * b
    plan.steady["params"] = 0 if params else plan.steady["params"] - (master if mixed else 0)
    plan.steady["optim"] = 0
    plan.host = {"params": master + (targets * c if params and mixed else 0),
                 "grads": master, "optim": sizes.n_states * master,
                 "comm": targets * c if mixed else 0}
    if params:
        plan.peak["comm"] = max(plan.peak["comm"], max((n * c for n, _ in gathers), default=0))
        to_device = sum(n * k * c for n, k in gathers)
        copies = grad_copies + sum(k for _, k in gathers)
    else:
        to_device, copies = targets * c, grad_copies + arrays
    plan.host_traffic = HostTraffic(
        to_host=targets * grad_itemsize, to_device=to_device, copies=copies,
        host_bytes=targets * ((3 + 2 * sizes.n_states) * b + (b + c if mixed else 0)))
    return plan


def offload_untimed(machine) -> str | None:
    """Why ``machine`` cannot time offload (a GPU description without ``host_link`` or
    ``host_memory_bandwidth``), else ``None``."""
    if machine.kind == "cpu" or (machine.host_link is not None
                                 and machine.host_memory_bandwidth is not None):
        return None
    return (f"machine {machine.name!r} has no host_link or host_memory_bandwidth to time "
            f"offload with; add both to its description (e.g. PCIe Gen5 x16: bandwidth "
            f"5.28e10, latency_s 1e-5)")


def offload_seconds(traffic: HostTraffic | None, machine, ranks_on_node: int) -> dict:
    """``{"offload copies": s, "host optimizer": s}`` of one step with ``traffic`` on
    ``machine`` (``{}`` without offload), ``ranks_on_node`` ranks sharing a node's host
    memory. A CPU's "device" is host memory: its copies stream at its memory bandwidth.

    Raises:
        ValueError: a machine that cannot time offload (:func:`offload_untimed`).
    """
    if traffic is None:
        return {}
    link, memory = machine.host_link, machine.host_memory_bandwidth
    why = offload_untimed(machine)
    if why:
        raise ValueError(why)
    if machine.kind == "cpu":
        stream = machine.memory_bandwidth * machine.elementwise_efficiency
        copy_s = 2 * (traffic.to_host + traffic.to_device) / stream   # a read and a write
        memory = memory or machine.memory_bandwidth
    else:
        copy_s = link.seconds(traffic.to_host + traffic.to_device, traffic.copies)
    share = max(1, math.ceil(ranks_on_node))
    return {"offload copies": copy_s, "host optimizer": traffic.host_bytes * share / memory}
