"""The strict module's functions: CuPy's namespace, computed by NumPy.

Only names CuPy's top-level namespace has exist here (:data:`CUPY_NAMES`), so
code that runs on the strict module finds the same functions on CuPy. Each is
NumPy's function with strict arrays unwrapped on the way in and wrapped on the
way out; NumPy arrays are refused as operands, as CuPy refuses them (only the
array constructors, ``asarray`` and ``array``, copy host data in). Ufuncs keep
their ``out=``, ``at``, ``reduce``, ``accumulate``, ``reduceat`` and ``outer``.

Each call that computes or writes array memory counts one kernel launch in
:data:`~mpishard.testing.strict.syncs.syncs`, named after the function: a ufunc call
(``"exp"``, with ``out=`` too) and its methods (``"add.reduce"``, ``"add.at"``,
...), every function that returns a new array (reductions, ``einsum``,
``concatenate``/``stack``, ``where``, ``zeros``/``ones``/``full``/``arange``,
``copy``, ...) or writes into one (``copyto``, ``put``, ...), ``matmul``/``dot``,
``scatter_add``, and ``asarray``/``array`` when they copy (host data comes in by a
copy on the stream). Not launches: ``empty``/``empty_like`` (nothing written),
functions that give a view of their argument (``reshape``, ``transpose``,
``broadcast_to``, ``split``, ... unless NumPy has to copy), queries that return
no array (``shape``, ``result_type``, ...), and ``stage_for_mpi`` (counted in
``syncs.staged``). (NumPy's functions called on strict arrays come here through
``__array_function__`` and ``__array_ufunc__``, so they count the same.)
"""
from __future__ import annotations

import functools

import numpy as np

from mpishard.testing.strict.array import (PROTOCOLS, SCALAR_TYPES, SIXTEEN_BIT, launch,
                                           matmul as _matmul, ndarray, promoted, quiet, unwrap,
                                           wrap)
from mpishard.testing.strict.syncs import syncs

__all__ = ["CUPY_NAMES", "lookup", "ufunc", "ufunc_call", "function_for", "asarray", "array",
           "asnumpy", "scatter_add", "stage_for_mpi", "matmul", "dot", "where"]

#: NumPy names that CuPy's top-level namespace also has (CuPy v14's ``cupy/__init__.py``),
#: less file I/O, printing and index tricks.
CUPY_NAMES = frozenset("""
abs absolute acos acosh add all allclose amax amin angle any append apply_along_axis
apply_over_axes arange arccos arccosh arcsin arcsinh arctan arctan2 arctanh argmax argmin
argpartition argsort argwhere around array_equal array_equiv array_split asanyarray
asarray_chkfinite ascontiguousarray asfortranarray asin asinh astype atan atan2 atanh
atleast_1d atleast_2d atleast_3d average bartlett base_repr binary_repr bincount bitwise_and
bitwise_count bitwise_invert bitwise_left_shift bitwise_not bitwise_or bitwise_right_shift
bitwise_xor blackman bool_ broadcast_arrays broadcast_to byte can_cast cbrt cdouble ceil choose
clip column_stack common_type complex128 complex64 complexfloating compress concat concatenate
conj conjugate convolve copy copysign copyto corrcoef correlate cos cosh count_nonzero cov cross
csingle cumprod cumsum cumulative_prod cumulative_sum deg2rad degrees delete diag diag_indices
diag_indices_from diagflat diagonal diff digitize divide divmod double dsplit dstack dtype e
ediff1d einsum empty empty_like equal euler_gamma exp exp2 expand_dims expm1 extract eye fabs
fill_diagonal finfo fix flatnonzero flip fliplr flipud float16 float32 float64 float_power
floating floor floor_divide fmax fmin fmod frexp fromfunction full full_like gcd generic
gradient greater greater_equal half hamming hanning heaviside histogram histogram2d histogramdd
hsplit hstack hypot i0 identity iinfo imag indices inexact inf inner int16 int32 int64 int8
int_ intc integer interp intersect1d intp invert isclose iscomplex iscomplexobj isdtype isfinite
isfortran isin isinf isnan isneginf isposinf isreal isrealobj isscalar issubdtype iterable ix_
kaiser kron lcm ldexp left_shift less less_equal lexsort linspace log log10 log1p log2 logaddexp
logaddexp2 logical_and logical_not logical_or logical_xor logspace longlong mask_indices
matrix_transpose max maximum may_share_memory mean median meshgrid min min_scalar_type minimum
mintypecode mod modf moveaxis multiply nan nan_to_num nanargmax nanargmin nancumprod nancumsum
nanmax nanmean nanmedian nanmin nanprod nanstd nansum nanvar ndim negative newaxis nextafter
nonzero not_equal number ones ones_like outer packbits pad partition percentile permute_dims pi
piecewise place poly polyadd polyfit polymul polysub polyval positive pow power prod
promote_types ptp put put_along_axis putmask quantile rad2deg radians ravel ravel_multi_index
real real_if_close reciprocal remainder repeat require reshape resize result_type right_shift
rint roll rollaxis roots rot90 round row_stack searchsorted select setdiff1d setxor1d shape
shares_memory short sign signbit signedinteger sin sinc single sinh size sort sort_complex split
sqrt square squeeze stack std subtract sum swapaxes take take_along_axis tan tanh tensordot tile
trace transpose trapezoid tri tril tril_indices tril_indices_from trim_zeros triu triu_indices
triu_indices_from true_divide trunc ubyte uint uint16 uint32 uint64 uint8 uintc uintp ulonglong
union1d unique unique_all unique_counts unique_inverse unique_values unpackbits unravel_index
unsignedinteger unwrap ushort vander var vdot vsplit vstack zeros zeros_like
""".split())

