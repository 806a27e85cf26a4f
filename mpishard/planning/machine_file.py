"""Reading machine descriptions: the JSON format's keys and the check of every field,
the shipped files, and merging several calibrations into one.

    machine = load_machine("h100-sxm")            # a shipped description (mpishard/machines/)
    machine = load_machine("machine.json")        # or a file, e.g. from `mpishard bench calibrate`

The format itself, and what each figure means to the step-time model, is the module
docstring of mpishard/planning/machine.py (:class:`Machine`, :class:`Link`). Every
field is checked as it is read: a wrong type, a value out of its range or a key the
format does not have is one ValueError naming the field and the fix.
"""
from __future__ import annotations

import difflib
import json
import math
import statistics
from pathlib import Path

from mpishard.core.dtypes import FLOAT_DTYPES
from mpishard.planning.machine import MACHINES_DIR, Link, Machine

__all__ = ["load_machine", "machine_from_dict", "merge_calibrations", "shipped_machines"]


#: the keys a description may have, by where they sit (see the module docstring); the
#: names under ``device.flops`` and ``device.vector_flops`` (:data:`_PEAK_DTYPES`),
#: ``device.activation_rates`` (:func:`_op_sets`) and ``collectives`` (checked by
#: :func:`_collective_key`) and ``busy_slowdown`` (rank counts) are checked apart;
#: those under ``sources`` are the description's own
_KEYS = {
    "": ("name", "kind", "ranks_per_node", "device", "links", "collectives", "overlap",
         "cores", "sources", "host_link", "host_memory_bandwidth", "busy_slowdown"),
    "device": ("flops", "matmul_efficiency", "matmul_overhead_s", "memory_bytes",
               "memory_bandwidth", "elementwise_efficiency", "op_overhead_s",
               "activation_rate", "activation_rates", "optimizer_rate",
               "optimizer_overhead_s", "optimizer_rates", "grad_norm_rate",
               "matmul_efficiency_table", "vector_flops", "vector_efficiency_table",
               "memory_efficiency_table", "flash_attention_efficiency", "launch_s",
               "memory_reserve_bytes"),
    "links": ("intra", "inter"),
}
#: the dtype names ``device.flops`` and ``device.vector_flops`` may give a peak for
_PEAK_DTYPES = FLOAT_DTYPES + ("tf32",)


def _op_sets() -> tuple:
    """The names ``device.activation_rates`` may calibrate: each family's blocks' ops
    (``ModelSpec.elementwise``)."""
    from mpishard.models import MODELS
    return tuple(dict.fromkeys(spec.elementwise for spec in MODELS.values()))


#: a link's keys; a calibrated collective's and the host link's are its cost line only
_LINK_KEYS = ("latency_s", "bandwidth", "gather_bandwidth", "processor_usage", "rails")
_LINE_KEYS = ("latency_s", "bandwidth")
#: the collective kinds ``collectives`` may calibrate (``"all_reduce@4"``)
_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def _object(raw, where: str, keys=None) -> dict:
    """``raw``, a JSON object (``None``: empty) whose keys are all in ``keys`` (any
    where ``keys`` is None), else a one-line ValueError naming ``where`` and, for an
    unknown key, the closest one it has."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"machine description: {where or 'the top level'} is a JSON "
                         f"{_kind(raw)}, not an object: write it as {{\"key\": value, ...}}")
    for key in raw:
        if keys is not None and key not in keys:
            match = difflib.get_close_matches(str(key), keys, n=1, cutoff=0.5)
            place = f"in {where}" if where else "at the top level"
            raise ValueError(f"machine description: unknown key {key!r} {place}; "
                             + (f"did you mean {match[0]!r}?" if match else
                                f"the keys there are {', '.join(keys)}")
                             + " (notes go in \"sources\")")
    return raw


def _collective_key(key: str) -> None:
    """``key`` of ``collectives``: ``kind@size``, ``kind@size/inter`` across nodes, else a
    one-line ValueError naming the closest kind."""
    kind, at, size = str(key).partition("@")
    size = size[:-len("/inter")] if size.endswith("/inter") else size
    if kind in _COLLECTIVES and at and size.isdigit() and int(size) >= 1:
        return
    match = difflib.get_close_matches(kind, _COLLECTIVES, n=1, cutoff=0.5)
    hint = f"; did you mean {str(key).replace(kind, match[0], 1)!r}?" \
        if match and match[0] != kind else ""
    raise ValueError(f"machine description: collectives key {key!r} must be kind@ranks or "
                     f"kind@ranks/inter (e.g. \"all_reduce@4\"), kind one of "
                     f"{', '.join(_COLLECTIVES)}{hint}")


def _share(value, where: str) -> float:
    """``value`` as a float: a share of a peak, above 0 and at most 1, else a one-line
    ValueError naming ``where``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or \
            not 0 < value <= 1:
        raise ValueError(f"machine description: {where}={value!r} must be in (0, 1], a "
                         f"share of the peak (0.8 for 80%)")
    return float(value)


