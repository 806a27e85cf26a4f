"""The strict module's array: NumPy memory and arithmetic behind CuPy's rules.

An :class:`ndarray` wraps one ``numpy.ndarray`` (``_a``) and behaves the way a
``cupy.ndarray`` does where the two libraries differ:

* no implicit conversion to host memory: ``np.asarray(a)`` (and any NumPy
  function that would convert) raises ``TypeError``, as CuPy's ``__array__``
  does; ``a.get()`` is the explicit copy;
* NumPy arrays are not accepted as operands (``a + np_array`` and
  ``np_array + a`` raise ``TypeError: Unsupported type``), Python and NumPy
  scalars are; assigning a non-scalar NumPy array into a slice raises;
* reductions and integer indexing return 0-d arrays, never Python or NumPy
  scalars;
* every read of a value on the host (``bool``, ``int``, ``float``, ``item``,
  ``tolist``, ``get``, printing, pickling, and outputs whose shape depends on
  the data) is a host sync, counted in :data:`~mpishard.testing.strict.syncs.syncs`;
* float16 and bfloat16 matrix products accumulate in float32, as cuBLAS does
  (bfloat16 ones of more than two dimensions raise, as in CuPy 14);
* ``__cuda_array_interface__`` is exposed (pointing at the host memory), so
  code that tells device arrays from host ones takes the device path;
* every operator, method and index that computes or writes memory counts one
  kernel launch in :data:`~mpishard.testing.strict.syncs.syncs` (arithmetic in place
  too, reductions, ``@``, ``astype``, gathers, ``a[...] = v``, ``set``); views
  (``.T``, basic slicing, a ``reshape`` NumPy does without copying), host
  reads and attributes count none.
"""
from __future__ import annotations

import numpy as np

from mpishard.testing.strict.attributes import Flags as _Flags, Pointer as _Pointer
from mpishard.testing.strict.copies import hidden_copies
from mpishard.testing.strict.indexing import advanced as _advanced, data_dependent as _data_dependent
from mpishard.testing.strict.syncs import syncs

__all__ = ["ndarray", "wrap", "unwrap", "promoted", "SCALAR_TYPES"]

#: ``launch(name)`` counts one kernel launch (``syncs.launch``, bound once: it is on
#: every operation's path)
launch = syncs.launch

SCALAR_TYPES = (int, float, complex, bool, np.generic)
#: the 16-bit floats whose products cuBLAS accumulates in float32
SIXTEEN_BIT = ("float16", "bfloat16")


def _unsupported(x):
    return TypeError(f"Unsupported type {type(x)}")


def wrap(x):
    """NumPy results as strict arrays (scalars as 0-d arrays); anything else as is."""
    if isinstance(x, np.ndarray):
        return ndarray._of(x)
    if isinstance(x, np.generic):
        return ndarray._of(np.asarray(x))
    if isinstance(x, tuple):
        return tuple(wrap(i) for i in x)
    if isinstance(x, list):
        return [wrap(i) for i in x]
    return x


def unwrap(x, host_ok: bool = False):
    """The NumPy arrays behind strict arrays (in lists and tuples too); a NumPy array
    raises ``TypeError`` unless ``host_ok`` (a host-to-device copy, e.g. ``asarray``)."""
    if type(x) is ndarray:
        return x._a
    if isinstance(x, np.ndarray):
        if host_ok:
            return x
        raise _unsupported(x)
    if isinstance(x, (list, tuple)):
        return type(x)(unwrap(i, host_ok) for i in x)
    return x


def _operand(x):
    """A binary operator's other side: the NumPy array behind it, or ``NotImplemented``."""
    if type(x) is ndarray:
        return x._a
    if isinstance(x, SCALAR_TYPES):
        return x
    if isinstance(x, np.ndarray):
        raise _unsupported(x)
    return NotImplemented


