"""Machine descriptions: what a step-time prediction needs to know about the hardware.
(Reading them, every field checked, is mpishard/planning/machine_file.py.)

    machine = load_machine("h100-sxm")            # a shipped description (mpishard/machines/)
    machine = load_machine("machine.json")        # or a file, e.g. from `mpishard bench calibrate`
    machine.matmul_seconds(2e12, "bfloat16")      # one product of 2 TFLOP

GPU descriptions also cost steps kernel by kernel (see [Note: GPU kernel model] in
``gpu_time.py``): ``matmul_efficiency_table``, ``vector_flops``,
``vector_efficiency_table``, ``memory_efficiency_table`` (Calculon's size ->
efficiency tables), ``flash_attention_efficiency``, ``launch_s`` per kernel; and
``memory_reserve_bytes`` per device that layouts may not plan (CUDA context, NCCL
buffers, the pool's fragmentation: :attr:`Machine.usable_memory_bytes`); and, for
offload (see [Note: offload plan] in ``offload.py``), ``host_link`` (each device's
link to host memory: bytes per second each way, latency per copy) and
``host_memory_bandwidth`` (a node's host DRAM, shared by its ranks).

A description is one JSON object::

    {"name": "h100-sxm", "kind": "gpu", "ranks_per_node": 8,
     "device": {"flops": {"bfloat16": 9.89e14, "float32": 6.7e13, ...},
                "matmul_efficiency": 0.8, "matmul_overhead_s": 1e-5,
                "memory_bytes": 8.0e10, "memory_bandwidth": 3.35e12,
                "elementwise_efficiency": 0.8, "op_overhead_s": 5e-6},
     "links": {"intra": {"latency_s": 1e-5, "bandwidth": 3.6e11},
               "inter": {"latency_s": 2e-5, "bandwidth": 5e10}},
     "collectives": {"all_reduce@4": {"latency_s": ..., "bandwidth": ...}, ...},
     "overlap": true, "cores": null,
     "sources": {"device.flops.bfloat16": "NVIDIA H100 datasheet ...", ...}}

``flops`` are peak dense FLOP/s per dtype (``float64``, ``float32``, ``float16``,
``bfloat16``, ``tf32``); ``matmul_efficiency`` the share of
it large matrix products reach, ``matmul_overhead_s`` what each product costs
besides (launch, small shapes); ``memory_bandwidth`` times
``elementwise_efficiency`` is what elementwise passes stream;
``activation_rate`` (optional, calibrated) the bytes kept for backward the
elementwise ops get through per second, forward and backward
(``activation_rates``: per set of a family's ops, ``ModelSpec.elementwise``, where
calibrated; ``activation_rate`` for the rest);
``optimizer_rate`` and ``optimizer_overhead_s`` (optional, calibrated) what an
optimizer step takes per byte of model state and per target array
(``optimizer_rates``: ``[[state bytes, rate], ...]``, the rate from each size of
step on, where the host kernel changes path with the size); ``grad_norm_rate``
(optional, calibrated) the gradient bytes per second gradient clipping's global
norm reads. ``links`` give the
bus bandwidth (bytes per second of bus bytes, see [Note: bus bytes]) and
per-call latency within a node and across nodes (``gather_bandwidth``: all-gathers'
and reduce-scatters' where slower); ``collectives`` (from a
calibration) override them per collective kind and group size (``"all_reduce@4"``,
``"all_reduce@4/inter"`` for groups spanning nodes). ``overlap``: whether
communication runs beside computation (DMA engines and NICs on GPUs; on a CPU
the cores that compute also copy); a link's ``processor_usage`` the share of the
device that communication over it takes from computation it overlaps (the
collective's kernels' SMs and memory traffic: Calculon's figure). ``cores``: a CPU's cores per node; ranks
beyond them share (``share``). ``busy_slowdown`` (calibrated) how many times longer a
rank's compute takes while ``n`` ranks of a node compute at once (``{"4": 2.6}``): turns
on shared cores, and the memory bus and last-level cache all ranks share. Every value's origin is in ``sources``.

Every share of a peak (``matmul_efficiency``, ``elementwise_efficiency``,
``flash_attention_efficiency``, the efficiency tables' rows) is in (0, 1], a link's
``processor_usage`` in [0, 1) (0: communication takes nothing from computation);
``ranks_per_node``, ``cores`` and ``rails`` are whole numbers. A key the format does not
have is refused, naming the closest one it has; ``sources`` takes notes under any key.

[Note: rails]
A link's ``bandwidth`` across nodes is one NIC's. A GPU node has a NIC per GPU (a DGX
A100 eight 200 Gb/s HCAs, a DGX H100 eight 400 Gb/s ones: ``rails``, 1 if absent, as on
a node of CPU ranks that share one NIC). A ring collective (all-reduce, all-gather,
reduce-scatter) enters and leaves each node once per ring, and NCCL spreads its rings
over the node's NICs, so a group with ``g`` ranks on each node crosses on ``g`` NICs, up
to the node's own links: ``min(intra, g x inter)``. NCCL's authors say as much: a ring
"requires data to go through each GPU and enter/exit the node once" (NVIDIA/nccl#687),
and with more NICs than one a node gets "more bandwidth, up to 160GB/s which is the
NVLink intra-node bandwidth of your system" (NVIDIA/nccl#412, an A800 node at 24 GB/s
across nodes on its one HDR NIC); eight 200 Gb/s HCAs measure 192 GB/s of all-reduce
bus bandwidth (NVIDIA/nccl#812), where this gives 8 x 22.5 = 180. ``g`` is the fewest
of the group's ranks on any of its nodes (the ring waits for that node), and the
groups beside it on a node share its NICs: with fewer NICs than ranks a node, each
group gets ``rails x g / ranks_per_node`` of them (at least one). So a ZeRO-3 group
over whole nodes crosses them about as fast as it runs inside one, while Megatron-LM's
data-parallel groups, one rank on each node under tp = 8, cross on one NIC each.
Sends, receives and all-to-alls move each rank's own bytes through its own NIC: one
NIC's bandwidth. Left out: rings slow as they take in more nodes (an H100
reduce-scatter's bus bandwidth from about 360 GB/s at 4 nodes to about 260 at 128,
NVIDIA/nccl#1229), so the cap is optimistic for groups of many nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Link", "Machine", "MACHINES_DIR"]

#: where the shipped descriptions live
MACHINES_DIR = Path(__file__).resolve().parent.parent / "machines"


@dataclass(frozen=True)
class Link:
    """A collective's cost line: ``latency_s`` per call plus bus bytes over ``bandwidth``."""

    latency_s: float
    bandwidth: float
    gather_bandwidth: float | None = None     # all-gathers and reduce-scatters, if slower
    processor_usage: float = 0.0              # compute time lost per second overlapped
    rails: int = 1                            # a node's ranks with a NIC of their own

    def seconds(self, bus_bytes: float, calls: float = 1.0) -> float:
        return calls * self.latency_s + bus_bytes / self.bandwidth

    def for_kind(self, kind: str) -> "Link":
        """This link as collective ``kind`` sees it: all-gathers and reduce-scatters at
        ``gather_bandwidth`` where it has one."""
        if kind in _GATHERS and self.gather_bandwidth:
            return Link(self.latency_s, self.gather_bandwidth, None, self.processor_usage,
                        self.rails)
        return self


