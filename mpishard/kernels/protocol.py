"""The kernel-set protocol: every kernel a set provides, its signature and what it does.

A kernel set is a module that provides every member of :class:`KernelSet`, with
these signatures: :mod:`.reference` (the plain math, which the tests compare the
others against), :mod:`.cpu.ops` (NumPy) and :mod:`.cuda.ops` (CuPy, and the strict
module that stands in for it). ``tests/kernels/test_kernels.py`` checks each set against
this class (every name, every signature), so a kernel added here and missing in a
set fails there. Adding a kernel: its entry here, its reference, CPU and CUDA
entries, and tests.

Conventions every set keeps:

* inputs are 2-D row arrays ``(rows, width)`` in the compute dtype (float32 or
  float64; the ops cast 16-bit inputs up first, except for the ``gelu16_*`` kernels,
  cross-entropy's (which take the logits in their own dtype) and where a set's
  :attr:`~KernelSet.NATIVE_FLOAT16` says it takes float16 rows);
* every kernel returns fresh arrays except :meth:`~KernelSet.softmax_rows`,
  :meth:`~KernelSet.causal_softmax`, :meth:`~KernelSet.softmax_backward`,
  :meth:`~KernelSet.adam_update` and :meth:`~KernelSet.multi_adam_update`, which work
  in place as their callers need, and those given an ``out_*`` or ``into`` array,
  which write there;
* dropout takes its uniform draws ``u`` (float32, in [0, 1), drawn by the caller
  from its seeded generator) and keeps the elements with ``u >= p`` (compared in
  float32), scaled by ``1 / (1 - p)`` rounded to the data's dtype: bit for bit the
  ``data * mask`` the models computed with a mask array. Dropout's data may be of
  any shape, 16-bit too.
"""
from __future__ import annotations

import inspect
from typing import Protocol

__all__ = ["KernelSet", "KERNEL_NAMES"]


