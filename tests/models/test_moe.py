"""Mixture of experts: the layer and a Mixtral-shaped Llama against transformers, capacity
dropping against a per-token rule written out, the auxiliary losses, refusals."""
import math

import numpy as np
import pytest

from mpishard.autodiff import Tensor
from mpishard.models import Llama, LlamaConfig
from mpishard.models.moe import MoE, load_balancing_loss, router_z_loss



@pytest.fixture
def torch():
    """PyTorch for the tests against transformers, imported by them alone: the MPI
    cases of this file run on every rank, which need neither."""
    return pytest.importorskip("torch")

CFG = dict(vocab_size=37, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=16,
           intermediate_size=12, moe_experts=4, moe_top_k=2, rope_theta=10000.0)


def mixtral(cfg: LlamaConfig, aux: float):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head, max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.rms_eps, rope_theta=cfg.rope_theta, num_local_experts=cfg.moe_experts,
        num_experts_per_tok=cfg.moe_top_k, router_aux_loss_coef=aux, output_router_logits=True,
        tie_word_embeddings=False, sliding_window=None)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"      # the loop over experts (any dtype)
    return transformers.MixtralForCausalLM(config).to(torch.float64)


@pytest.fixture
def float64_routers(monkeypatch, torch):
    """transformers routes in float32 (``.float()``) whatever the model's dtype; keep
    float64 tensors in float64 so the comparison can be exact to rounding."""
    import transformers.modeling_rope_utils as rope_utils
    import transformers.models.mixtral.modeling_mixtral as modeling_mixtral
    from test_hf import _Float64Torch

    for module in (modeling_mixtral, rope_utils):   # the rotary tables in float64 too
        monkeypatch.setattr(module, "torch", _Float64Torch())
    real = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float",
                        lambda self: self if self.dtype == torch.float64 else real(self))


@pytest.mark.parametrize("aux,z", [(0.02, 0.0), (0.0, 0.0), (0.02, 0.01)])
def test_mixtral_shaped_llama_matches_transformers(aux, z, float64_routers, torch):
    cfg = LlamaConfig(**CFG, moe_aux_coef=aux, moe_z_coef=z)
    ours = Llama(cfg, seed=3, dtype="float64")
    ref = mixtral(cfg, aux)
    state = {n: torch.tensor(p.data) for n, p in ours.named_parameters()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    r = np.random.default_rng(0)
    idx, tgt = r.integers(0, 37, (2, 16)), r.integers(0, 37, (2, 16))
    logits, loss = ours(idx, tgt)
    loss.backward()
    out = ref(torch.tensor(idx), labels=None, output_router_logits=True)
    shifted = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 37), torch.tensor(tgt).reshape(-1))
    ref_loss = shifted + aux * out.aux_loss if aux else shifted
    if z:   # the z-loss, written out (transformers' Mixtral has none)
        lse = torch.stack([torch.logsumexp(g, dim=-1) for g in out.router_logits])
        ref_loss = ref_loss + z * (lse ** 2).mean()
    ref_loss.backward()
    assert np.max(np.abs(logits.data - out.logits.detach().numpy())) <= 1e-12
    assert abs(loss.item() - ref_loss.item()) <= 1e-12 * abs(ref_loss.item())
    grads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        want = grads[name].grad.numpy()
        err = np.max(np.abs(p.grad - want)) / max(np.max(np.abs(want)), 1e-300)
        assert err <= 1e-10, (name, err)


def _per_token(moe, x, capacity, router="softmax"):
    """The rule written out token by token: top-k of the softmax (or sigmoid) scores,
    renormalised; an expert takes tokens in order until it has ceil(capacity * N * k / E)."""
    W = moe.gate.weight.data
    gu, dn = moe.experts.gate_up_proj.data, moe.experts.down_proj.data
    F = dn.shape[2]
    N, E, k = x.shape[0], moe.n_experts, moe.top_k
    cap = math.ceil(capacity * N * k / E) if capacity else N * k
    taken, out, dropped = [0] * E, np.zeros_like(x), []
    for t in range(N):
        logits = W @ x[t]
        if router == "softmax":
            p = np.exp(logits - logits.max())
            p /= p.sum()
        else:
            p = 1.0 / (1.0 + np.exp(-logits))
        top = np.argsort(-p, kind="stable")[:k]
        w = p[top] / p[top].sum()
        for e, we in zip(top, w):
            if taken[e] >= cap:
                dropped.append((t, int(e)))
                continue
            taken[e] += 1
            h = gu[e] @ x[t]
            g, u = h[:F], h[F:]
            out[t] += we * (dn[e] @ (g / (1 + np.exp(-g)) * u))
    return out, dropped


@pytest.mark.parametrize("capacity,router", [(None, "softmax"), (1.0, "softmax"),
                                             (0.5, "softmax"), (0.5, "sigmoid")])