#: functions whose output size depends on the values: CuPy reads a count back (a sync)
_DATA_DEPENDENT = frozenset("""nonzero flatnonzero argwhere compress extract unique unique_all
unique_counts unique_inverse unique_values intersect1d setdiff1d setxor1d union1d trim_zeros
""".split())

#: functions that allocate and write nothing: no launch
_NO_FILL = frozenset(("empty", "empty_like"))
#: functions that may give a view of their first argument: a launch only when NumPy copies
_MAYBE_VIEW = frozenset("""reshape ravel transpose swapaxes moveaxis rollaxis permute_dims
matrix_transpose squeeze expand_dims broadcast_to broadcast_arrays atleast_1d atleast_2d
atleast_3d diagonal real imag split array_split hsplit vsplit dsplit flip fliplr flipud rot90
ascontiguousarray asfortranarray require astype ix_""".split())
#: functions that always launch, though NumPy gives no array back (they write into an
#: argument, or CuPy computes a 0-d array where NumPy returns a Python value)
_ALWAYS = frozenset("""copyto fill_diagonal place put putmask put_along_axis allclose
array_equal array_equiv count_nonzero""".split())
_NEVER, _LAUNCH, _VIEW, _IF_ARRAY = range(4)


def _elementwise(x):
    """An elementwise kernel's operand: a strict array or a scalar (CuPy's ``CScalar``
    takes nothing else: not NumPy arrays, not even 0-d ones, and not lists)."""
    if type(x) is ndarray:
        return x._a
    if isinstance(x, SCALAR_TYPES):
        return x
    raise TypeError(f"Unsupported type {type(x)}")


def _out(out):
    if out is None:
        return None
    if type(out) is not ndarray:
        raise TypeError(f"out must be a strict ndarray, got {type(out)}")
    return out._a