def _index(index):
    """An index for the NumPy array: strict arrays unwrapped (NumPy arrays and lists
    are accepted, as CuPy copies them to the device)."""
    if type(index) is ndarray:
        return index._a
    if isinstance(index, tuple):
        syncs.copy_in(sum(isinstance(i, (np.ndarray, list)) for i in index))
        return tuple(i._a if type(i) is ndarray else i for i in index)
    if isinstance(index, (np.ndarray, list)):
        syncs.copy_in()
    return index


#: how NumPy's ufuncs and functions find the strict ones (set by .namespace, which
#: builds on this module)
PROTOCOLS: dict = {}


def _rebuild(host: np.ndarray) -> "ndarray":
    """Unpickle: the host copy back on the "device"."""
    return ndarray._of(host)


def matmul(a, b, out=None, name: str = "matmul"):
    """``a @ b``; 16-bit operands (float16, bfloat16) multiply in float32 and round
    once (as cuBLAS). One launch (named ``name``), and the copies CuPy's ``matmul``
    makes around its cuBLAS call (:func:`hidden_copies`), each counted as a
    ``"matmul-copy"``. bfloat16 products of more than two dimensions raise, as they
    fail in CuPy 14 (cupy#10317)."""
    launch(name)
    copies = hidden_copies(a, b, out)
    if copies:
        launch("matmul-copy", copies)
    sixteen = a.dtype == b.dtype and a.dtype.name in SIXTEEN_BIT
    if sixteen and a.dtype.name == "bfloat16" and max(a.ndim, b.ndim) > 2:
        raise NotImplementedError(f"matmul: CuPy 14 fails on bfloat16 products of more than "
                                  f"two dimensions (shapes {a.shape} @ {b.shape}, cupy#10317); "
                                  f"use mpishard.kernels.cuda.gemm.batched_matmul")
    with quiet():
        if sixteen:
            result = np.matmul(a.astype(np.float32), b.astype(np.float32))
            if out is None:
                return result.astype(a.dtype)
            out[...] = result
            return out
        return np.matmul(a, b) if out is None else np.matmul(a, b, out=out)


def quiet():
    """NumPy's floating-point warnings off: CuPy's kernels never warn (NaN and inf
    just appear)."""
    return np.errstate(all="ignore")


def promoted(result, *operands):
    """``result`` as CuPy 14 types it: a bfloat16 array (0-d ones too: CuPy types them
    as arrays) met with a bare Python float gives float32 there, where NumPy keeps
    bfloat16 (seen on an H100 for ``a * 2.0``, ``2.0 * a`` and ``a + np.float32(1)``,
    the last NumPy's typing too); ``result`` as is otherwise (see [Note: bfloat16 on
    devices] in mpishard/core/dtypes.py)."""
    if (getattr(result, "dtype", None) is not None and result.dtype.name == "bfloat16"
            and any(type(o) is float for o in operands)):
        return np.asarray(result, dtype=np.float32)
    return result


def _binary(ufunc, reflected=False):
    name = ufunc.__name__

    def op(self, other):
        o = _operand(other)
        if o is NotImplemented:
            return NotImplemented
        launch(name)
        with quiet():
            return wrap(promoted(ufunc(o, self._a) if reflected else ufunc(self._a, o), o))
    return op


def _inplace(ufunc):
    name = ufunc.__name__

    def op(self, other):
        o = _operand(other)
        if o is NotImplemented:
            return NotImplemented
        launch(name)
        with quiet():
            ufunc(self._a, o, out=self._a)
        return self
    return op


def _method(name, view: bool = False):
    """``ndarray.name`` run by NumPy: one launch, or none for a ``view`` method whose
    result shares the array's memory (a view, as on CuPy; a copy is a launch)."""
    def method(self, *args, **kwargs):
        result = getattr(self._a, name)(*unwrap(args), **{
            k: unwrap(v) for k, v in kwargs.items()})
        if not (view and np.may_share_memory(result, self._a)):
            launch(name)
        out = kwargs.get("out")
        return out if isinstance(out, ndarray) else wrap(result)   # CuPy returns ``out``
    method.__name__ = name
    return method