def test_capacity_drops_exactly_the_rule_s_tokens(capacity, router):
    moe = MoE(8, 6, n_experts=4, top_k=2, capacity=capacity, dtype="float64", router=router)
    from mpishard.nn import materialize
    materialize(moe, seed=1)
    x = np.random.default_rng(2).standard_normal((24, 8)) * 3
    y = moe(Tensor(x))
    want, dropped = _per_token(moe, x, capacity, router)
    assert np.max(np.abs(y.data - want)) <= 1e-12
    route = moe.route
    assert int(route.counts.sum()) == 48
    assert int(route.counts.sum() - route.kept.sum()) == len(dropped)
    if capacity == 0.5:
        assert dropped and route.dropped_fraction == pytest.approx(len(dropped) / 48)
    if capacity is None:
        assert not dropped and route.dropped_fraction == 0.0


def test_a_shared_expert_adds_its_mlp_to_every_token():
    from mpishard.models.llama.model import LlamaMLP
    from mpishard.nn import materialize
    cfg = LlamaConfig(**CFG, moe_shared_expert=True)
    moe = Llama(cfg, seed=0, dtype="float64").model.layers["0"].mlp
    assert isinstance(moe.shared_expert, LlamaMLP)
    x = np.random.default_rng(3).standard_normal((10, 16))
    plain = MoE(16, 12, 4, 2, dtype="float64")
    materialize(plain, seed=0)
    for name, p in plain.named_parameters():
        p.data = dict(moe.named_parameters())[name].data
    both = moe(Tensor(x)).data
    assert np.allclose(both, plain(Tensor(x)).data + moe.shared_expert(Tensor(x)).data,
                       rtol=0, atol=1e-13)


def test_every_token_to_one_expert_and_empty_experts():
    """A router that sends everything to expert 2 (the others get no rows) still runs and
    its gradient reaches the gate."""
    moe = MoE(4, 3, n_experts=3, top_k=1, dtype="float64")
    from mpishard.nn import materialize
    materialize(moe, seed=0)
    moe.gate.weight.data[...] = 0.0
    moe.gate.weight.data[2] = 5.0
    x = Tensor(np.abs(np.random.default_rng(0).standard_normal((5, 4))), requires_grad=True)
    y = moe(x)
    assert list(moe.route.kept) == [0, 0, 5]
    loss = (y * y).sum() + load_balancing_loss([moe.route], 3) + router_z_loss([moe.route])
    loss.backward()
    assert np.all(moe.experts.gate_up_proj.grad[:2] == 0) and np.any(moe.gate.weight.grad != 0)


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="moe_top_k=5 must be between 1 and moe_experts=4"):
        LlamaConfig(**{**CFG, "moe_top_k": 5})
    with pytest.raises(ValueError, match="pipeline stages cannot compute them yet"):
        Llama(LlamaConfig(**CFG), materialize_now=False, blocks=[0], last_stage=False)
    with pytest.raises(ValueError, match="set moe_aux_coef and moe_z_coef to 0"):
        Llama(LlamaConfig(**CFG), materialize_now=False).set_activation_checkpointing(True)
    Llama(LlamaConfig(**CFG, moe_aux_coef=0.0), materialize_now=False).set_activation_checkpointing(True)


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,sizes,sp", [("zero3", dict(dp_replicate=2, dp_shard=2), False),
                                               ("ddp", dict(tp=2, cp=2), True),
                                               ("zero2", dict(cp=2), False),
                                               ],
                         ids=["hsdp2x2-zero3", "tp2-cp2-sp", "cp2-zero2"])
@pytest.mark.parametrize("model", ["llama-moe", "gpt-moe"])
def test_experts_train_like_one_process_on_other_layouts(strategy, sizes, sp, model):
    """Experts replicated over the mesh (no expert parallelism): every layout matches one
    process in float64 over several AdamW steps with clipping and accumulation."""
    from mpi4py import MPI

    from parity import sub_world
    from test_long_context import check_layout

    size = int(np.prod(list(sizes.values())))
    if MPI.COMM_WORLD.size < size:
        pytest.skip(f"needs {size} ranks")
    with sub_world(size) as comm:
        if comm is None:
            return
        check_layout(comm, model, strategy, sizes, sp=sp)