@dataclass(frozen=True)
class Machine:
    """A parsed description (see the module docstring); build it with
    :func:`~mpishard.planning.machine_file.load_machine`."""

    name: str
    kind: str
    ranks_per_node: int
    flops: dict
    matmul_efficiency: float
    matmul_overhead_s: float
    memory_bytes: float
    memory_bandwidth: float
    elementwise_efficiency: float
    op_overhead_s: float
    intra: Link
    inter: Link
    activation_rate: float | None = None
    activation_rates: dict = field(default_factory=dict)
    optimizer_rate: float | None = None
    optimizer_overhead_s: float = 0.0
    optimizer_rates: tuple = ()
    grad_norm_rate: float | None = None
    collectives: dict = field(default_factory=dict)
    overlap: bool = True
    cores: int | None = None
    sources: dict = field(default_factory=dict)
    matmul_efficiency_table: tuple | None = None
    vector_flops: dict = field(default_factory=dict)
    vector_efficiency_table: tuple = ((0, 1.0),)
    memory_efficiency_table: tuple = ((0, 1.0),)
    flash_attention_efficiency: float = 0.5
    launch_s: float = 0.0
    memory_reserve_bytes: float = 0.0
    host_link: Link | None = None
    host_memory_bandwidth: float | None = None
    busy_slowdown: dict = field(default_factory=dict)

    @property
    def kernel_model(self) -> bool:
        """Whether steps are costed kernel by kernel (see [Note: GPU kernel model]):
        the description has a ``matmul_efficiency_table``."""
        return self.matmul_efficiency_table is not None

    @property
    def usable_memory_bytes(self) -> float:
        """What layouts may plan per device: its memory less the reserve for what the
        plan does not hold (CUDA context, NCCL buffers, the pool's fragmentation)."""
        return self.memory_bytes - self.memory_reserve_bytes

    def provenance(self) -> dict:
        """``{"measured here" | "calibrated" | "datasheet" | "published tables" |
        "estimate": [fields]}``: where each figure of the description comes from, read
        from its ``sources``."""
        out: dict = {}
        for key, text in self.sources.items():
            low = str(text).lower()
            kind = "measured here" if "measured here" in low or "bench calibrate" in low else \
                "calibrated" if "calibrat" in low else \
                "estimate" if "assumed" in low or "estimate" in low else \
                "datasheet" if "datasheet" in low or "_gpu_specs" in low else "published tables"
            out.setdefault(kind, []).append(key)
        return out

    def vector_peak(self, dtype: str) -> float:
        """The vector units' FLOP/s in ``dtype`` (16-bit types fall back on each other)."""
        for name in (dtype, {"float16": "bfloat16", "bfloat16": "float16"}.get(dtype, dtype)):
            if name in self.vector_flops:
                return float(self.vector_flops[name])
        return self.peak(dtype)

    def peak(self, dtype: str) -> float:
        """Peak dense FLOP/s in ``dtype`` (float16 and bfloat16 fall back on each other)."""
        for name in (dtype, {"float16": "bfloat16", "bfloat16": "float16"}.get(dtype, dtype)):
            if name in self.flops:
                return float(self.flops[name])
        raise ValueError(f"machine {self.name!r} has no peak FLOP/s for {dtype!r}; add "
                         f"device.flops.{dtype} to its description")

    def share(self, ranks_per_node: int) -> float:
        """How many ranks take turns on one core (CPU ranks beyond its cores), >= 1."""
        if not self.cores:
            return 1.0
        return max(1.0, ranks_per_node / self.cores)

    def slowdown(self, ranks_per_node: int) -> float:
        """How many times longer a rank's compute takes while ``ranks_per_node`` ranks of a
        node compute at once than on one rank alone: calibrated (``busy_slowdown``; for
        more ranks than were measured, the most measured times the extra turns), else
        :meth:`share`."""
        measured = [n for n in self.busy_slowdown if n <= ranks_per_node]
        if ranks_per_node <= 1 or not measured:
            return self.share(ranks_per_node)
        n = max(measured)
        return self.busy_slowdown[n] * self.share(ranks_per_node) / self.share(n)

    def matmul_seconds(self, flops: float, dtype: str, calls: float = 1.0) -> float:
        return calls * self.matmul_overhead_s + flops / (self.peak(dtype) *
                                                          self.matmul_efficiency)

    def stream_seconds(self, nbytes: float) -> float:
        """Elementwise passes over ``nbytes`` of memory traffic."""
        return nbytes / (self.memory_bandwidth * self.elementwise_efficiency)

    def optimizer_seconds(self, state_bytes: float, targets: int) -> float:
        """One optimizer step over ``state_bytes`` of values, gradients and states in
        ``targets`` arrays: at the calibrated rate (``optimizer_rates``' for a step of that
        size, else ``optimizer_rate``) and cost per target, else one read and one write
        of the state at the elementwise bandwidth."""
        rate = next((r for b, r in reversed(self.optimizer_rates) if state_bytes >= b),
                    self.optimizer_rate)
        if rate:
            return state_bytes / rate + targets * self.optimizer_overhead_s
        return self.stream_seconds(2 * state_bytes)

    def grad_norm_seconds(self, grad_bytes: float) -> float:
        """Gradient clipping's global norm over ``grad_bytes`` of gradients: at the calibrated
        ``grad_norm_rate``, else nothing counted (a device's fused norm is a read of them
        beside the step)."""
        return grad_bytes / self.grad_norm_rate if self.grad_norm_rate else 0.0

    def activation_seconds(self, kept: float, ops: str | None = None) -> float:
        """The elementwise work of a forward and backward that keep ``kept`` bytes: at the
        calibrated rate of the blocks' ops ``ops`` (``activation_rates``, else
        ``activation_rate``), else three streams of them (written forward, read and their
        gradients written backward)."""
        rate = self.activation_rates.get(ops) or self.activation_rate
        if rate:
            return kept / rate
        return self.stream_seconds(3 * kept)

    def link(self, kind: str, size: int, spans_nodes: bool, per_node: int = 1,
             ranks_per_node: int | None = None) -> Link:
        """The cost line of collective ``kind`` over a group of ``size`` ranks, at least
        ``per_node`` of them on each of its nodes of ``ranks_per_node`` ranks (the
        description's by default): a calibrated one (``collectives["kind@size"]``,
        ``"kind@size/inter"`` across nodes), else the inter- or intra-node link (see
        [Note: rails])."""
        fitted = self.collectives.get(f"{kind}@{size}" + ("/inter" if spans_nodes else ""))
        if fitted is not None:
            return Link(float(fitted["latency_s"]), float(fitted["bandwidth"]))
        link = (self.inter if spans_nodes else self.intra).for_kind(kind)
        node = ranks_per_node or self.ranks_per_node
        nics = min(per_node, link.rails, link.rails * per_node // node)   # groups beside share
        if spans_nodes and nics > 1 and kind in _RINGS:
            within = self.intra.for_kind(kind).bandwidth
            return Link(link.latency_s, min(within, nics * link.bandwidth), None,
                        link.processor_usage, link.rails)
        return link


#: the collectives that run as rings (see [Note: rails]), and those of them a link may
#: give a gather bandwidth of their own
_RINGS = ("all_reduce", "all_gather", "reduce_scatter")
_GATHERS = ("all_gather", "reduce_scatter")
