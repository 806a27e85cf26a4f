"""Model presets: published shapes, and small ones for CPUs (``--preset NAME``).

    mpishard estimate --preset llama3.1-8b --dp 8 --strategy zero3
    mpiexec -n 4 python -m mpi4py -m mpishard train --preset llama-tiny --steps 50

A preset fills the ``[model]`` keys it names; any key given in the TOML file or
as a flag still wins (``--preset gpt2 --n-layer 6``). The GPT-2 shapes are
OpenAI's (vocabulary 50257, context 1024); the Llama 3 shapes are Meta's
``config.json`` values (vocabulary 128256, grouped-query attention with 8
key/value heads, rope theta 500000 with Llama 3's frequency scaling), with
``block_size`` the 8192-token context they were pretrained at (their scaled
rotary embeddings reach 131072); Mixtral 8x7B's is Mistral AI's (32 blocks of 8
experts, 2 per token, 32768 positions). Parameter counts are in docs/models.md.
"""
from __future__ import annotations

__all__ = ["PRESETS"]

_LLAMA3 = dict(name="llama", vocab_size=128256, block_size=8192, rope_theta=500000.0,
               rope_scaling="llama3", rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
               rope_original_max_position=8192, rms_eps=1e-5, bias=False)

#: preset name -> [model] keys (flat names)
PRESETS = {
    "gpt2": dict(name="gpt", vocab_size=50257, block_size=1024, n_layer=12, n_head=12,
                 n_embd=768, bias=True),
    "gpt2-medium": dict(name="gpt", vocab_size=50257, block_size=1024, n_layer=24, n_head=16,
                        n_embd=1024, bias=True),
    "gpt2-large": dict(name="gpt", vocab_size=50257, block_size=1024, n_layer=36, n_head=20,
                       n_embd=1280, bias=True),
    "gpt2-xl": dict(name="gpt", vocab_size=50257, block_size=1024, n_layer=48, n_head=25,
                    n_embd=1600, bias=True),
    "llama3.2-1b": dict(_LLAMA3, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048,
                        intermediate_size=8192, rope_factor=32.0, tie_embeddings=True),
    "llama3.2-3b": dict(_LLAMA3, n_layer=28, n_head=24, n_kv_head=8, n_embd=3072,
                        intermediate_size=8192, rope_factor=32.0, tie_embeddings=True),
    "llama3.1-8b": dict(_LLAMA3, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
                        intermediate_size=14336, rope_factor=8.0, tie_embeddings=False),
    "llama3.1-70b": dict(_LLAMA3, n_layer=80, n_head=64, n_kv_head=8, n_embd=8192,
                         intermediate_size=28672, rope_factor=8.0, tie_embeddings=False),
    # Mistral AI's Mixtral 8x7B config.json: 8 SwiGLU experts per block, 2 per token
    "mixtral-8x7b": dict(name="llama", vocab_size=32000, block_size=32768, n_layer=32,
                         n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                         rope_theta=1000000.0, rope_scaling="none", rms_eps=1e-5,
                         tie_embeddings=False, bias=False, moe_experts=8, moe_top_k=2,
                         moe_every=1),
    # small shapes that train in seconds on a CPU; the vocabulary comes from the data
    "gpt-tiny": dict(name="gpt", block_size=64, n_layer=2, n_head=4, n_embd=64,
                     bias=True),
    "llama-tiny": dict(name="llama", block_size=64, n_layer=2, n_head=4,
                       n_kv_head=2, n_embd=64, intermediate_size=176, rope_theta=10000.0,
                       rope_scaling="none", tie_embeddings=False, bias=False),
}
