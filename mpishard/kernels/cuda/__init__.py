"""The GPU kernel set: CUDA kernels, each launcher beside its source.

The rule: ``X.py`` launches what ``X_src.py`` holds, and nothing else holds kernel
source.

* :mod:`.ops` (the kernel set itself, :class:`~mpishard.kernels.protocol.KernelSet`):
  GELU, SwiGLU, dropout, attention's softmax, the bias gradients and the heads'
  unpacking, from :mod:`.ops_src`; the rest of the set from the launchers below;
* :mod:`.norms`: layer norm and RMS norm, from :mod:`.norms_src` (whose row kernels
  share :mod:`.ops_src`'s block reduction);
* :mod:`.attention`: fused causal attention, from :mod:`.attention_src`;
* :mod:`.loss`: fused cross-entropy, one launch each way, from :mod:`.loss_src`;
* :mod:`.rotary`: rotary embeddings packed with grouped key/value heads (``rope_qkv``),
  one launch each way, from :mod:`.rotary_src`;
* :mod:`.multi`: the optimizer's kernels (multi-tensor Adam and sums of squares, and
  their one-target forms), from :mod:`.multi_src`.

Beside them, with no source of their own: :mod:`.launch` (the compiled-kernel cache
and the launch helpers every launcher uses), :mod:`.gemm` (batched products on cuBLAS)
and :mod:`.libs` (the CUDA library bindings it calls). ``scripts/compile_kernels.py``
compiles every source with NVRTC, without a GPU.
"""