class ufunc:
    """A NumPy ufunc over strict arrays (``out=`` must be a strict array)."""

    def __init__(self, np_ufunc):
        self._u = np_ufunc
        self.__name__ = np_ufunc.__name__
        self.nin, self.nout = np_ufunc.nin, np_ufunc.nout

    def __repr__(self) -> str:
        return f"<strict ufunc {self.__name__!r}>"

    def __call__(self, *args, out=None, **kwargs):
        if isinstance(out, tuple):
            out = out[0] if len(out) == 1 else out
        launch(self.__name__)
        operands = [_elementwise(a) for a in args]
        with quiet():
            result = self._u(*operands, out=_out(out), **kwargs)
        if out is not None:
            return out
        return wrap(result if "dtype" in kwargs else promoted(result, *operands))

    def at(self, a, indices, b=None):
        if type(a) is not ndarray:
            raise TypeError(f"Unsupported type {type(a)}")
        index = unwrap(indices, host_ok=True)
        launch(self.__name__ + ".at")
        self._u.at(a._a, index, None if b is None else _elementwise(b))

    def reduce(self, array, axis=0, dtype=None, out=None, keepdims=False):
        launch(self.__name__ + ".reduce")
        result = self._u.reduce(_elementwise(array), axis=axis, dtype=dtype, out=_out(out),
                                keepdims=keepdims)
        return out if out is not None else wrap(result)

    def accumulate(self, array, axis=0, dtype=None, out=None):
        launch(self.__name__ + ".accumulate")
        result = self._u.accumulate(_elementwise(array), axis=axis, dtype=dtype, out=_out(out))
        return out if out is not None else wrap(result)

    def reduceat(self, array, indices, axis=0, dtype=None, out=None):
        launch(self.__name__ + ".reduceat")
        result = self._u.reduceat(_elementwise(array), unwrap(indices, host_ok=True), axis=axis,
                                  dtype=dtype, out=_out(out))
        return out if out is not None else wrap(result)

    def outer(self, A, B, **kwargs):
        launch(self.__name__ + ".outer")
        return wrap(self._u.outer(_elementwise(A), _elementwise(B), **kwargs))


def _has_array(result) -> bool:
    if isinstance(result, (np.ndarray, np.generic)):
        return True
    return isinstance(result, (tuple, list)) and any(
        isinstance(r, (np.ndarray, np.generic)) for r in result)


def _is_view(result, args) -> bool:
    """Whether ``result`` (its first array) shares memory with the first argument."""
    if not args or not isinstance(args[0], np.ndarray):
        return False
    if isinstance(result, (tuple, list)):
        if not result:
            return True
        result = result[0]
    return isinstance(result, np.ndarray) and np.may_share_memory(result, args[0])


def _function(fn, name: str):
    sync = "data-dependent shape" if name in _DATA_DEPENDENT else None
    kind = (_NEVER if name in _NO_FILL else _LAUNCH if name in _ALWAYS
            else _VIEW if name in _MAYBE_VIEW else _IF_ARRAY)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if sync:
            syncs.record(sync)
        out = kwargs.get("out")
        args = unwrap(args)
        result = fn(*args, **{k: unwrap(v) for k, v in kwargs.items()})
        if (kind == _LAUNCH or (kind == _IF_ARRAY and _has_array(result))
                or (kind == _VIEW and not _is_view(result, args))):
            launch(name)
        if type(out) is ndarray:
            return out
        return wrap(result)
    return call


# -- what CuPy does differently from "NumPy's function, unwrapped" ------------------

def asarray(a, dtype=None, order=None, *, blocking=False):
    """A strict array of ``a``: the same one when it already is (and has ``dtype``),
    else a copy (host data, lists and scalars are copied to the "device")."""
    if type(a) is ndarray:
        if dtype is None or np.dtype(dtype) == a.dtype:
            return a
        return a.astype(dtype, copy=False)
    launch("asarray")
    syncs.copy_in()
    return ndarray._of(np.array(unwrap(a, host_ok=True), dtype=dtype, order=order or "K",
                                copy=True))


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    """A new strict array from ``obj`` (a strict array, host data, a list, a scalar)."""
    if type(obj) is ndarray and not copy and (dtype is None or np.dtype(dtype) == obj.dtype):
        return obj
    launch("array")
    if type(obj) is not ndarray:
        syncs.copy_in()
    return ndarray._of(np.array(unwrap(obj, host_ok=True), dtype=dtype, order=order,
                                copy=True, ndmin=ndmin))


asanyarray = asarray


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    """``a`` as a host NumPy array (``cupy.asnumpy``): a copy and a sync for strict arrays."""
    if type(a) is ndarray:
        return a.get(stream=stream, order=order, out=out)
    return np.asarray(a, order=order)


def scatter_add(a, slices, value) -> None:
    """``a[slices] += value`` with repeated indices adding up (``cupyx.scatter_add``,
    which has no bfloat16 in CuPy 14: cupy#9630)."""
    if type(a) is not ndarray:
        raise TypeError(f"scatter_add: a must be a strict ndarray, got {type(a)}")
    if a.dtype.name == "bfloat16":
        raise TypeError("scatter_add: cupyx.scatter_add has no bfloat16 (cupy#9630); "
                        "scatter into a float32 array")
    launch("scatter_add")
    np.add.at(a._a, unwrap(slices, host_ok=True), _elementwise(value))


