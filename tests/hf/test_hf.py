"""Hugging Face interop against transformers itself (torch and transformers are test-only).

Small random transformers models (2 layers, width 32, vocabulary 100) are saved with
their own ``save_pretrained`` and loaded with ``mpishard.hf.from_pretrained``: GPT-2
(``GPT2LMHeadModel``, Conv1D weights, fused q|k|v) and Llama (``LlamaForCausalLM``:
grouped-query attention, untied head, RoPE theta 5000; a variant with Llama 3 scaling
whose three frequency bands are all populated, and a tied one) and Qwen2
(``Qwen2ForCausalLM``: Llama's shape with q/k/v biases; untied, and tied with one
key/value head). Logits, the mean
cross-entropy on given targets and every parameter's gradient agree to 1e-10 in
float64 and 1e-5 in float32 (max-norm relative error per tensor).

transformers computes a few things in float32 whatever the model's dtype (Llama's
RMS norm and softmax upcast with ``torch.float32``, its rotary tables with
``torch.float``). For the float64 comparison those names are pointed at float64 in
transformers' Llama, Qwen2 and RoPE modules (:func:`float64_transformers`), so the reference
is transformers' own code, evaluated in float64 throughout.

Exports go the other way: transformers loads what ``save_pretrained``/``export_checkpoint``
write, logs no missing or unexpected key, and gives bit-identical logits.
"""
from __future__ import annotations

import io
import json
import logging
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mpishard import hf  # noqa: E402
from mpishard.checkpoint import CheckpointError  # noqa: E402

CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight",
          ".mlp.c_proj.weight")
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
TOL = {"float64": 1e-10, "float32": 1e-5}
ERRORS: dict = {}          # (model, dtype) -> worst errors, printed by the summary test


# -- building transformers models -------------------------------------------------------
def randomize(model, seed: int) -> None:
    """Every parameter random: norms' weights near 1, the rest N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            norm = ("ln_" in name or "norm" in name) and name.endswith("weight")
            p.copy_((1.0 + 0.1 * noise) if norm else 0.1 * noise)


def gpt2_config(vocab=100, **kw):
    return transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2,
                                   n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                   bos_token_id=None, eos_token_id=None, **kw)


def llama_config(vocab=100, tie=False, scaling=None, kv=2, positions=64, **kw):
    rope = {"rope_type": "default", "rope_theta": 5000.0} if scaling is None else \
        {**scaling, "rope_theta": 5000.0}
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=kv, max_position_embeddings=positions,
                                    rms_norm_eps=1e-6, rope_parameters=rope,
                                    tie_word_embeddings=tie, attention_dropout=0.0,
                                    bos_token_id=None, eos_token_id=None, **kw)


def qwen2_config(vocab=100, tie=False, kv=2, **kw):
    """Qwen2: Llama's shape with q/k/v biases (randomised like every parameter)."""
    return transformers.Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=kv, max_position_embeddings=64,
                                    rms_norm_eps=1e-6,
                                    rope_parameters={"rope_type": "default",
                                                     "rope_theta": 5000.0},
                                    tie_word_embeddings=tie, attention_dropout=0.0,
                                    bos_token_id=None, eos_token_id=None, **kw)


def mixtral_config(vocab=100):
    """Mixtral: Llama's shape with four experts (top 2) in every block."""
    config = transformers.MixtralConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    config._experts_implementation = "eager"
    return config


KINDS = {"gpt2": lambda vocab: gpt2_config(vocab),
         "llama": lambda vocab: llama_config(vocab),
         "llama3": lambda vocab: llama_config(vocab, scaling=LLAMA3, positions=128),
         "llama_tied": lambda vocab: llama_config(vocab, tie=True, kv=1),
         "qwen2": lambda vocab: qwen2_config(vocab),
         "qwen2_tied": lambda vocab: qwen2_config(vocab, tie=True, kv=1)}