def test_moe_trains_through_the_cli_and_plots_expert_load(tmp_path):
    import json

    from test_cli import mpishard
    metrics = tmp_path / "m.jsonl"
    out = mpishard("train", "--model", "llama", "--preset", "llama-tiny", "--moe-experts", "4",
                   "--moe-capacity", "1.0", "--steps", "3", "--max-bytes", "20000",
                   "--eval-batches", "1", "--progress", "false", "--metrics", str(metrics),
                   n=2, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    moe = [r["moe"] for r in map(json.loads, metrics.read_text().splitlines()) if "moe" in r]
    assert len(moe) == 3
    for m in moe:
        assert 0 <= m["tokens_per_expert_min"] <= m["tokens_per_expert_max"]
        assert 0.0 <= m["dropped_fraction"] < 1.0 and m["aux_loss"] > 0
    plot = mpishard("plot", str(metrics), "-o", str(tmp_path / "m.png"))
    assert plot.returncode == 0, plot.stderr
    gpt = mpishard("train", "--model", "gpt", "--preset", "gpt-tiny", "--moe-experts", "4",
                   "--moe-every", "2", "--moe-z-coef", "0.001", "--steps", "2", "--max-bytes",
                   "20000", "--eval-batches", "1", "--progress", "false", n=2, timeout=200)
    assert gpt.returncode == 0, gpt.stdout + gpt.stderr
    est = mpishard("estimate", "--preset", "mixtral-8x7b", "--dp", "64", "--strategy", "zero3",
                   "--block-size", "4096", "--batch-size", "1")
    assert est.returncode == 0, est.stderr
    assert "46,702,792,704 parameters" in est.stdout      # Mixtral 8x7B's published 46.7B


def test_mixtral_folders_load_and_export(tmp_path, float64_routers, torch):
    """A transformers Mixtral folder loads into mpishard with the same logits; mpishard's
    export loads back into transformers without a missing or unexpected key."""
    from mpishard import hf
    from test_hf import load_quietly

    cfg = LlamaConfig(**CFG)
    ref = mixtral(cfg, 0.001)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.05)
    ref.save_pretrained(tmp_path / "hf")
    ours = hf.from_pretrained(tmp_path / "hf", dtype="float64")
    assert ours.config.moe_experts == 4 and ours.config.moe_top_k == 2
    idx = np.random.default_rng(1).integers(0, 37, (2, 16))
    logits, _ = ours(idx)
    with torch.no_grad():
        want = ref(torch.tensor(idx)).logits.numpy()
    assert np.max(np.abs(logits.data - want)) <= 1e-10
    hf.save_pretrained(ours, tmp_path / "out")
    back, _ = load_quietly(tmp_path / "out", torch_dtype=torch.float64,
                           experts_implementation="eager")
    with torch.no_grad():
        again = back(torch.tensor(idx)).logits.numpy()
    assert np.max(np.abs(again - want)) <= 1e-10


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_mixtral_folder_loads_onto_sharded_layouts():
    """ZeRO-3 shards cut the stacked expert tensors anywhere: each rank reads its runs
    from the per-expert tensors, and the gathered model is the one-process one."""
    from mpi4py import MPI

    from ckpt_scripts.common import shared_tmp
    from mpishard import hf
    from mpishard.comm import Communicator, Mesh
    from mpishard.parallel import ParallelModel

    world = Communicator(MPI.COMM_WORLD)
    with shared_tmp(world) as root:
        cfg = LlamaConfig(**CFG)
        if world.rank == 0:
            hf.save_pretrained(Llama(cfg, seed=11, dtype="float64"), root / "hf")
        world.barrier()
        one = {n: p.data for n, p in hf.from_pretrained(root / "hf", dtype="float64")
               .named_parameters()}
        for sizes, strategy in ((dict(), "zero3"), (dict(tp=2) if world.size % 2 == 0 else
                                                    dict(), "zero1")):
            run = ParallelModel(Llama(cfg, seed=0, dtype="float64", materialize_now=False),
                                Mesh(world, **sizes), strategy=strategy)
            hf.load_pretrained(run.strategy, root / "hf")
            full = run.gather_full_params()
            for name, value in one.items():
                assert np.array_equal(full[name], value), (sizes, strategy, name)


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_router_losses_keep_float16s_loss_scale():
    """Under float16 mixed precision the router's losses (16-bit) join the float32 loss
    cast before their coefficients: their gradient reaches 16 bits as the coefficient
    times the loss scale. Cast after, it reached them as the whole scale, 2^16, which
    float16 cannot hold: every such step overflowed and halved the scale."""
    from mpi4py import MPI

    from mpishard.comm import Communicator, Mesh
    from mpishard.models import GPT, GPTConfig
    from mpishard.optim import AdamW
    from mpishard.parallel import DataParallel
    r = np.random.default_rng(0)
    idx, tgt = r.integers(0, 37, (2, 16)), r.integers(0, 37, (2, 16))
    cfg = GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=4, n_embd=16,
                    moe_experts=4, moe_top_k=2, moe_aux_coef=0.02, moe_z_coef=0.01)
    run = DataParallel(GPT(cfg, seed=1), Mesh(Communicator(MPI.COMM_SELF), dp=1),
                       precision="float16")
    opt = AdamW(run.parameters())
    first = run.scaler.scale
    for _ in range(3):
        _, loss = run(idx, tgt)
        run.scale_loss(loss).backward()
        assert not run.step(opt).skipped
    assert run.scaler.scale == first == 2.0 ** 16