def _count(value, where: str, what: str) -> int:
    """``value``: a whole number >= 1 (``what`` it counts), else a one-line ValueError
    naming ``where``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"machine description: {where}={value!r} must be an integer >= 1 "
                         f"({what})")
    return value


def _positive(value, where: str, zero: bool = False) -> float:
    """``value`` as a float: a finite number above 0 (``zero``: at least 0), else a
    one-line ValueError naming ``where``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not \
            math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise ValueError(f"machine description: {where}={value!r} must be a "
                         + ("number >= 0" if zero else "positive number"))
    return float(value)


def _rates(raw, where: str) -> tuple:
    """``((from_bytes, rate), ...)`` of a description's ``[[bytes, rate], ...]``, ascending."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(row, list) and len(row) == 2
                                            for row in raw):
        raise ValueError(f"machine description: {where}={raw!r} must be [[bytes, rate], ...]")
    return tuple(sorted((_positive(b, f"{where}[{i}] bytes", zero=True),
                         _positive(r, f"{where}[{i}] rate")) for i, (b, r) in enumerate(raw)))


def _link(raw: dict, where: str, keys=_LINK_KEYS) -> Link:
    if not isinstance(raw, dict):
        raise ValueError(f"machine description: {where} must be an object with latency_s "
                         f"and bandwidth")
    _object(raw, where, keys)
    latency = raw.get("latency_s", 0.0)
    if not isinstance(latency, (int, float)) or isinstance(latency, bool) or \
            not math.isfinite(latency) or latency < 0:
        raise ValueError(f"machine description: {where}.latency_s={latency!r} must be >= 0")
    gather = raw.get("gather_bandwidth")
    usage = raw.get("processor_usage", 0.0)
    if not isinstance(usage, (int, float)) or isinstance(usage, bool) or not 0 <= usage < 1:
        raise ValueError(f"machine description: {where}.processor_usage={usage!r} must be in "
                         f"[0, 1)")
    rails = raw.get("rails", 1)
    if not isinstance(rails, int) or isinstance(rails, bool) or rails < 1:
        raise ValueError(f"machine description: {where}.rails={rails!r} must be an integer "
                         f">= 1 (the ranks of a node with a NIC of their own)")
    return Link(float(latency), _positive(raw.get("bandwidth"), f"{where}.bandwidth"),
                _positive(gather, f"{where}.gather_bandwidth") if gather is not None else None,
                float(usage), rails)


def machine_from_dict(raw: dict) -> Machine:
    """A :class:`Machine` from a parsed description; a one-line ValueError naming a bad
    field or a key the format does not have."""
    raw = _object(raw, "", _KEYS[""])
    device = _object(raw.get("device"), "device", _KEYS["device"])
    links = _object(raw.get("links"), "links", _KEYS["links"])
    flops = _object(device.get("flops"), "device.flops", _PEAK_DTYPES)
    if not flops:
        raise ValueError("machine description: device.flops needs at least one dtype's "
                         "peak FLOP/s, e.g. {\"float32\": 1e11}")
    for dtype, value in flops.items():
        _positive(value, f"device.flops.{dtype}")
    kind = raw.get("kind", "gpu")
    if kind not in ("gpu", "cpu"):
        raise ValueError(f"machine description: kind={kind!r} must be 'gpu' or 'cpu'")
    collectives = _object(raw.get("collectives") or {}, "collectives")   # [] in GPU files
    for key, value in collectives.items():
        _collective_key(key)
        _link(value, f"collectives.{key}", _LINE_KEYS)
    overlap = raw.get("overlap", True)
    if not isinstance(overlap, bool):
        raise ValueError(f"machine description: overlap={overlap!r} must be true or false")
    memory = _positive(device.get("memory_bytes"), "device.memory_bytes")
    reserve = _positive(device.get("memory_reserve_bytes", 0.0),
                        "device.memory_reserve_bytes", zero=True)
    if reserve >= memory:
        raise ValueError(f"machine description: device.memory_reserve_bytes={reserve:g} "
                         f"must be below device.memory_bytes={memory:g}")

    def rate(key):          # optional, calibrated
        return _positive(device[key], f"device.{key}") if device.get(key) is not None \
            else None
    return Machine(
        name=str(raw.get("name", "machine")), kind=kind,
        ranks_per_node=_count(raw.get("ranks_per_node", 1), "ranks_per_node",
                              "ranks on each node"),
        flops={k: float(v) for k, v in flops.items()},
        matmul_efficiency=_share(device.get("matmul_efficiency", 1.0),
                                 "device.matmul_efficiency"),
        matmul_overhead_s=_positive(device.get("matmul_overhead_s", 0.0),
                                    "device.matmul_overhead_s", zero=True),
        memory_bytes=memory,
        memory_bandwidth=_positive(device.get("memory_bandwidth"), "device.memory_bandwidth"),
        elementwise_efficiency=_share(device.get("elementwise_efficiency", 1.0),
                                      "device.elementwise_efficiency"),
        op_overhead_s=_positive(device.get("op_overhead_s", 0.0), "device.op_overhead_s",
                                zero=True),
        activation_rate=rate("activation_rate"),
        activation_rates={str(k): _positive(v, f"device.activation_rates.{k}")
                          for k, v in _object(device.get("activation_rates"),
                                              "device.activation_rates", _op_sets()).items()},
        optimizer_rate=rate("optimizer_rate"),
        optimizer_overhead_s=_positive(device.get("optimizer_overhead_s", 0.0),
                                       "device.optimizer_overhead_s", zero=True),
        optimizer_rates=_rates(device.get("optimizer_rates"), "device.optimizer_rates"),
        grad_norm_rate=rate("grad_norm_rate"),
        intra=_link(links.get("intra"), "links.intra"),
        inter=_link(links.get("inter", links.get("intra")), "links.inter"),
        collectives=dict(collectives), overlap=overlap,
        cores=_count(raw["cores"], "cores", "a CPU's cores on each node; null on a GPU")
        if raw.get("cores") is not None else None,
        sources=dict(_object(raw.get("sources"), "sources")),
        matmul_efficiency_table=_table(device.get("matmul_efficiency_table"),
                                       "device.matmul_efficiency_table"),
        vector_flops={k: _positive(v, f"device.vector_flops.{k}")
                      for k, v in _object(device.get("vector_flops"),
                                          "device.vector_flops", _PEAK_DTYPES).items()},
        vector_efficiency_table=_table(device.get("vector_efficiency_table"),
                                       "device.vector_efficiency_table") or ((0, 1.0),),
        memory_efficiency_table=_table(device.get("memory_efficiency_table"),
                                       "device.memory_efficiency_table") or ((0, 1.0),),
        flash_attention_efficiency=_share(device.get("flash_attention_efficiency", 0.5),
                                          "device.flash_attention_efficiency"),
        launch_s=_positive(device.get("launch_s", 0.0), "device.launch_s", zero=True),
        memory_reserve_bytes=reserve,
        host_link=_link(raw["host_link"], "host_link", _LINE_KEYS) if raw.get("host_link")
        else None,
        host_memory_bandwidth=_positive(raw["host_memory_bandwidth"], "host_memory_bandwidth")
        if raw.get("host_memory_bandwidth") is not None else None,
        busy_slowdown=_slowdowns(_object(raw.get("busy_slowdown"), "busy_slowdown")))


def _slowdowns(raw: dict) -> dict:
    """``busy_slowdown`` (``{"4": 2.6}``: ranks at once -> times alone) with int keys."""
    out = {}
    for n, factor in raw.items():
        if not str(n).isdigit() or int(n) < 1:
            raise ValueError(f"machine description: busy_slowdown key {n!r} must be a rank "
                             f"count, e.g. {{\"4\": 2.6}}")
        out[int(n)] = _positive(factor, f"busy_slowdown.{n}")
    return out


def _table(raw, where: str):
    """A size -> efficiency table (``[[size, efficiency], ...]``, sizes descending, the
    last 0: Calculon's format), as a tuple of pairs; None when absent."""
    if raw is None:
        return None
    try:
        rows = tuple((_positive(a, where, zero=True), _positive(b, where)) for a, b in raw)
    except (TypeError, ValueError):                    # not pairs of numbers
        rows = ()
    sizes = [a for a, _ in rows]
    if not rows or sizes != sorted(sizes, reverse=True) or sizes[-1] != 0 or \
            not all(0 < b <= 1 for _, b in rows):
        raise ValueError(f"machine description: {where}={raw!r} must be [[size, efficiency], "
                         f"...] with sizes descending to 0 and efficiencies in (0, 1]")
    return rows


def shipped_machines() -> list:
    """Names of the descriptions shipped with mpishard."""
    return sorted(p.stem for p in MACHINES_DIR.glob("*.json") if not p.stem.startswith("_"))


def load_machine(name_or_path) -> Machine:
    """A shipped description by name (``"h100-sxm"``) or a JSON file's path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = MACHINES_DIR / f"{name_or_path}.json"
    if not path.exists():
        raise ValueError(f"no machine description {name_or_path!r}: pass a JSON file (e.g. "
                         f"from `mpishard bench calibrate -o machine.json`) or one of "
                         f"{', '.join(shipped_machines())}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"machine description {path}: cannot read it ({err.strerror}); "
                         f"pass a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"machine description {path}: not JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"machine description {path}: the file holds a JSON {_kind(raw)}, "
                         f"not an object; a description is one JSON object, as `mpishard "
                         f"bench calibrate -o machine.json` writes")
    return machine_from_dict(raw)


def merge_calibrations(named: list, name: str = "calibrated") -> dict:
    """One description from several calibrations of the same machine (``named``:
    ``[(label, description dict), ...]``, e.g. the files of three launches of
    ``mpishard bench calibrate``): every measured number the median over them (each on
    its own: a collective's latency and bandwidth may come from different launches). One
    launch lands where that launch's machine state put it (rates move by 5-20% between
    launches on a shared node, collectives by how the ranks were placed); the median
    of three is steadier than any one. The descriptions must agree in everything but
    their numbers (kind, cores, ranks per node, the same collectives and group sizes,
    the optimizer's path thresholds, the kind of every value); else a one-line
    ValueError naming the first difference and the two labels."""
    if len(named) < 2:
        raise ValueError(f"merging calibrations needs two or more descriptions, got "
                         f"{len(named)}: pass the files of two or more launches")
    for label, raw in named:
        if not isinstance(raw, dict):
            raise ValueError(f"{label}: not a machine description (a JSON object); pass "
                             f"files written by `mpishard bench calibrate -o`")
        try:
            machine_from_dict(raw)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{label}: {err}") from None
        if raw.get("kind") != "cpu":
            raise ValueError(f"{label}: kind={raw.get('kind')!r}: only calibrations "
                             f"(kind 'cpu', from `mpishard bench calibrate`) are merged")
    first = named[0][0]
    others = [label for label, _ in named[1:]]

    def merged(values: list, where: str):
        head = values[0]
        for label, value in zip(others, values[1:]):
            if _kind(value) != _kind(head):
                raise ValueError(f"{first} and {label} differ at {where[:-1] or 'the top'} "
                                 f"(a {_kind(head)} against a {_kind(value)}): merge "
                                 f"calibrations of the same machine and mpishard version")
        if isinstance(head, dict):
            for label, value in zip(others, values[1:]):
                if set(value) != set(head):
                    key = sorted(set(value) ^ set(head))[0]
                    holder = first if key in head else label
                    raise ValueError(f"{first} and {label} differ at {where}{key} (only "
                                     f"{holder} has it): merge calibrations taken with the "
                                     f"same ranks and mpishard version")
            return {k: merged([v[k] for v in values], f"{where}{k}.") for k in head}
        if isinstance(head, list):
            for label, value in zip(others, values[1:]):
                if len(value) != len(head):
                    raise ValueError(f"{first} and {label} differ at {where[:-1]} "
                                     f"({len(head)} against {len(value)} entries): merge "
                                     f"calibrations of the same mpishard version")
            return [merged([v[i] for v in values], f"{where}{i}.") for i in range(len(head))]
        if _kind(head) == "number" and not _must_agree(where):
            return statistics.median(values)
        for label, value in zip(others, values[1:]):
            if value != head:
                raise ValueError(f"{first} and {label} differ at {where[:-1]} "
                                 f"({head!r} against {value!r}): merge calibrations of "
                                 f"the same machine and ranks")
        return head

    out = merged([{k: v for k, v in raw.items() if k not in ("name", "sources")}
                  for _, raw in named], "")
    stamps = "; ".join(f"{label}: {(raw.get('sources') or {}).get('*', 'no source given')}"
                       for label, raw in named)
    return {"name": name, **out,
            "sources": {"*": f"the median of {len(named)} calibrations ({stamps})"}}


def _kind(value) -> str:
    """What a description's value is, for merged calibrations to agree on."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if value is None:
        return "null"
    return {dict: "object", list: "list", str: "string"}.get(type(value), type(value).__name__)


def _must_agree(where: str) -> bool:
    """Whether the number at ``where`` (``"cores."``) is a fact merged calibrations must
    agree on (the node's shape, its memory, the optimizer's path thresholds), not a
    measurement to take the median of."""
    return where in ("ranks_per_node.", "cores.", "device.memory_bytes.") or \
        (where.startswith("device.optimizer_rates.") and where.endswith(".0."))