#: made by make_hf too, and compared in their own tests (transformers routes in float32)
MOE_KINDS = {"mixtral": mixtral_config}


def make_hf(kind: str, folder, dtype=torch.float32, seed=0, vocab=100, **save):
    """A random transformers model of ``kind``, saved to ``folder`` (eager attention)."""
    kinds = {**KINDS, **MOE_KINDS}
    config = kinds[kind](vocab)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize(model, seed + list(kinds).index(kind))
    model = model.to(dtype).eval()
    model.save_pretrained(folder, **save)
    return model


class _Float64Torch:
    """``torch`` with ``float32`` and ``float`` meaning float64."""

    float32 = torch.float64
    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@pytest.fixture
def float64_transformers(monkeypatch):
    import transformers.modeling_rope_utils as rope_utils
    import transformers.models.llama.modeling_llama as modeling_llama
    import transformers.models.qwen2.modeling_qwen2 as modeling_qwen2

    for module in (modeling_llama, modeling_qwen2, rope_utils):
        monkeypatch.setattr(module, "torch", _Float64Torch())


def hf_logits(model, idx):
    with torch.no_grad():
        return model(torch.tensor(idx)).logits.numpy()


def load_quietly(folder, **kw):
    """transformers' model from ``folder`` and every warning it logged."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setLevel(logging.WARNING)
    logger = transformers.logging.get_logger("transformers")
    logger.addHandler(handler)
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation="eager", output_loading_info=True, **kw)
    finally:
        logger.removeHandler(handler)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    log = buf.getvalue()
    assert not any(w in log for w in ("MISSING", "UNEXPECTED", "MISMATCH", "newly initialized",
                                      "not used")), log
    return model.eval(), log


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def batch(vocab=100, B=2, T=16, seed=7):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (B, T)), rng.integers(0, vocab, (B, T))


# -- against transformers: logits, loss, gradients -------------------------------------
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_matches_transformers(kind, dtype, tmp_path, request):
    if dtype == "float64":
        request.getfixturevalue("float64_transformers")
    ref = make_hf(kind, tmp_path, getattr(torch, dtype))
    model = hf.from_pretrained(tmp_path, dtype=dtype)
    idx, targets = batch()
    out = ref(torch.tensor(idx)).logits
    ref_loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                 torch.tensor(targets).reshape(-1))
    ref_loss.backward()
    logits, loss = model(idx, targets)
    loss.backward()
    ref_params = dict(ref.named_parameters())
    ours = dict(model.named_parameters())
    assert set(ours) == set(ref_params)
    errors = {"logits": rel(logits.data, out.detach().numpy()),
              "loss": rel(loss.data, ref_loss.item())}
    grads = {}
    for name, p in ours.items():
        g = ref_params[name].grad.numpy()
        grads[name] = rel(p.grad, g.T if name.endswith(CONV1D) and kind == "gpt2" else g)
    errors["grad"] = max(grads.values())
    ERRORS[(kind, dtype)] = errors
    assert logits.data.dtype == np.dtype(dtype)
    assert errors["logits"] <= TOL[dtype] and errors["loss"] <= TOL[dtype], errors
    assert errors["grad"] <= TOL[dtype], {k: v for k, v in grads.items() if v > TOL[dtype]}


def test_worst_errors_summary(capsys):
    """Prints the measured errors of the comparisons above (run with -s to see them)."""
    with capsys.disabled():
        for (kind, dtype), e in sorted(ERRORS.items()):
            print(f"\n{kind:11s} {dtype}: logits {e['logits']:.2e} loss {e['loss']:.2e} "
                  f"grads {e['grad']:.2e}", end="")


def test_model_fields_and_config(tmp_path):
    make_hf("llama3", tmp_path / "l")
    fields = hf.model_fields(tmp_path / "l")
    assert fields == dict(name="llama", vocab_size=100, block_size=128, positions=128,
                          n_layer=2, n_head=4,
                          n_kv_head=2, n_embd=32, intermediate_size=48, rope_theta=5000.0,
                          rope_scaling="llama3", rope_factor=4.0, rope_low_freq_factor=1.0,
                          rope_high_freq_factor=4.0, rope_original_max_position=64,
                          rms_eps=1e-6, tie_embeddings=False, bias=False, moe_experts=0)
    cfg = hf.config_from_pretrained(tmp_path / "l")
    assert type(cfg).__name__ == "LlamaConfig" and cfg.rope_scaling["factor"] == 4.0
    make_hf("gpt2", tmp_path / "g")
    assert hf.model_fields(tmp_path / "g") == dict(name="gpt", vocab_size=100, block_size=32,
                                                   n_layer=2, n_head=4, n_embd=32, bias=True)
    assert type(hf.config_from_pretrained(tmp_path / "g")).__name__ == "GPTConfig"


def test_older_config_keys(tmp_path):
    """transformers 4's rope_theta / rope_scaling and torch_dtype read as 5's rope_parameters."""
    make_hf("llama3", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = {"type": "llama3", **{k: v for k, v in params.items()
                                                if k != "rope_type"}}
    raw["torch_dtype"] = raw.pop("dtype")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    fields = hf.model_fields(tmp_path)
    assert fields["rope_theta"] == 5000.0 and fields["rope_scaling"] == "llama3"
    assert fields["rope_original_max_position"] == 64


@pytest.mark.parametrize("kind", ["llama", "mixtral", "qwen2"])
def test_left_out_keys_are_the_model_types_defaults(kind, tmp_path):
    """A config.json without rms_norm_eps, rope_theta or max_position_embeddings computes
    with transformers' defaults for its model_type (a Mixtral's are 1e-5 and 1e6, a
    Llama's 1e-6 and 1e4): the same logits and context as transformers' model."""
    make_hf(kind, tmp_path)                     # rms_norm_eps 1e-6, rope_theta 5000
    raw = json.loads((tmp_path / "config.json").read_text())
    for key in ("rms_norm_eps", "rope_parameters", "rope_theta", "max_position_embeddings"):
        raw.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ref, _ = load_quietly(tmp_path, **({"experts_implementation": "eager"}
                                       if kind in MOE_KINDS else {}))
    model = hf.from_pretrained(tmp_path)
    assert model.config.rms_eps == ref.config.rms_norm_eps
    assert model.config.rope_theta == ref.config.rope_parameters["rope_theta"]
    assert model.config.positions == ref.config.max_position_embeddings
    idx, _ = batch()
    logits, _ = model(idx)
    assert rel(logits.data, hf_logits(ref, idx)) <= TOL["float32"]


# -- back to transformers ----------------------------------------------------------------
@pytest.mark.parametrize("kind", list(KINDS))
def test_save_pretrained_loads_in_transformers(kind, tmp_path):
    ref = make_hf(kind, tmp_path / "in", torch.float64)
    model = hf.from_pretrained(tmp_path / "in", dtype="float64")
    assert hf.save_pretrained(model, tmp_path / "out") == tmp_path / "out"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "float64" and config["architectures"] == \
        [type(ref).__name__]
    back, _ = load_quietly(tmp_path / "out")
    idx, _ = batch()
    assert back.dtype == torch.float64
    assert np.array_equal(hf_logits(back, idx), hf_logits(ref, idx))
    from safetensors.numpy import load_file

    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert ("lm_head.weight" in saved) == (kind in ("llama", "llama3", "qwen2"))   # untied only


def test_gpt_without_biases_exports_zero_biases(tmp_path):
    from mpishard.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=100, block_size=32, n_layer=2, n_head=4, n_embd=32,
                          bias=False), seed=3, dtype="float64")
    hf.save_pretrained(model, tmp_path)
    back, _ = load_quietly(tmp_path)
    idx, _ = batch()
    logits, _ = model(idx)
    assert rel(logits.data, hf_logits(back, idx)) <= 1e-10
    assert not back.transformer.h[0].attn.c_attn.bias.detach().any()


def test_sharded_save_and_load(tmp_path):
    ref = make_hf("llama", tmp_path / "in", max_shard_size="20KB")     # transformers' shards
    assert (tmp_path / "in" / "model.safetensors.index.json").is_file()
    model = hf.from_pretrained(tmp_path / "in")
    hf.save_pretrained(model, tmp_path / "out", max_shard_bytes=10_000)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 3 and "model.safetensors" not in files
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in ref.parameters())
    back, _ = load_quietly(tmp_path / "out")
    idx, _ = batch()
    assert np.array_equal(hf_logits(back, idx), hf_logits(ref, idx))
    hf.save_pretrained(model, tmp_path / "out")              # one file again: shards removed
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json",
                                                                    "model.safetensors"]


def test_published_layouts(tmp_path):
    """GPT-2 as OpenAI published it (GPT2Model names, causal-mask buffers, float32 or
    boolean) and bfloat16 Llama."""
    from safetensors.numpy import load_file, save_file

    ref = make_hf("gpt2", tmp_path / "g")
    tensors = load_file(tmp_path / "g" / "model.safetensors")
    bare = {k[len("transformer."):]: v for k, v in tensors.items()}
    bare["h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))
    bare["h.1.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), bool))
    save_file(bare, tmp_path / "g" / "model.safetensors", metadata={"format": "pt"})
    idx, _ = batch()
    logits, _ = hf.from_pretrained(tmp_path / "g")(idx)
    assert rel(logits.data, hf_logits(ref, idx)) < 1e-5
    ref = make_hf("llama", tmp_path / "l", torch.bfloat16)
    model = hf.from_pretrained(tmp_path / "l")
    for name, p in ref.named_parameters():                       # widened exactly
        assert np.array_equal(dict(model.named_parameters())[name].data,
                              p.detach().float().numpy()), name


def test_transposed_reads_take_only_their_runs(tmp_path):
    """Runs of a Conv1D tensor's [out, in] transpose come out right, reading exactly their
    elements (rows, partial rows, column blocks, random cuts)."""
    from safetensors.numpy import save_file

    from mpishard.hf.files import HFWeights

    rng = np.random.default_rng(0)
    stored = rng.standard_normal((6, 10)).astype(np.float32)           # [in, out]
    save_file({"w": stored}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    flat = stored.T.reshape(-1)                                       # mpishard's [out, in]
    cases = [[(0, 60)], [(7, 23)], [(3, 4), (9, 10), (15, 16)], [(0, 18), (30, 42)],
             [(r * 6 + 2, r * 6 + 5) for r in range(10)], [(59, 60)], [(5, 13), (13, 40)]]
    for _ in range(50):
        cuts = np.sort(rng.choice(61, size=2 * int(rng.integers(1, 6)), replace=False))
        cases.append([(int(a), int(b)) for a, b in cuts.reshape(-1, 2)])
    with HFWeights(tmp_path) as weights:
        for runs in cases:
            before = weights.bytes_read
            got = weights.read_runs("w", runs, transposed=True)
            assert np.array_equal(got, np.concatenate([flat[a:b] for a, b in runs])), runs
            assert weights.bytes_read - before == 4 * sum(b - a for a, b in runs), runs


# -- refusals, each naming the key and value; nothing written ------------------------------
def edit_config(folder: Path, **changes):
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("kind, changes, message", [
    ("gpt2", {"model_type": "mistral"}, r"model_type=\"mistral\" is not an architecture"),
    ("gpt2", {"architectures": ["GPT2ForSequenceClassification"]}, "architectures="),
    ("gpt2", {"n_inner": 100}, r"n_inner=100 is not supported: .* 4 \* n_embd = 128"),
    ("gpt2", {"activation_function": "relu"}, r"activation_function=\"relu\""),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=true"),
    ("gpt2", {"tie_word_embeddings": False}, "tie_word_embeddings=false"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     r"rope_parameters.rope_type=\"yarn\" is not implemented"),
    ("llama", {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}},
     r"rope_scaling.rope_type=\"linear\" is not implemented"),
    ("llama", {"partial_rotary_factor": 0.5}, r": partial_rotary_factor=0.5 is not supported"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                   "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor=0.5 is not supported"),
    ("llama", {"attention_bias": True}, "attention_bias=true"),
    ("llama", {"mlp_bias": True}, "mlp_bias=true"),
    ("llama", {"hidden_act": "gelu"}, r"hidden_act=\"gelu\""),
    ("llama", {"head_dim": 16}, r"head_dim=16 is not supported: .* = 8 wide"),
    ("llama", {"num_key_value_heads": 3}, "num_key_value_heads=3 must divide "
                                          "num_attention_heads = 4"),
    ("llama", {"hidden_size": 30, "head_dim": None},
     "hidden_size=30 is not divisible by num_attention_heads = 4"),
    ("gpt2", {"n_embd": 30}, "n_embd=30 is not divisible by n_head = 4"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ("qwen2", {"hidden_act": "gelu"}, r"hidden_act=\"gelu\""),
])
def test_unsupported_configs_are_refused(kind, changes, message, tmp_path):
    make_hf(kind, tmp_path)
    edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        hf.model_fields(tmp_path)
    with pytest.raises(ValueError, match=message):
        hf.from_pretrained(tmp_path)


def test_a_left_out_key_whose_default_cannot_build_says_it_was_left_out(tmp_path):
    """A Mixtral config.json without num_key_value_heads has MixtralConfig's 8, which 4
    heads cannot take: the line named a key the file does not have."""
    make_hf("mixtral", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"config.json: num_key_value_heads=8 \(left out of "
                                         r"the file: its model_type's default\) must divide "
                                         r"num_attention_heads = 4"):
        hf.model_fields(tmp_path)


def test_shape_and_missing_tensors_are_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    make_hf("gpt2", tmp_path)
    edit_config(tmp_path, vocab_size=101)
    with pytest.raises(CheckpointError, match=r"shape: transformer.wte.weight has shape "
                                              r"\[100, 32\] in model.safetensors, the model "
                                              r"needs \[101, 32\]"):
        hf.from_pretrained(tmp_path)
    edit_config(tmp_path, vocab_size=100)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["transformer.h.1.mlp.c_fc.weight"]
    tensors["score.weight"] = np.zeros((2, 32), np.float32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing-tensor: .*transformer.h.1.mlp.c_fc"):
        hf.from_pretrained(tmp_path)
    tensors["transformer.h.1.mlp.c_fc.weight"] = np.zeros((32, 128), np.float32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected-tensor: .*score.weight"):
        hf.from_pretrained(tmp_path)
    del tensors["score.weight"]
    tensors["transformer.h.1.mlp.c_fc.weight"] = np.zeros((32, 128), np.int8)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="dtype: tensor 'transformer.h.1.mlp.c_fc.weight' "
                                              "has dtype 'I8'; mpishard reads F16, BF16"):
        hf.from_pretrained(tmp_path)


@pytest.mark.parametrize("kind, table", [("llama_tied", "model.embed_tokens.weight"),
                                         ("gpt2", "transformer.wte.weight")])
def test_a_stored_head_a_tied_config_would_drop_is_refused(kind, table, tmp_path):
    """tie_word_embeddings with an lm_head.weight of other values than the token table:
    transformers keeps the stored head (untied), so tying would compute something else.
    One equal to the table is read past; for a Llama the named fix loads what
    transformers computes."""
    from safetensors.numpy import load_file, save_file

    make_hf(kind, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors[table].copy()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf.from_pretrained(tmp_path)
    tensors["lm_head.weight"] = tensors[table] + 1.0
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tied-head: .*lm_head.weight \\[100, 32\\] "
                                              f"that differs from {table}: .*remove "
                                              f"lm_head.weight from the files"):
        hf.from_pretrained(tmp_path)
    if kind == "gpt2":
        return
    edit_config(tmp_path, tie_word_embeddings=False)
    ref, _ = load_quietly(tmp_path)
    idx, _ = batch()
    logits, _ = hf.from_pretrained(tmp_path)(idx)
    assert rel(logits.data, hf_logits(ref, idx)) <= TOL["float32"]


def test_pickles_and_missing_folders_are_refused(tmp_path):
    make_hf("gpt2", tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: mpishard never unpickles"):
        hf.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="config.json does not exist"):
        hf.from_pretrained(tmp_path / "nowhere")


# -- checkpoints: export, the CLI, and refusals that write nothing --------------------------
def one_process():
    from mpi4py import MPI

    from mpishard.comm import Communicator

    return Communicator(MPI.COMM_SELF.Dup(), "self", _owned=True)


def checkpoint_of(folder: Path, ckpt: Path, config: dict | None):
    """A one-process mpishard checkpoint of the Hugging Face model in ``folder``."""
    from mpishard.checkpoint import save_checkpoint
    from mpishard.comm import Mesh
    from mpishard.models import GPT, Llama
    from mpishard.optim import AdamW
    from mpishard.parallel import wrap_model

    cfg = hf.config_from_pretrained(folder)
    cls = GPT if type(cfg).__name__ == "GPTConfig" else Llama
    with one_process() as comm:
        strategy = wrap_model(cls(cfg, materialize_now=False), Mesh(comm), "zero3")
        hf.load_pretrained(strategy, folder)
        opt = AdamW(strategy.parameters())
        save_checkpoint(ckpt, 3, strategy, opt, world=comm,
                        extra_state={} if config is None else {"config": config})


def train_config(folder: Path) -> dict:
    from mpishard.config.sections import TrainConfig

    cfg = TrainConfig()
    for key, value in hf.model_fields(folder).items():
        setattr(cfg.model, key, value)
    return asdict(cfg)


@pytest.mark.parametrize("kind", ["gpt2", "llama_tied", "mixtral"])
def test_export_checkpoint(kind, tmp_path):
    """A checkpoint exports as the folder it came from; a Mixtral's stacked experts as
    per-expert w1, w2 and w3 tensors, which mpishard reads back too."""
    ref = make_hf(kind, tmp_path / "in", vocab=260)
    checkpoint_of(tmp_path / "in", tmp_path / "ckpt", train_config(tmp_path / "in"))
    hf.export_checkpoint(tmp_path / "ckpt", tmp_path / "out", max_shard_bytes=30_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    moe = {"experts_implementation": "eager"} if kind in MOE_KINDS else {}
    back, _ = load_quietly(tmp_path / "out", **moe)
    if moe:
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in index["weight_map"]
        again = dict(hf.from_pretrained(tmp_path / "out").named_parameters())
        for name, p in hf.from_pretrained(tmp_path / "in").named_parameters():
            assert np.array_equal(again[name].data, p.data), name
    idx, _ = batch(260)
    assert np.array_equal(hf_logits(back, idx), hf_logits(ref, idx))


def test_cli_export_formats(tmp_path):
    import subprocess
    import sys

    make_hf("gpt2", tmp_path / "in", vocab=260)
    checkpoint_of(tmp_path / "in", tmp_path / "ckpt", train_config(tmp_path / "in"))
    root = Path(__file__).resolve().parents[2]

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "mpishard", "checkpoint", "export", *args],
                              capture_output=True, text=True, cwd=root, timeout=120)

    out = cli(str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "hf",
              "--max-shard-size", "40KB")
    assert out.returncode == 0, out.stderr
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    out = cli(str(tmp_path / "ckpt"), str(tmp_path / "one.safetensors"), "--format",
              "safetensors")
    assert out.returncode == 0, out.stderr
    from safetensors.numpy import load_file

    assert "lm_head.weight" in load_file(tmp_path / "one.safetensors")   # mpishard's names
    out = cli(str(tmp_path / "ckpt"), str(tmp_path / "two.safetensors"), "--format",
              "safetensors", "--max-shard-size", "10KB")
    assert out.returncode == 2 and out.stderr == (
        "mpishard: error: --max-shard-size 10KB splits --format hf folders; --format "
        "safetensors writes one file: leave --max-shard-size out, or export with --format hf\n")
    assert not (tmp_path / "two.safetensors").exists()
    out = cli(str(tmp_path / "ckpt"), str(tmp_path / "x"), "--max-shard-size", "5XB")
    assert out.returncode == 2 and "--max-shard-size '5XB'" in out.stderr


def test_refused_export_writes_nothing(tmp_path, monkeypatch):
    make_hf("gpt2", tmp_path / "in", vocab=260)
    checkpoint_of(tmp_path / "in", tmp_path / "bare", None)
    with pytest.raises(CheckpointError, match=r"config: the manifest has no training config"):
        hf.export_checkpoint(tmp_path / "bare", tmp_path / "out")
    config = train_config(tmp_path / "in")
    config["model"]["n_head"] = 3
    checkpoint_of(tmp_path / "in", tmp_path / "odd", config)       # 32 not divisible by 3
    with pytest.raises(CheckpointError, match="n_embd=32 is not divisible by n_head=3"):
        hf.export_checkpoint(tmp_path / "odd", tmp_path / "out")
    config["model"].update(n_head=4, n_layer=3)
    checkpoint_of(tmp_path / "in", tmp_path / "short", config)
    with pytest.raises(CheckpointError, match="mismatch: .*transformer.h.2.ln_1.weight is "
                                              "not in the checkpoint"):
        hf.export_checkpoint(tmp_path / "short", tmp_path / "out")
    checkpoint_of(tmp_path / "in", tmp_path / "good", train_config(tmp_path / "in"))
    from mpishard.checkpoint.shards import SafetensorsWriter

    calls = []

    def failing(self, key, array):
        calls.append(key)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return real(self, key, array)

    real = SafetensorsWriter.write
    monkeypatch.setattr(SafetensorsWriter, "write", failing)
    with pytest.raises(OSError, match="No space left"):
        hf.export_checkpoint(tmp_path / "good", tmp_path / "out", max_shard_bytes=10_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "good", "in", "odd", "short"]


def test_load_pretrained_one_process_and_consolidated(tmp_path):
    """load_pretrained on a one-process strategy; a .safetensors file is a consolidated export."""
    from mpishard.checkpoint import consolidate
    from mpishard.comm import Mesh
    from mpishard.models import GPT
    from mpishard.parallel import wrap_model

    make_hf("gpt2", tmp_path / "in", vocab=260)
    checkpoint_of(tmp_path / "in", tmp_path / "ckpt", train_config(tmp_path / "in"))
    consolidate(tmp_path / "ckpt", tmp_path / "one.safetensors")
    want = hf.from_pretrained(tmp_path / "in")
    cfg = hf.config_from_pretrained(tmp_path / "in")
    with one_process() as comm:
        for source in (tmp_path / "in", tmp_path / "one.safetensors"):
            strategy = wrap_model(GPT(cfg, seed=5, materialize_now=False), Mesh(comm), "ddp")
            hf.load_pretrained(strategy, source)
            for name, value in strategy.gather_full_params().items():
                assert np.array_equal(value, dict(want.named_parameters())[name].data), name
        other = GPT(type(cfg)(**{**asdict(cfg), "n_head": 2}), materialize_now=False)
        with pytest.raises(CheckpointError, match="n_head=4, but the model has n_head=2"):
            hf.load_pretrained(wrap_model(other, Mesh(comm), "ddp"), tmp_path / "in")
