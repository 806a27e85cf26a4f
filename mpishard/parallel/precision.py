"""Mixed precision: what dtype parameters compute in, gradients reduce in, and loss scaling.

    model = ZeRO(GPT(cfg, materialize_now=False), mesh, stage=3, precision="float16")
    opt = AdamW(model.parameters(), lr=3e-4)          # float32 master shards
    _, loss = model(x, y)
    model.scale_loss(loss).backward()                 # loss x the current scale
    result = model.step(opt, max_norm=1.0)            # unscale, clip, update or skip

[Note: mixed precision]
The model is built in float32; that copy is the *master*. A strategy with a
16-bit ``param_dtype`` keeps the master (whole under DDP, this rank's shard
under ZeRO) as the optimizer's target, with float32 optimizer state, and gives
the model a 16-bit copy to compute with: ZeRO-3 casts its shard once per step
and all-gathers 16-bit units (half the bytes), ZeRO-1/2 and DDP keep a 16-bit
copy of the whole model. Backward computes 16-bit gradients, but each
parameter's ``grad_dtype`` is ``reduce_dtype`` (float32 by default), so every
contribution (a tied weight's two uses, the micro-batches of a step) is added
in float32; the reduction and everything after it (norm, clipping, the
update) runs in float32 too.
After the update the master is cast back into the compute copy.

float16 has 5 exponent bits: gradients below about 6e-8 flush to zero. So the
loss is multiplied by a *loss scale* before backward (``scale_loss``), and
``step`` divides it out again, folded into the clipping factor. With
``loss_scale="dynamic"`` (the float16 default) the scale starts at 2**16,
halves whenever a step's gradients hold an inf or NaN (the step is skipped,
parameters and optimizer state untouched) and doubles after
``growth_interval`` clean steps in a row, as torch.amp.GradScaler does. The
overflow decision is the global gradient norm's, which one all-reduce over the
whole mesh makes the same on every rank (see [Note: collective step
decisions] in strategy.py), so all ranks skip together and keep the same scale.
On a device the scale, its clean-step count and the skip stay there, never read
inside a step (see [Note: device step decisions] in strategy.py).
bfloat16 has float32's exponent range and needs no scaling.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from mpishard.core.dtypes import FLOAT_DTYPES, LOW_PRECISION
from mpishard.parallel.flat import FlatShard

__all__ = ["Precision", "LossScaler", "MasterCopies", "PRECISIONS"]

#: names accepted wherever a precision is asked for (``--precision``)
PRECISIONS = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Precision:
    """A mixed-precision policy (see [Note: mixed precision]).

    Args:
        param_dtype: dtype parameters are gathered and computed in; ``None``
            computes in the model's own dtype (no mixed precision).
        reduce_dtype: dtype gradients are added and averaged in (``"float32"``, or the
            ``param_dtype`` to halve their bytes: FSDP2's ``reduce_dtype``; over MPI a
            16-bit reduction adds in float32 and rounds once, see [Note: 16-bit floats
            on MPI] in mpishard/comm/checks.py).
        loss_scale: ``"dynamic"``, a fixed positive number, or ``None`` (no scaling).
        init_scale, growth_factor, backoff_factor, growth_interval: the dynamic
            scale's start, its factors on growth and overflow, and the clean
            steps between growths.
    """

    param_dtype: str | None = None
    reduce_dtype: str = "float32"
    loss_scale: str | float | None = None
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self):
        if self.param_dtype is not None and self.param_dtype not in LOW_PRECISION:
            raise ValueError(f"Precision: param_dtype {self.param_dtype!r} is not one of "
                             f"{', '.join(LOW_PRECISION)} (None computes in the model's own "
                             f"dtype)")
        if self.reduce_dtype not in FLOAT_DTYPES:
            raise ValueError(f"Precision: reduce_dtype {self.reduce_dtype!r} is not one of "
                             f"{', '.join(FLOAT_DTYPES)}")
        if (self.param_dtype == "bfloat16" and self.reduce_dtype == "float16"
                and self.loss_scale is None):
            raise ValueError("Precision: bfloat16 gradients reduced in float16 without a loss "
                             "scale lose the small ones and overflow on large ones; use "
                             "reduce_dtype='float32' or set loss_scale")
        scale = self.loss_scale
        if not (scale is None or scale == "dynamic" or (
                isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0)):
            raise ValueError(f"Precision: loss_scale must be 'dynamic', a positive number or "
                             f"None, got {scale!r}")
        if not (self.growth_factor >= 1.0 and 0.0 < self.backoff_factor <= 1.0
                and self.init_scale > 0 and self.growth_interval >= 1):
            raise ValueError("Precision: need growth_factor >= 1, 0 < backoff_factor <= 1, "
                             "init_scale > 0 and growth_interval >= 1")

    @classmethod
    def of(cls, value) -> "Precision":
        """A policy from a name (``"float32"``, ``"float16"``, ``"bfloat16"``), a
        ``Precision``, or ``None`` (no mixed precision).

        ``"float16"`` means float16 compute, float32 reduction, dynamic loss
        scaling; ``"bfloat16"`` the same without scaling; ``"float32"`` (and
        ``"float64"``) compute in the model's dtype.
        """
        if value is None or isinstance(value, Precision):
            return value or cls()
        if value in ("float32", "float64"):
            return cls()
        if value == "float16":
            return cls("float16", loss_scale="dynamic")
        if value == "bfloat16":
            return cls("bfloat16")
        raise ValueError(f"unknown precision {value!r}; use one of {', '.join(PRECISIONS)} "
                         f"or a mpishard.parallel.Precision")

    @property
    def mixed(self) -> bool:
        """Whether parameters compute in a 16-bit dtype."""
        return self.param_dtype in LOW_PRECISION

    def reducing_in(self, dtype: str) -> "Precision":
        """This policy with its gradients added and reduced in ``dtype`` (``--reduce-dtype``);
        itself without mixed precision, where gradients are the model's dtype."""
        if not self.mixed or self.reduce_dtype == dtype:
            return self
        return replace(self, reduce_dtype=dtype)


