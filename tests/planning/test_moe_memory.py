"""What a mixture-of-experts block keeps for backward, planned against measured.

One process, DDP, the activation bytes the pipeline measures in a training step
(tracemalloc on NumPy) against ``gpt_activation_bytes`` / ``llama_activation_bytes``:
routed rows and the experts' activations, the routing's index arrays, a shared
expert's MLP, and dropout (a mixture's output has no residual dropout of its own; a
shared expert has its MLP's), in float32 and bfloat16.
"""
import numpy as np
import pytest

from mpishard.comm import Mesh
from mpishard.testing.fake_cupy import make_test_comm
from mpishard.models import GPT, GPTConfig, Llama, LlamaConfig
from mpishard.models.gpt.activations import gpt_activation_bytes
from mpishard.models.llama.activations import llama_activation_bytes
from mpishard.parallel import ParallelModel

B, T = 4, 32


def _measured_and_planned(model, precision, plan):
    comm = make_test_comm("self")
    try:
        run = ParallelModel(model, Mesh(comm, dp=1), strategy="ddp", precision=precision)
        r = np.random.default_rng(0)
        x, y = (r.integers(0, model.config.vocab_size, (B, T)) for _ in range(2))
        run.train_step(x, y)      # the first step fills the model's rotary tables and the
        run.pipeline.measure_activations = True       # causal mask's cache: not activations
        run.train_step(x, y)
        return run.pipeline.activation_bytes, plan(model, B, T, precision or "float32")
    finally:
        comm.free()


@pytest.mark.parametrize("precision", [None, "bfloat16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("moe", [dict(moe_experts=4), dict(moe_experts=4, moe_shared_expert=True),
                                 dict(moe_experts=4, moe_every=2)], ids=str)
def test_gpt_moe_activations_as_planned(moe, dropout, precision):
    cfg = GPTConfig(vocab_size=256, block_size=T, n_layer=2, n_head=2, n_embd=32,
                    dropout=dropout, **moe)
    measured, planned = _measured_and_planned(GPT(cfg, seed=0, materialize_now=False),
                                              precision, gpt_activation_bytes)
    assert abs(planned - measured) <= 0.02 * measured, (measured, planned)


@pytest.mark.parametrize("precision", [None, "bfloat16"])
@pytest.mark.parametrize("shared", [False, True])
def test_llama_moe_activations_as_planned(shared, precision):
    cfg = LlamaConfig(vocab_size=256, block_size=T, n_layer=2, n_head=2, n_kv_head=1,
                      n_embd=32, intermediate_size=64, moe_experts=4, moe_shared_expert=shared)
    measured, planned = _measured_and_planned(Llama(cfg, seed=0, materialize_now=False),
                                              precision, llama_activation_bytes)
    assert abs(planned - measured) <= 0.02 * measured, (measured, planned)