def _unary(ufunc):
    name = ufunc.__name__

    def op(self):
        launch(name)
        return ndarray._of(ufunc(self._a))
    return op


_EQ, _NE = _binary(np.equal), _binary(np.not_equal)


class ndarray:
    """A strict (CuPy-like) array over host memory; see the module docstring."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100     # below Tensor's, so ``array + tensor`` is the Tensor's op
    __hash__ = None

    def __init__(self, shape, dtype=float, order="C"):
        self._a = np.empty(shape, dtype=dtype, order=order)

    @classmethod
    def _of(cls, a: np.ndarray) -> "ndarray":
        out = object.__new__(cls)
        out._a = a
        return out

    # -- facts ----------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    T = property(lambda self: ndarray._of(self._a.T))
    mT = property(lambda self: ndarray._of(self._a.mT))
    real = property(lambda self: wrap(self._a.real))
    imag = property(lambda self: wrap(self._a.imag))
    flags = property(lambda self: _Flags(self._a))
    data = property(lambda self: _Pointer(self._a.__array_interface__["data"][0]))

    @property
    def __cuda_array_interface__(self) -> dict:
        a = self._a
        return {"shape": a.shape, "typestr": a.dtype.str, "version": 3,
                "data": (a.__array_interface__["data"][0], not a.flags.writeable),
                "strides": None if a.flags.c_contiguous else a.strides}

    def __len__(self) -> int:
        if self._a.ndim == 0:
            raise TypeError("len() of unsized object")
        return len(self._a)

    def __iter__(self):
        if self._a.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (ndarray._of(self._a[i]) if self._a.ndim > 1 else wrap(self._a[i])
                for i in range(len(self._a)))

    # -- the host boundary: explicit copies, counted reads ---------------------
    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def get(self, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
        """Copy to a new host array (or into ``out``): a host sync."""
        syncs.record("get")
        if out is None:
            return np.array(self._a, order=order, copy=True)
        if not isinstance(out, np.ndarray) or out.shape != self._a.shape:
            raise ValueError("Shape mismatch: out must be a NumPy array of the same shape")
        out[...] = self._a
        return out

    def set(self, arr, stream=None) -> None:
        """Copy host array ``arr`` (same shape and dtype) in: no sync, one launch."""
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr)}")
        if arr.dtype != self._a.dtype or arr.shape != self._a.shape:
            raise ValueError(f"set: shape {arr.shape} / dtype {arr.dtype} do not match "
                             f"{self._a.shape} / {self._a.dtype}")
        launch("set")       # a host-to-device copy on the stream
        syncs.copy_in()
        self._a[...] = arr

    def item(self):
        if self._a.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        syncs.record("item")
        return self._a.item()

    def tolist(self):
        syncs.record("tolist")
        return self._a.tolist()

    def __bool__(self) -> bool:
        if self._a.size == 1:
            syncs.record("bool")
        return bool(self._a)

    def __int__(self) -> int:
        syncs.record("int")
        return int(self._a)

    def __float__(self) -> float:
        syncs.record("float")
        return float(self._a)

    def __complex__(self) -> complex:
        syncs.record("complex")
        return complex(self._a)

    def __repr__(self) -> str:
        syncs.record("repr", refusable=False)
        return repr(self._a).replace("array(", "strict.array(", 1)

    def __str__(self) -> str:
        syncs.record("str", refusable=False)
        return str(self._a)

    def __format__(self, spec: str) -> str:
        syncs.record("format")
        return format(self._a if self._a.ndim else self._a.item(), spec)

    def __reduce__(self):
        return _rebuild, (self.get(),)

    # -- NumPy protocols: NumPy functions on strict arrays run on them ----------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return PROTOCOLS["ufunc_call"](ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        mine = PROTOCOLS["function_for"](func)
        if mine is None or not all(issubclass(t, (ndarray, np.ndarray)) for t in types):
            return NotImplemented
        return mine(*args, **kwargs)

    # -- indexing ---------------------------------------------------------------
    def __getitem__(self, index):
        index = _index(index)
        if _advanced(index):
            if _data_dependent(index):
                syncs.record("boolean index")   # the output's size is read back
            launch("take")      # a gather; anything else is a view
        return wrap(self._a[index])

    def __setitem__(self, index, value):
        index = _index(index)
        if type(value) is ndarray:
            value = value._a
        elif isinstance(value, np.ndarray) and value.ndim and all(
                not isinstance(i, (np.ndarray, list)) for i in
                (index if isinstance(index, tuple) else (index,))):
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        elif isinstance(value, (list, tuple)):
            raise _unsupported(value)
        elif isinstance(value, np.ndarray):
            syncs.copy_in()        # host data onto the device
        launch("scatter" if _advanced(index) else "setitem")
        self._a[index] = value

    # -- methods ----------------------------------------------------------------
    def __matmul__(self, other):
        if type(other) is not ndarray:
            if isinstance(other, np.ndarray):
                raise _unsupported(other)
            return NotImplemented
        return wrap(matmul(self._a, other._a))

    def __rmatmul__(self, other):
        if isinstance(other, np.ndarray):
            raise _unsupported(other)
        return NotImplemented

    def dot(self, b, out=None):
        return wrap(matmul(self._a, unwrap(b), None if out is None else out._a, name="dot"))

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        result = self._a.astype(dtype, order=order, copy=copy)
        if result is self._a:                   # copy=False and nothing to convert
            return self
        launch("astype")
        return ndarray._of(result)

    def nonzero(self):
        syncs.record("nonzero")
        return wrap(self._a.nonzero())

    def __eq__(self, other):
        if other is None or (not isinstance(other, SCALAR_TYPES + (ndarray, np.ndarray))
                             and type(other).__eq__ is object.__eq__):
            launch("equal")
            return ndarray._of(np.zeros(self._a.shape, dtype=bool))
        return _EQ(self, other)

    def __ne__(self, other):
        if other is None or (not isinstance(other, SCALAR_TYPES + (ndarray, np.ndarray))
                             and type(other).__eq__ is object.__eq__):
            launch("not_equal")
            return ndarray._of(np.ones(self._a.shape, dtype=bool))
        return _NE(self, other)

    __neg__ = _unary(np.negative)
    __pos__ = _unary(np.positive)
    __abs__ = _unary(np.absolute)
    __invert__ = _unary(np.invert)


_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.true_divide,
           "floordiv": np.floor_divide, "mod": np.remainder, "pow": np.power,
           "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
           "lshift": np.left_shift, "rshift": np.right_shift}
for _name, _ufunc in _BINARY.items():
    setattr(ndarray, f"__{_name}__", _binary(_ufunc))
    setattr(ndarray, f"__r{_name}__", _binary(_ufunc, reflected=True))
    setattr(ndarray, f"__i{_name}__", _inplace(_ufunc))
for _name, _ufunc in {"lt": np.less, "le": np.less_equal, "gt": np.greater,
                      "ge": np.greater_equal}.items():
    setattr(ndarray, f"__{_name}__", _binary(_ufunc))
ndarray.__divmod__ = _binary(np.divmod)

# Methods CuPy's ndarray has, run by NumPy on the memory behind it: views (a launch
# only when NumPy has to copy), then the ones that compute or write (one launch each).
for _name in ("reshape", "transpose", "swapaxes", "ravel", "squeeze", "view", "diagonal"):
    setattr(ndarray, _name, _method(_name, view=True))
for _name in ("flatten", "copy", "sum", "prod", "mean", "var", "std", "max", "min", "argmax",
              "argmin", "any", "all", "cumsum", "cumprod", "clip", "fill", "round", "conj",
              "trace", "take", "repeat", "sort", "argsort", "partition", "argpartition",
              "put"):
    setattr(ndarray, _name, _method(_name))
del _name, _ufunc