class LossScaler:
    """The current loss scale and its dynamic update (see [Note: mixed precision]).

    With ``xp`` a device array module (CuPy, the strict module) a dynamic scale and its
    count of clean steps live on the device as 0-d float64 arrays, and :meth:`update`
    takes the step's overflow flag as a device boolean: nothing is read back inside a
    step (see [Note: device step decisions] in strategy.py). ``scale`` and
    ``clean_steps`` read them when asked (after the step: logging, checkpoints).
    """

    def __init__(self, precision: Precision, xp=None):
        self.precision = precision
        self.dynamic = precision.loss_scale == "dynamic"
        self._xp = xp if self.dynamic and xp is not None and xp.__name__ != "numpy" else None
        self.scale = float(precision.init_scale if self.dynamic else
                           (precision.loss_scale or 1.0))
        self.clean_steps = 0

    #: the dynamic scale never backs off below this (a run whose gradients
    #: overflow even here has non-finite values that no scale can fix)
    min_scale = 2.0 ** -24

    @property
    def on_device(self) -> bool:
        """Whether the scale is a device array (a dynamic scale on a device module)."""
        return self._xp is not None

    def _held(self, value):
        """``value`` as the scaler keeps its numbers: a 0-d float64 device array on a
        device, else the Python number itself."""
        return self._xp.full((), float(value), dtype="float64") if self.on_device else value

    @property
    def scale(self) -> float:
        """The current scale as a Python float (on a device: one read)."""
        return float(self._scale)

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = self._held(float(value))

    @property
    def clean_steps(self) -> int:
        return int(self._clean)

    @clean_steps.setter
    def clean_steps(self, value: int) -> None:
        self._clean = self._held(int(value))

    def device_scale(self, dtype):
        """The scale to multiply a loss of ``dtype`` by: a 0-d device array of that dtype
        on a device, else the Python float (cast as a Python scalar would be)."""
        return self._scale.astype(dtype) if self.on_device else self._scale

    def scale_value(self):
        """The scale as the step's arithmetic takes it: the float64 device array, or the
        Python float."""
        return self._scale

    def update(self, overflow) -> None:
        """After a step: back off on overflow, grow after enough clean steps.
        ``overflow`` is a bool, or on a device a 0-d boolean array."""
        if not self.dynamic:
            return
        p = self.precision
        if self.on_device:
            xp, scale, clean = self._xp, self._scale, self._clean + 1.0
            grow = clean >= p.growth_interval
            backed_off = xp.maximum(scale * p.backoff_factor, self.min_scale)
            self._scale = xp.where(overflow, backed_off,
                                   xp.where(grow, scale * p.growth_factor, scale))
            self._clean = xp.where(overflow | grow, 0.0, clean)
            return
        if overflow:
            self._scale = max(self._scale * p.backoff_factor, self.min_scale)
            self._clean = 0
        else:
            self._clean += 1
            if self._clean >= p.growth_interval:
                self._scale *= p.growth_factor
                self._clean = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "dynamic": self.dynamic}

    def load_state_dict(self, state: dict) -> None:
        """Resume a dynamic scale. A state saved without one (a float32, bfloat16 or
        fixed-scale run) leaves this scaler as its policy set it."""
        if not (self.dynamic and state.get("dynamic", False)):
            return
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])


class MasterCopies:
    """The float32 masters the optimizer updates, and the arrays the model computes with.

    The one place [Note: mixed precision] keeps its two copies, for DDP
    (per parameter) and ZeRO (per flat shard) alike. Each entry pairs a master
    -- a :class:`~mpishard.parallel.FlatShard`, the optimizer's target -- with
    the flat array the model reads: a 16-bit copy under mixed precision, the
    master's own storage otherwise (then :meth:`refresh` has nothing to do).
    """

    def __init__(self):
        self.pairs: list = []

    def add(self, master, compute, decay_ranges: tuple, name: str):
        """Pair ``master`` (1-D, the optimizer's values) with ``compute`` (1-D, the
        same elements in the compute dtype, or ``master`` itself); return the
        master's :class:`~mpishard.parallel.FlatShard`."""
        target = FlatShard(master, decay_ranges, name)
        self.pairs.append((target, compute))
        return target

    def targets(self) -> list:
        """The masters, in the order they were added."""
        return [target for target, _ in self.pairs]

    def refresh(self) -> None:
        """Cast every master into its compute copy (after an update or a load)."""
        for target, compute in self.pairs:
            if compute is not target.data:
                compute[...] = target.data