class KernelSet(Protocol):
    """What every kernel set provides (see the module docstring)."""

    #: the set's name: ``"reference"``, ``"cpu"`` or ``"gpu"``
    NAME: str
    #: whether GELU, layer norm, RMS norm and SwiGLU take 16-bit rows themselves (a GPU's;
    #: see [Note: float16 rows] in mpishard/kernels/cuda/norms.py) rather than the ops
    #: casting them up and down
    NATIVE_FLOAT16: bool

    def gelu_forward(self, a, bias=None):
        """GELU, tanh approximation: ``(y, t)`` with ``t = tanh(c (a + k a^3))`` (what the
        backward kernels read; the op runs this again in backward for it rather than
        keep it) and ``y = 0.5 a (1 + t)``; with ``bias`` (a row of ``a``'s width), of
        ``a + bias`` (a linear layer's output and its bias, added here)."""

    def gelu_backward(self, a, t, g):
        """``g * d gelu / da = g (0.5 (1 + t) + 0.5 a (1 - t^2) c (1 + 3k a^2))``."""

    def layer_norm_forward(self, x, weight, bias, eps: float):
        """``(y, xhat, rstd)``: ``xhat = (x - mean) / sqrt(var + eps)`` per row,
        ``y = xhat * weight + bias`` (either may be None)."""

    def layer_norm_backward(self, g, xhat, rstd, weight, into=None):
        """The input's gradient of :meth:`layer_norm_forward` for output gradient ``g``;
        with ``into`` (the input's gradient so far, ``g``'s shape and dtype) added into
        it, and ``into`` returned."""

    def rms_norm_forward(self, x, weight, eps: float):
        """``(y, xhat, rstd)``: ``xhat = x / sqrt(mean(x^2) + eps)``, ``y = xhat * weight``."""

    def rms_norm_backward(self, g, xhat, rstd, weight, into=None):
        """The input's gradient of :meth:`rms_norm_forward` for output gradient ``g``
        (``into`` as for :meth:`layer_norm_backward`)."""

    def norm_param_grads(self, g, xhat, need_weight: bool, need_bias: bool, out_weight=None,
                         out_bias=None):
        """``(gw, gb)``, the weight's and bias's gradients of either norm: the column sums
        of ``g * xhat`` and of ``g`` (None where not needed), written into ``out_weight``
        / ``out_bias`` (``(C,)``: gradient buckets' views) when given."""

    def swiglu_forward(self, gate, up):
        """``y = gate s up`` with ``s = sigmoid(gate)`` (nothing kept: backward computes
        ``s`` again from ``gate``, the same bits). Where :attr:`NATIVE_FLOAT16`, also on
        16-bit rows (the same dtype each way), computed in float32, each result rounded
        once into their dtype."""

    def swiglu_backward(self, gate, up, grad, need_gate: bool = True, need_up: bool = True):
        """``(d gate, d up)`` of :meth:`swiglu_forward` (None where not needed)."""

    def rope_qkv_forward(self, q, k, v, cos, sin, heads):
        """The packed rows of :func:`mpishard.autodiff.rope_qkv`, ``(B, T, 3, H, hs)`` in
        q's dtype: query head ``j`` rotated, key/value head ``heads[j]`` (k's rotated)
        beside it. ``q`` is ``(B, T, H, hs)``, ``k`` and ``v`` ``(B, T, H_kv, hs)``, of one
        dtype, 16-bit too (computed in float32 and rounded once at the end, as the rows
        cast up, rotated and cast down); ``cos`` and ``sin`` the rotation's tables ``(T,
        hs)`` of any float dtype; ``heads`` a NumPy array of ``H`` non-decreasing key/value
        heads. A rotation is ``x cos + swap(x) signed`` (``swap``: the halves exchanged,
        ``signed``: ``sin`` with its first half negated), two products and a sum, each
        rounded in the compute dtype."""

    def rope_qkv_backward(self, d, cos, sin, heads, n_kv: int, need_q: bool = True,
                          need_k: bool = True, need_v: bool = True):
        """``(gq, gk, gv)`` of :meth:`rope_qkv_forward` for the packed rows' gradient ``d``
        ``(B, T, 3, H, hs)``, in d's dtype (None where not needed): q's rotated back
        (``x cos - swap(x) signed``); k's and v's, ``(B, T, n_kv, hs)``, each key/value
        head's sum over the query heads that read it, added in their order in the compute
        dtype (zero for a head none reads), k's then rotated back."""

    def dropout_add(self, x, y, u, p: float, bias=None):
        """``x + dropout(y)`` (a residual add; ``x`` None: the dropout alone), in y's
        dtype; with ``bias``, of ``y + bias`` (a linear layer's output and its bias,
        added here); ``u`` None: no dropout (``x + y + bias``)."""

    def dropout_backward(self, g, u, p: float):
        """The gradient through dropout: ``where(u >= p, g / (1 - p), 0)``, same draws."""

    def bias_gelu_backward(self, a, bias, t, g, out_bias=None):
        """``(gx, gb)`` of :meth:`gelu_forward` with ``bias``: the gradient of ``a`` (and of
        ``a + bias``) and its column sums, the bias's gradient (into ``out_bias`` if
        given)."""

    def bias_dropout_backward(self, g, u, p: float, out_bias=None):
        """``(gy, gb)`` of :meth:`dropout_add` with a bias: the gradient through the
        dropout (``g`` itself when ``u`` is None) and its column sums, the bias's
        gradient (float32 at least, into ``out_bias`` if given)."""

    def softmax_rows(self, a) -> None:
        """Row-wise softmax of a 2-D array, in place (max-subtracted for stability)."""

    def causal_softmax(self, a, T: int, scale: float, drop_u=None, drop_p: float = 0.0,
                       dropped=None):
        """Attention weights in place: scores ``a`` (``(n T, T)``, row ``r`` those of query
        ``r % T``) times ``scale``, keys after the query masked, then softmax over each
        row. With dropout draws ``drop_u`` (float32, a's shape) also the dropped weights,
        ``where(drop_u >= drop_p, a / (1 - drop_p), 0)``, into ``dropped`` (default a
        fresh array), which is returned (None without ``drop_u``)."""

    def softmax_backward(self, d, p, scale: float, drop_u=None, drop_p: float = 0.0,
                         dropped=None) -> None:
        """In place: ``d`` (the weights' gradient) becomes the scores' gradient,
        ``(d - rowdot(d, p)) p scale`` for softmax weights ``p`` of scaled scores; with the
        forward's dropout draws ``drop_u``, ``d`` (the dropped weights' gradient) first
        goes back through the dropout, and with ``dropped`` (p's shape and dtype, not p)
        the dropped weights, :meth:`causal_softmax`'s ``dropped`` again, are written
        there on the way (the values' gradient needs them; on a GPU no launch of their
        own)."""

    def unpack_heads(self, h, need_sum: bool = False, out_sum=None, dtype=None):
        """``(rows, sums)``: attention's head-major ``(3, B, nh, T, hs)`` q, k and v
        gradients as packed ``(B*T, 3*nh*hs)`` rows (column ``(w*nh + head)*hs + j``) in
        ``dtype`` (default h's), and with ``need_sum`` their column sums, the fused q/k/v projection's bias
        gradient (as :func:`mpishard.kernels.rows.col_sum`: 16-bit summed in float32,
        into ``out_sum`` if given), else None."""

    def adam_update(self, param, grad, m, v, beta1: float, beta2: float, step_size: float,
                    inv_bias2: float, eps: float) -> None:
        """One Adam step in place: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
        ``param -= step_size m / (sqrt(v) inv_bias2 + eps)`` (``step_size`` is
        ``lr / (1 - b1^t)``, ``inv_bias2`` is ``1 / sqrt(1 - b2^t)``)."""

    def sq_sum(self, x, out):
        """``out`` (a float64 array of one element, e.g. a slice of a larger one) = the sum
        of ``x``'s squares, in float64 (the gradient clipping's norm); returns ``out``."""

    def gelu16_forward(self, a, bias=None):
        """:meth:`gelu_forward` of 16-bit rows ``a`` (and ``bias``), computed in float32:
        ``(y, t)``, ``y`` in a's dtype, ``t`` float32."""

    def gelu16_backward(self, a, bias, t, g, need_bias: bool, out_bias=None):
        """``(gx, gb)`` of :meth:`gelu16_forward`: the 16-bit gradient of ``a`` computed in
        float32 from the float32 ``t``, and with ``need_bias`` the bias's gradient, the
        column sums of the float32 gradient (into ``out_bias`` if given; else None)."""

    def flash_attention_forward(self, hm, scale: float):
        """Causal attention of head-major ``hm`` (``(3, B, heads, T, hs)``: q, k, v):
        ``(y, lse)``, the output ``(B, heads, T, hs)`` in hm's dtype and each query row's
        log-sum-exp of its scaled, masked scores (float32 for 16-bit rows), all that
        backward keeps. A GPU's kernels walk the ``T x T`` scores a tile at a time
        (mpishard/kernels/cuda/attention_src.py); the reference makes them whole."""

    def flash_attention_backward(self, hm, y, gy, lse, scale: float):
        """The gradients of :meth:`flash_attention_forward`'s q, k and v, head-major
        ``(3, B, heads, T, hs)`` in hm's dtype, from its output ``y``, the output's
        gradient ``gy`` (``(B, heads, T, hs)``) and ``lse``: the weights recomputed as
        ``exp(s - lse)``, ``D = rowsum(gy y)``, ``ds = p (gy v^T - D)``,
        ``dq = scale ds k``, ``dk = scale ds^T q``, ``dv = p^T gy``."""

    def multi_adam_update(self, targets, beta1: float, beta2: float, step_size, inv_bias2,
                          eps: float, grad_scale=1.0, decay: float = 1.0,
                          skip=None) -> None:
        """One AdamW step over many flat targets ``(param, grad, m, v, decay_ranges)``:
        each gradient times ``grad_scale`` (the loss scale's and the clipping's factor),
        each param's decay ranges times ``decay`` (decoupled weight decay, in place on
        the views), then :meth:`adam_update` (a GPU does all targets in one launch).
        With ``skip`` a 0-d boolean array (a step decided on the device) ``step_size``,
        ``inv_bias2`` and ``grad_scale`` may be 0-d float64 arrays of the targets' array
        module: a GPU's kernel reads them, and the flag, from device memory and leaves
        every target and its state as they were where the flag is set (no read back);
        the host sets and the reference read them."""

    def multi_sq_sum(self, arrays, out):
        """``out[i]`` (float64) = the sum of squares of ``arrays[i]``, for every i (a GPU
        does all arrays in two launches); returns ``out``."""

    def cross_entropy_forward(self, logits, targets, ignore_index: int):
        """The mean cross-entropy of ``(N, V)`` rows ``logits`` (any float dtype; 16-bit
        rows are not cast up first) against ``(N,)`` integer ``targets``, rows whose
        target is ``ignore_index`` left out: ``(loss, row_max, row_sum, count)``, the loss
        a 0-d array of the math dtype (float32 for 16-bit logits, else theirs), each row's
        maximum and sum of ``exp(logit - maximum)`` (``(N,)``, that dtype: backward
        recomputes the softmax from them) and the number of rows counted (a Python int
        from the CPU set, else a 0-d array: on a device never read back; none counted:
        a nan loss).
        A GPU does it, the mean included, in one launch, a thread block per row, reading
        each 16-bit or float32 logit into a float32 register
        (mpishard/kernels/cuda/loss_src.py)."""

    def cross_entropy_backward(self, logits, targets, ignore_index: int, row_max, row_sum,
                               count, g):
        """The logits' gradient of :meth:`cross_entropy_forward` (whose ``row_max``,
        ``row_sum`` and ``count`` it takes) for the loss's gradient ``g``, in the logits'
        dtype: ``(softmax - onehot(target)) * g / max(count, 1)`` on counted rows, 0 on
        ignored ones (a GPU: one launch)."""


#: the kernels of :class:`KernelSet`, in the order written there
KERNEL_NAMES = tuple(name for name, member in vars(KernelSet).items()
                     if inspect.isfunction(member) and not name.startswith("_"))
