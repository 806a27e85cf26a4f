"""Measure the machine this runs on and write a machine description (for `mpishard plan`).

    mpiexec -n 4 python -m mpi4py -m mpishard bench calibrate -o machine.json
    mpishard plan --machine machine.json --ranks 4 ...

Rank 0 alone (the others wait asleep, not spinning in MPI) times, with one BLAS
thread as multi-rank runs use:

* the matrix products of the model the flags describe (``--preset`` or the
  model flags, default the default model): every linear layer's forward
  product and its two backward ones (input and weight gradients, with the
  transposes backward uses), on ``batch_size x block_size`` rows and on 1/2,
  1/4 and 1/8 of them (data-parallel ranks and micro-batches cut the rows), with
  the layer whole and cut in 2 and 4 (tensor parallelism), in float32 and
  float64, and fits ``seconds = overhead + flops / rate`` (least squares):
  ``device.flops[dtype]`` is the rate, with ``matmul_efficiency`` 1 (it is what
  products of these shapes reach here), and ``matmul_overhead_s`` the overhead;
* elementwise passes (``out = a * b + c`` over 4-64 MiB arrays): bytes moved
  per second as ``memory_bandwidth``; and a block's elementwise ops (a norm, the
  MLP's activation, a residual add, the causal softmax, at the model's rows and
  width), forward and backward, as the bytes they keep for backward per second, for
  each family's ops (``activation_rates``: layer norm and GELU as GPT's blocks run
  them, RMS norm and SwiGLU as the Llama family's, whose NumPy ops get through
  about 1.3 times the bytes a second; ``activation_rate`` the model's own: how fast
  the step gets through what the planner counts);
* one small autodiff op, forward and backward: ``op_overhead_s``;
* AdamW over one large flat target (bytes of values, gradients and states per
  second, below and at the size from which the compiled loop takes a step:
  ``optimizer_rates``, ``optimizer_rate`` the first) and over many small ones
  (``optimizer_overhead_s`` per target); gradient clipping's global norm
  (``grad_norm_rate``: bytes of gradients read per second).

Then ranks compute at once: a training step of the model on one rank (no
communication; forward, backward, clipping and AdamW; ``1 / n`` of the batch, a
data-parallel rank's share; a model whose AdamW state on every rank of the node
would take more than a quarter of its memory: its products and a block's ops
instead) on ranks ``0 .. n - 1`` together, meeting at a barrier
before and after each step as training's collectives make them (a step ends when its
slowest rank does), for each group size ``n`` that
divides the world; each rank's time over rank 0's alone as ``busy_slowdown[n]``
(ranks beyond the cores take turns; fewer still share the memory bus and the
last-level cache).
Then every rank takes part: for each group size ``n`` that divides the world
(consecutive ranks, as the mesh's inner axes are), each collective the planner
uses (all-reduce, all-gather, reduce-scatter, all-to-all, send) at sizes 4 KiB
to 4 MiB is timed (the slowest rank, the median of repeats taken in three rounds over
every kind and size) and fitted as
``seconds = latency + bus_bytes / bandwidth`` per ``kind@n``. ``cores`` is the
node's CPU count and ``ranks_per_node`` the ranks sharing this node. A
progress line per step goes to stderr on rank 0.

One launch lands where that launch's machine state put it; on a shared node, calibrate
three times and plan with their median (every number the median of the three)::

    for i in 1 2 3; do mpiexec -n 4 python -m mpi4py -m mpishard bench calibrate -o m$i.json; done
    mpishard bench calibrate --merge m1.json m2.json m3.json -o machine.json
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from mpishard.bench.flags import BenchParser, check_count, check_output, write_json
from mpishard.core.backend import Backend
from mpishard.comm import Communicator
from mpishard.comm.mesh import ranks_per_node
from mpishard.comm.stats import bus_bytes

__all__ = ["main", "calibrate", "fit_line", "model_shapes"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def model_shapes(model, rows: int) -> list:
    """``(rows, in, out)`` of every distinct linear layer of ``model`` on ``rows`` rows and
    on 1/2, 1/4, 1/8 of them, whole and with the output cut in 2 and 4."""
    layers = {(int(m.weight.shape[1]), int(m.weight.shape[0])) for _, m in
              model.named_modules() if type(m).__name__.endswith("Linear")}
    out = set()
    for k, n in layers:
        for cut in (1, 2, 4):
            for r in (rows, rows // 2, rows // 4, rows // 8):
                if r >= 1 and n // cut >= 1:
                    out.add((r, k, n // cut))
    return sorted(out)


def fit_line(x, y) -> tuple:
    """Least-squares ``y = a + b x`` with ``a >= 0`` and ``b > 0`` (a time per byte or per
    flop): returns ``(a, b)``. Timings too noisy for that line (a negative intercept, or
    a larger size measured no slower) are fitted through the origin instead."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    b, a = np.polyfit(x, y, 1)
    if a < 0 or b <= 0:               # through the origin instead
        a, b = 0.0, float(np.dot(x, y) / np.dot(x, x))
    return float(a), float(b)