def stage_for_mpi(a, *, copy_in: bool, copy_out: bool, **_):
    """``(host buffer for MPI, copy_back or None)`` for strict array ``a``: what
    ``mpishard.comm`` does with a device array on an MPI library that is not
    CUDA-aware (copy into a host buffer, run MPI there, copy the result back).
    Each copy counts in ``syncs.staged``, not as a read of a value."""
    if type(a) is not ndarray:
        raise TypeError(f"stage_for_mpi: a must be a strict ndarray, got {type(a)}")
    host = np.empty(a.shape, dtype=a.dtype)
    if copy_in:
        syncs.staged += 1
        host[...] = a._a
    if not copy_out:
        return host, None

    def copy_back():
        syncs.staged += 1
        a._a[...] = host
    return host, copy_back


def matmul(a, b, out=None, **kwargs):
    """Matrix product; float16 accumulates in float32 (see :func:`.array.matmul`)."""
    result = _matmul(_elementwise(a), _elementwise(b), _out(out))
    return out if out is not None else wrap(result)


def dot(a, b, out=None):
    """``numpy.dot``; float16 and bfloat16 accumulate in float32, as in :func:`matmul`."""
    a, b = _elementwise(a), _elementwise(b)
    launch("dot")
    if a.dtype == b.dtype and a.dtype.name in SIXTEEN_BIT:
        result = np.dot(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)
        if out is not None:
            _out(out)[...] = result
    else:
        result = np.dot(a, b, out=_out(out))
    return out if out is not None else wrap(result)


def where(condition, x=None, y=None):
    """``x`` where ``condition`` else ``y`` (an elementwise kernel: strict arrays and
    scalars only); with one argument, ``nonzero`` (a sync)."""
    if x is None and y is None:
        syncs.record("data-dependent shape")
        launch("nonzero")
        return wrap(np.nonzero(_elementwise(condition)))
    launch("where")
    result = np.where(_elementwise(condition), _elementwise(x), _elementwise(y))
    # CuPy 14's where has no bfloat16 loop: bfloat16 choices come out float32
    return wrap(result.astype(np.float32) if result.dtype.name == "bfloat16" else result)


_OWN = {"asarray": asarray, "array": array, "asanyarray": asanyarray, "matmul": matmul,
        "dot": dot, "where": where, "asnumpy": asnumpy,
        "scatter_add": scatter_add, "stage_for_mpi": stage_for_mpi, "ndarray": ndarray}
_CACHE: dict = {}


def lookup(name: str):
    """The strict module's attribute ``name`` (``AttributeError`` where CuPy has none)."""
    if name in _OWN:
        return _OWN[name]
    if name in _CACHE:
        return _CACHE[name]
    if name not in CUPY_NAMES or not hasattr(np, name):
        raise AttributeError(f"module 'mpishard.testing.strict' has no attribute {name!r} "
                             f"(CuPy's namespace has none either)")
    obj = getattr(np, name)
    if isinstance(obj, np.ufunc):
        obj = ufunc(obj)
    elif callable(obj) and not isinstance(obj, type):
        obj = _function(obj, name)
    _CACHE[name] = obj
    return obj


def function_for(np_func):
    """The strict function standing in for NumPy's ``np_func`` (``__array_function__``)."""
    name = getattr(np_func, "__name__", "")
    if getattr(np, name, None) is not np_func:
        return None
    try:
        return lookup(name)
    except AttributeError:
        return None


def ufunc_call(np_ufunc, method: str, inputs, kwargs):
    """``__array_ufunc__``: a NumPy ufunc called on strict arrays runs the strict one."""
    try:
        mine = lookup(np_ufunc.__name__)
    except AttributeError:
        return NotImplemented
    if np_ufunc is np.matmul:
        mine = matmul
    elif not isinstance(mine, ufunc):
        return NotImplemented
    fn = mine if method == "__call__" else getattr(mine, method, None)
    if fn is None:
        return NotImplemented
    return fn(*inputs, **kwargs)


PROTOCOLS.update(ufunc_call=ufunc_call, function_for=function_for)