def _time(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _matmul(dtype, repeats: int, shapes) -> tuple:
    """Fit of the forward and backward products of ``shapes`` (as the autodiff runs them:
    ``x @ w.T``, ``g @ w`` and ``g.T @ x`` with ``w`` stored ``(out, in)``)."""
    rng = np.random.default_rng(0)
    flops, seconds = [], []
    for m, k, n in shapes:
        x = rng.standard_normal((m, k)).astype(dtype)
        w = rng.standard_normal((n, k)).astype(dtype)
        g = rng.standard_normal((m, n)).astype(dtype)
        for fn in (lambda: x @ w.T, lambda: g @ w, lambda: g.T @ x):
            seconds.append(_time(fn, repeats))
            flops.append(2.0 * m * k * n)
    overhead, per_flop = fit_line(flops, seconds)
    return overhead, 1.0 / per_flop


def _elementwise(repeats: int) -> float:
    rates = []
    for mib in (4, 16, 64):
        n = mib * 2**20 // 4
        a, b, c = (np.ones(n, np.float32) for _ in range(3))
        out = np.empty_like(a)

        def step():
            np.multiply(a, b, out=out)
            np.add(out, c, out=out)
        rates.append(5 * a.nbytes / _time(step, repeats))    # 3 reads, 2 writes
    return statistics.median(rates)


#: the elementwise ops of a block, by the name a model family's spec gives them
#: (``ModelSpec.elementwise``): a norm, the MLP's activation on its output, a residual add
OP_SETS = ("layernorm-gelu", "rmsnorm-swiglu")


def _activation_step(rows: int, width: int, heads: int, seq: int,
                     ops: str = "layernorm-gelu") -> tuple:
    """``(step, bytes)``: a forward and backward of a block's elementwise ops -- ``ops``:
    layer norm, GELU and a residual add (GPT's), or RMS norm, SwiGLU and a residual add
    (the Llama family's), on ``(rows, width)``, and the causal softmax on ``(rows / seq,
    heads, seq, seq)`` scores, float32 -- and the bytes it keeps for backward, counted as a
    device's kernels keep them."""
    from mpishard.autodiff import Tensor
    from mpishard.autodiff.nn_ops import gelu, layer_norm
    from mpishard.autodiff.rms_rope_swiglu import rms_norm, swiglu
    from mpishard.autodiff.softmax_ops import softmax
    from mpishard.core.backend import MemoryLedger
    if ops not in OP_SETS:
        raise ValueError(f"elementwise ops {ops!r}: expected one of {', '.join(OP_SETS)}")
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((rows, width)).astype(np.float32), requires_grad=True)
    s = Tensor(rng.standard_normal((max(1, rows // seq), heads, seq, seq)).astype(np.float32),
               requires_grad=True)

    def forward():
        mlp = gelu(layer_norm(x)) if ops == "layernorm-gelu" else swiglu(rms_norm(x), x)
        return (mlp + x).sum() + softmax(s, axis=-1).sum()
    ledger = MemoryLedger()
    with ledger.measure_activations() as kept:
        out = forward()
    del out
    # the measure the planner divides by (see _whole_activations in
    # mpishard/planning/cost.py): these ops keep on NumPy what a device's kernels keep
    # (norms, GELU and SwiGLU compute the rest again in backward on both)
    streamed = kept.nbytes

    def step():
        forward().backward()
    return step, streamed


def _activation_rate(rows: int, width: int, heads: int, seq: int, repeats: int,
                     ops: str = "layernorm-gelu") -> float:
    """Bytes kept for backward (as a device's kernels keep them) that the elementwise ops
    ``ops`` of a block (:func:`_activation_step`) get through per second, forward and
    backward."""
    step, streamed = _activation_step(rows, width, heads, seq, ops)
    return streamed / _time(step, repeats)


def _products(shapes) -> callable:
    """One call of every forward and backward product of ``shapes`` (float32)."""
    rng = np.random.default_rng(0)
    arrays = [tuple(rng.standard_normal(s).astype(np.float32)
                    for s in ((m, k), (n, k), (m, n))) for m, k, n in shapes]

    def run():
        for x, w, g in arrays:
            x @ w.T, g @ w, g.T @ x
    return run


def model_step(model, seq: int, vocab: int) -> callable:
    """``steps(rows)``: one training step of language model ``model`` (unmaterialised) on
    this rank alone, no communication -- forward and backward over ``rows`` tokens in
    sequences of ``seq``, clipping and AdamW -- as a zero-argument call."""
    from mpishard.comm import Mesh
    from mpishard.optim import AdamW
    from mpishard.parallel import ParallelModel
    run = ParallelModel(model, Mesh(Communicator(MPI.COMM_SELF), dp=1), strategy="ddp")
    opt = AdamW(run.parameters(), lr=1e-4, ledger=run.ledger)

    def steps(rows):
        x = np.random.default_rng(0).integers(0, vocab, (max(1, rows // seq), seq))
        y = np.roll(x, -1, axis=1)

        def step():
            run.train_step(x, y)
            run.step(opt, max_norm=1.0)
        return step
    return steps


def _sleep_until(request) -> None:
    """Wait for a non-blocking MPI request asleep: a rank spinning in MPI would take a
    core from the ranks being timed."""
    while not request.Test():
        time.sleep(0.005)


def _busy_slowdown(world, steps, rows: int, repeats: int, say) -> dict:
    """``{n: f}``: how many times longer a training step (``steps(rows / n)``, the share of
    ``rows`` each of ``n`` data-parallel ranks computes) takes on each of ranks ``0 .. n -
    1`` (one node's) computing at once than on rank 0 alone, for each group size ``n``
    that divides the world. As in training, the ranks meet after every step: each step
    starts as a barrier over the ``n`` (MPI's, spinning) lets them go, and is timed from
    there until the next barrier lets them go again, when the last of them has finished
    (a training step's next collective waits for the slowest rank, and ranks that wait
    spin: where ranks take turns on the cores, the last finishes milliseconds after
    the first); the mean over the ranks of each one's median; the other ranks wait
    asleep. See [Note: ranks sharing a node] in mpishard/planning/cost.py."""
    out = {}
    for n in [d for d in range(2, world.size + 1) if world.size % d == 0]:
        group = world.split(0 if world.rank < n else None, name=f"busy{n}")
        step = steps(max(1, rows // n))
        times = []
        for ranks in (1, n):
            _sleep_until(world.mpi.Ibarrier())
            mine = None
            if world.rank < ranks:
                samples = []
                for i in range(repeats + 1):
                    if ranks > 1:
                        group.barrier()
                    start = time.perf_counter()
                    step()
                    if ranks > 1:
                        group.barrier()          # the step ends with its slowest rank
                    samples.append(time.perf_counter() - start)
                mine = statistics.median(samples[1:])
            _sleep_until(world.mpi.Ibarrier())      # the others finish asleep, not spinning
            times.append(statistics.fmean(t for t in world.mpi.allgather(mine)
                                          if t is not None))
        if group is not None:
            group.free()
        out[n] = times[1] / times[0]
        say(f"  {n} ranks at once, {max(1, rows // n)} rows each: x{out[n]:.2f} the time of "
            f"one alone")
    return out


def _optimizer(repeats: int) -> tuple:
    """AdamW's ``(table, seconds per target, gradient-norm rate)``. ``table``: ``[[state
    bytes, rate], ...]``, the bytes of model state per second (values, gradients, two
    states) over one flat float32 target of each size the kernels treat differently: a
    step below :data:`~mpishard.kernels.cpu.adam.COMPILED_MIN_ELEMS` elements in all
    runs NumPy's passes, one of at least that many the compiled loop where numba is
    installed (see mpishard/kernels/cpu/adam.py), each rate from that state size on.
    The seconds per target from 64 small ones; the norm rate: bytes of float32
    gradients per second that gradient clipping's global norm reads
    (:func:`~mpishard.optim.clip.grad_sq_sum`)."""
    from mpishard.kernels.cpu.adam import COMPILED_MIN_ELEMS
    from mpishard.optim import AdamW
    from mpishard.optim.clip import grad_sq_sum
    from mpishard.parallel.flat import FlatShard

    def targets(n, size):
        out = [FlatShard(np.ones(size, np.float32), ((0, size),), f"t{i}") for i in range(n)]
        for t in out:
            t.grad = np.full(size, 1e-3, np.float32)
        return out
    table = []
    for size in (COMPILED_MIN_ELEMS // 2, COMPILED_MIN_ELEMS):
        big = targets(1, size)            # float32: 16 bytes of model state an element
        table.append([0 if not table else 16 * size,
                      4 * big[0].data.nbytes / _time(AdamW(big).step, repeats)])
    small = targets(64, 16)
    grad = big[0].grad
    norm = grad.nbytes / _time(lambda: grad_sq_sum([grad]), repeats)
    return table, _time(AdamW(small).step, repeats) / len(small), norm


def _op_overhead(repeats: int) -> float:
    from mpishard.autodiff import Tensor
    x = Tensor(np.ones((2, 2), np.float32), requires_grad=True)

    def step():
        y = (x * 2.0 + 1.0).sum()
        y.backward()
    return _time(step, repeats) / 6                           # 3 ops, forward and back


def _collective(comm, kind: str, nbytes: int):
    """A zero-argument call of ``kind`` moving a message of ``nbytes`` on ``comm``, and its
    bus bytes (see [Note: bus bytes])."""
    n = comm.size
    count = max(n, nbytes // 4 // n * n)
    full, part = np.zeros(count, np.float32), np.zeros(count // n, np.float32)
    if kind == "all_reduce":
        return (lambda: comm.all_reduce(full)), bus_bytes(kind, full.nbytes, n)
    if kind == "all_gather":
        return (lambda: comm.all_gather(part, full)), bus_bytes(kind, full.nbytes, n)
    if kind == "reduce_scatter":
        return (lambda: comm.reduce_scatter(full, part)), bus_bytes(kind, full.nbytes, n)
    if kind == "all_to_all":
        out = np.zeros_like(full)
        return (lambda: comm.all_to_all(full, out)), bus_bytes(kind, full.nbytes, n)
    peer = comm.rank ^ 1 if (comm.rank ^ 1) < n else comm.rank
    back = np.zeros_like(full)

    def swap():                      # pairs exchange a buffer, as pipeline stages do
        if peer != comm.rank:
            comm.mpi.Sendrecv(full, dest=peer, recvbuf=back, source=peer)
    return swap, full.nbytes


def _fit_collectives(world, repeats: int, say, rounds: int = 3) -> dict:
    """Each ``kind@n`` fitted as latency + bus bytes / bandwidth, from the median of the
    slowest rank's time at each size. The sizes and kinds are timed in ``rounds`` rounds
    (``repeats / 2`` each, at least 3), so that a burst of load on the machine falls on
    every kind and size alike."""
    out = {}
    for n in [d for d in range(2, world.size + 1) if world.size % d == 0]:
        comm = world.split(world.rank // n, key=world.rank, name=f"calibrate{n}")
        calls = {(kind, nbytes): _collective(comm, kind, nbytes) for kind in KINDS
                 for nbytes in (4 << 10, 64 << 10, 1 << 20, 4 << 20)}
        samples: dict = {key: [] for key in calls}
        for _ in range(rounds):
            for key, (fn, _) in calls.items():
                for _ in range(max(3, repeats // 2)):
                    world.barrier()
                    start = time.perf_counter()
                    fn()
                    samples[key].append(world.mpi.allreduce(time.perf_counter() - start,
                                                            MPI.MAX))
        for kind in KINDS:
            keys = [key for key in calls if key[0] == kind]
            latency, per_byte = fit_line([calls[key][1] for key in keys],
                                         [statistics.median(samples[key]) for key in keys])
            out[f"{kind}@{n}"] = {"latency_s": latency, "bandwidth": 1.0 / per_byte}
            say(f"  {kind}@{n}: latency {latency * 1e6:.1f} us, {1e-9 / per_byte:.2f} GB/s")
        comm.free()
    return out


def calibrate(world: Communicator, repeats: int = 7, name: str = "calibrated",
              shapes=None, block=(1024, 256, 4, 128), steps=None,
              ops: str = "layernorm-gelu") -> dict:
    """Measure this machine (collective over ``world``) on the products ``shapes``
    (:func:`model_shapes`), a block's elementwise ops of ``block`` = (rows, width,
    heads, sequence), each set of :data:`OP_SETS` (``ops``: the model's, its rate also
    ``activation_rate``), and ``steps`` (:func:`model_step`'s training steps on one
    rank; by default the products and the block's ops one after the other) run by 1 to
    all ranks at once; returns the description (rank 0's measurements, on every rank)."""
    def say(text):
        if world.rank == 0:
            print(f"calibrate: {text}", file=sys.stderr, flush=True)
    measured = None
    if world.rank != 0:      # wait asleep: a rank spinning in a barrier would take a core
        _sleep_until(world.mpi.Ibarrier())
    else:
        say(f"matrix products of {len(shapes)} shapes (float32, float64) ...")
        o32, r32 = _matmul(np.float32, repeats, shapes)
        o64, r64 = _matmul(np.float64, repeats, shapes)
        say(f"  float32 {r32 / 1e9:.1f} GFLOP/s, float64 {r64 / 1e9:.1f} GFLOP/s; "
            f"overhead {o32 * 1e6:.1f} us")
        say("elementwise passes ...")
        bandwidth = _elementwise(repeats)
        rates = {name: _activation_rate(*block, repeats, name) for name in OP_SETS}
        say(f"  {bandwidth / 1e9:.2f} GB/s streamed; the ops of a block get through "
            + ", ".join(f"{r / 1e9:.2f} GB/s ({name})" for name, r in rates.items())
            + " of kept activations")
        op = _op_overhead(repeats * 10)
        say(f"  autodiff op overhead {op * 1e6:.1f} us")
        opt_rates, opt_overhead, norm_rate = _optimizer(repeats)
        say("  AdamW: " + ", ".join(f"{r / 1e9:.2f} GB/s of model state from {b / 2**20:.0f} MiB"
                                    for b, r in opt_rates)
            + f", {opt_overhead * 1e6:.1f} us per target; the gradient norm "
            f"{norm_rate / 1e9:.2f} GB/s")
        measured = (o32, r32, r64, bandwidth, rates, op, opt_rates, opt_overhead, norm_rate)
        world.mpi.Ibarrier().Wait()
    o32, r32, r64, bandwidth, rates, op, opt_rates, opt_overhead, norm_rate = \
        world.broadcast_obj(measured, root=0)
    slowdown = {}
    if world.size > 1:
        say(f"ranks computing at once, 1..{world.size} ...")
        if steps is None:
            def steps(rows):
                products = _products([(max(1, m * rows // block[0]), k, n) for m, k, n in shapes])
                elementwise = _activation_step(rows, *block[1:], ops)[0]
                return lambda: (products(), elementwise())
        slowdown = _busy_slowdown(world, steps, block[0], max(3, repeats // 2), say)
    say(f"collectives over groups of 2..{world.size} ranks ...")
    collectives = _fit_collectives(world, repeats, say) if world.size > 1 else {}
    per_node = ranks_per_node(world)
    intra = collectives.get(f"all_reduce@{world.size}", {"latency_s": 1e-5, "bandwidth": 1e9})
    stamp = time.strftime("%Y-%m-%d")
    return {"name": name, "kind": "cpu", "ranks_per_node": per_node,
            "cores": os.cpu_count(), "overlap": False,
            "device": {"flops": {"float32": r32, "float64": r64, "bfloat16": r32,
                                 "float16": r32},
                       "matmul_efficiency": 1.0, "matmul_overhead_s": o32,
                       "memory_bytes": float(os.sysconf("SC_PAGE_SIZE")
                                             * os.sysconf("SC_PHYS_PAGES")),
                       "memory_bandwidth": bandwidth, "elementwise_efficiency": 1.0,
                       "activation_rate": rates[ops], "activation_rates": rates,
                       "op_overhead_s": op,
                       "optimizer_rate": opt_rates[0][1], "optimizer_rates": opt_rates,
                       "optimizer_overhead_s": opt_overhead, "grad_norm_rate": norm_rate},
            "links": {"intra": intra, "inter": intra},
            "collectives": collectives,
            "busy_slowdown": {str(n): f for n, f in slowdown.items()},
            "sources": {"*": f"measured by mpishard bench calibrate on {stamp}, "
                             f"{world.size} ranks, one BLAS thread per rank"}}


def _merge(paths: list, output: str, name: str) -> None:
    """``--merge``: the median of stored calibrations (:func:`merge_calibrations`),
    written to ``output`` by rank 0 (it measures nothing: run it without mpiexec; under
    it the other ranks do nothing); a bad or missing file is one ConfigError line."""
    from pathlib import Path

    from mpishard.config.sections import ConfigError
    from mpishard.planning.machine_file import merge_calibrations
    if MPI.COMM_WORLD.rank != 0:
        return
    if Path(output).resolve() in {Path(p).resolve() for p in paths}:
        raise ConfigError(f"--merge: the output {output} is one of the calibrations to "
                          f"merge; pass -o with a new file")
    named = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                named.append((path, json.load(f)))
        except OSError as err:
            raise ConfigError(f"--merge {path}: cannot read it ({err.strerror}); pass "
                              f"files written by `mpishard bench calibrate -o`") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"--merge {path}: not JSON ({err}); pass files written by "
                              f"`mpishard bench calibrate -o`") from None
    try:
        merged = merge_calibrations(named, name)
    except ValueError as err:
        raise ConfigError(f"--merge: {err}") from None
    write_json(output, merged)
    print(f"calibrate: wrote {output}, the median of {len(paths)} calibrations",
          file=sys.stderr)


def main(argv=None) -> None:
    from mpishard.config.flags import add_config_flags, config_from_args
    from mpishard.models import MODELS
    from mpishard.recipes import recipe_for

    parser = BenchParser(prog="mpishard bench calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", default="machine.json", help="where to write it "
                        "(default machine.json; missing folders are made)")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per point "
                        "(at least 1, default 7)")
    parser.add_argument("--name", default="calibrated", help="the description's name")
    parser.add_argument("--config", help="TOML file with training settings (the model)")
    parser.add_argument("--merge", nargs="+", metavar="MACHINE.json",
                        help="measure nothing (run it without mpiexec): write the median "
                             "of these calibrations (several launches of this command) to "
                             "--output")
    add_config_flags(parser, "estimate")
    args = parser.parse_args(argv)
    check_count(parser, "--repeats", args.repeats, 1, "the timed repeats per point", 7)
    check_output(parser, "-o", args.output, "machine.json")     # before minutes of measuring
    if args.merge:
        _merge(args.merge, args.output, args.name)
        return
    cfg = config_from_args(args)
    recipe = recipe_for(cfg)
    rows = cfg.optim.batch_size * recipe.tokens_per_sample
    model = recipe.model(Backend())
    shapes = model_shapes(model, rows)
    block = (rows, cfg.model.n_embd, cfg.model.n_head, recipe.tokens_per_sample)
    world = Communicator(MPI.COMM_WORLD)
    # every rank of a node trains its own copy (AdamW: 16 bytes a parameter); a model
    # too large for that is measured by its products and a block's ops instead
    state = 16 * model.num_parameters() * ranks_per_node(world)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    steps = model_step(model, recipe.tokens_per_sample, recipe.model_config().vocab_size) \
        if MODELS[cfg.model.name].task == "text" and state <= memory / 4 else None
    description = calibrate(world, args.repeats, args.name, shapes, block, steps,
                            MODELS[cfg.model.name].elementwise)
    if world.rank == 0:
        write_json(args.output, description)
        print(f"calibrate: wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
