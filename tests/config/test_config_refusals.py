"""Every combination a model or an axis cannot train is refused by the CLI's config check.

Each case runs ``mpishard train ... --dry-run`` in this process (``main``): the
configuration check refuses it with exit status 2 and one line on stderr, before
any data is read or any model is built (one that slipped through would print a
plan and exit 0, or fail on the mesh with another message). See [Note: refused
before anything is built] in mpishard/config/support.py. Two cases run under
``mpiexec -n 2``: one line in all from both ranks, and the note of how tp = 3
splits 4 heads over 2 key/value heads, printed once.
"""
import sys
import threading
from pathlib import Path

import pytest

from mpishard.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
LLAMA, GPT = ["--preset", "llama-tiny"], ["--preset", "gpt-tiny"]
MOE = [*LLAMA, "--moe-experts", "4"]

CASES = {  # id: (flags, what the one line says)
    "dropout-cp": ([*GPT, "--dropout", "0.1", "--cp", "2"],
                   "dropout = 0.1 with cp = 2: context-parallel attention has no dropout"),
    "ep-dense": ([*LLAMA, "--ep", "2"], "ep = 2: expert parallelism splits the experts"),
    "ep-divide": ([*MOE, "--ep", "3"], "expert parallelism ep=3 does not divide moe_experts = 4"),
    "moe-pp": ([*MOE, "--pp", "2"], "pipeline stages cannot compute them yet"),
    "moe-checkpointing": ([*MOE, "--activation-checkpointing", "true"],
                          "activation checkpointing would recompute the routers"),
    "tp-heads": ([*LLAMA, "--tp", "8"], "tp = 8 is larger than n_head = 4"),
    "pp-blocks": ([*GPT, "--pp", "3"], "pp = 3 is larger than n_layer = 2"),
    "cp-chunks": ([*GPT, "--cp", "3"], "sequence length 64 does not divide by 2 x cp = 6"),
    "a2a-heads": ([*LLAMA, "--cp", "8", "--cp-mode", "all-to-all"],
                  "n_head = 4 does not divide by 8"),
    "sp-rows": ([*GPT, "--tp", "4", "--sequence-parallel", "true", "--batch-size", "1",
                 "--block-size", "6"], "splits the 6 rows of each micro-batch"),
    "mlp-tp": (["--model", "mlp", "--tp", "2"], "the mlp model does not split its layers"),
    "mlp-pp": (["--model", "mlp", "--pp", "2"], "the mlp model does not split its blocks"),
    "mlp-cp": (["--model", "mlp", "--cp", "2"], "the mlp model does not split its sequences"),
    "llama-bias": ([*LLAMA, "--bias", "true"], "Llama's layers have no biases"),
    "llama-dropout": ([*LLAMA, "--dropout", "0.1"], "trains without dropout"),
    "qwen2-no-bias": (["--model", "qwen2", "--bias", "false"], "Qwen2 has biases on q, k"),
    "odd-head": ([*LLAMA, "--n-embd", "60"], "head size 15 is odd"),
    "kv-heads": ([*LLAMA, "--n-kv-head", "3"], "n_kv_head=3 must divide n_head=4"),
    "width-heads": ([*GPT, "--n-embd", "63"], "n_embd=63 is not divisible by n_head=4"),
    "reduce-float32": ([*GPT, "--reduce-dtype", "bfloat16"],
                       "reduce_dtype = bfloat16: gradients are reduced in 16 bits only under "
                       "a 16-bit precision (precision = float32); add --precision bfloat16, "
                       "or use --reduce-dtype float32"),
    "reduce-bfloat16-float16": ([*GPT, "--precision", "bfloat16", "--reduce-dtype", "float16"],
                                "reduce_dtype = float16 with precision = bfloat16"),
    # a key the model would not read: never carried silently
    "other-family-key": ([*GPT, "--n-kv-head", "2"], "--n-kv-head is a key of the llama and "
                         "qwen2 models, which the gpt model does not read; leave it out, or "
                         "pass --model llama"),
    "mlp-key": ([*GPT, "--hidden", "32"], "--hidden is a key of the mlp model"),
    "moe-key-dense": ([*LLAMA, "--moe-top-k", "1"], "--moe-top-k sets up a mixture of experts, "
                      "but the model is dense (moe_experts = 0); add --moe-experts N"),
    "moe-router-dense": ([*GPT, "--moe-router", "sigmoid"], "--moe-router sets up a mixture"),
    "preset-family": (["--preset", "gpt2", "--model", "llama"],
                      "preset = 'gpt2' is a gpt shape, but model = 'llama'"),
    "lr-nan": ([*GPT, "--lr", "nan"], "lr = nan: must be a finite number"),
    "grad-clip-nan": ([*GPT, "--grad-clip", "nan"], "grad_clip = nan: must be a finite number"),
    "lr-inf": ([*GPT, "--lr", "inf"], "lr = inf: must be a finite number"),
    "moe-every-above-layers": ([*MOE, "--moe-every", "3", "--n-layer", "2"],
                               "moe_every=3 is above n_layer=2, so no block would have "
                               "experts; use moe_every <= 2"),
    "min-lr-above-lr": ([*GPT, "--lr", "0.001", "--min-lr", "0.01"],
                        "min_lr = 0.01 is above lr = 0.001: the cosine decay would raise the "
                        "rate; use --min-lr 0.001 or less"),
}


@pytest.fixture
def keep_hooks(monkeypatch):
    """main() installs an abort-on-exception hook; put the test process's back after."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)


@pytest.mark.parametrize("case", list(CASES))
def test_refused_in_the_config_check_with_one_line(case, keep_hooks, capsys):
    flags, message = CASES[case]
    status = main(["train", *flags, "--steps", "1", "--dry-run", "true"])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert status == 2 and len(lines) == 1, out.err + out.out
    assert lines[0].startswith("mpishard: error: ") and message in lines[0], lines[0]
    assert "dry run" not in out.out and "parameters" not in out.out   # nothing was planned


def test_precision_abbreviations(keep_hooks):
    from mpishard.config.sections import load_config

    for short, name in (("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")):
        assert load_config(None, {"precision": short}).parallel.precision == name
    parallel = load_config(None, {"precision": "bf16", "reduce_dtype": "bf16"}).parallel
    assert parallel.reduce_dtype == "bfloat16"


def test_reduce_dtype_reaches_the_strategy_and_the_plan(keep_hooks):
    """``--reduce-dtype`` under ``--precision bfloat16``: the run's strategy reduces its
    gradients in that dtype, and the run's plan holds it and counts the ledger's
    gradient bytes."""
    from mpi4py import MPI

    from mpishard.cli.main import build_parser
    from mpishard.comm import Communicator
    from mpishard.config.flags import config_from_args
    from mpishard.run.train import Trainer

    flags = ["train", *GPT, "--strategy", "zero1", "--precision", "bf16", "--steps", "1",
             "--max-bytes", "20000", "--batch-size", "2", "--block-size", "16"]
    for reduce in ("float32", "bfloat16"):
        cfg = config_from_args(build_parser().parse_args([*flags, "--reduce-dtype", reduce]))
        assert cfg.parallel.policy.reduce_dtype == reduce
        with Communicator(MPI.COMM_SELF.Dup(), "train", _owned=True) as comm:
            trainer = Trainer(cfg, comm)
            trainer.build()
            assert trainer.strategy.precision.reduce_dtype == reduce
            assert trainer.plan.layout.reduce_dtype == reduce
            assert trainer.run.ledger.bytes_by_category()["grads"] == \
                trainer.plan.busiest.memory.steady["grads"]
            trainer.log.close()


from ckpt_scripts.common import ranks_stderr, run_mpishard  # noqa: E402


def _mpishard(n: int, *args):
    return run_mpishard("train", *args, n=n, timeout=300)


@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec next to python")
def test_two_ranks_say_one_line_and_a_split_is_told_once():
    out = _mpishard(2, *GPT, "--dropout", "0.1", "--cp", "2", "--steps", "1")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert ranks_stderr(out.stderr).strip().splitlines() == [
        "mpishard: error: dropout = 0.1 with cp = 2: context-parallel attention has no "
        "dropout; use dropout = 0, or cp = 1"], out.stderr
    out = _mpishard(3, *LLAMA, "--tp", "3", "--steps", "1", "--dry-run", "true")
    assert out.returncode == 0, out.stderr
    told = [line for line in (out.stdout + out.stderr).splitlines() if "tp = 3:" in line]
    assert len(told) == 1 and "query heads 2+1+1 of n_head = 4" in told[0], told
    assert "the 2 key/value heads do not divide by 3" in told[0]


def test_lr_zero_keeps_the_rate_at_zero(keep_hooks):
    """``--lr 0`` alone: the default min_lr (above it) follows it down, so every step's rate
    is 0 (the help's "the parameters stay as they are"); a min_lr given stays."""
    from mpishard.config.sections import load_config
    from mpishard.optim import CosineSchedule

    o = load_config(None, {"lr": 0.0, "warmup_steps": 1, "steps": 6}).optim
    assert o.min_lr == 0.0
    schedule = CosineSchedule(o.lr, o.warmup_steps, o.steps, o.min_lr)
    assert [schedule(s) for s in range(8)] == [0.0] * 8
    assert load_config(None, {"lr": 1e-3, "min_lr": 1e-5}).optim.min_lr == 1e-5
    assert load_config(None, {}).optim.min_lr == 3e-4      # the default, under the default lr


def _write(path: Path, data) -> str:
    path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
    return str(path)


def test_files_that_cannot_be_read_or_written_are_refused_with_one_line(tmp_path, keep_hooks,
                                                                          capsys):
    """A config that is a folder, not text or a misspelt table, and output paths nothing
    can be written to: one ``mpishard: error:`` line each, before data are read or anything
    is built (not a traceback, not the first save after training)."""
    a_file = _write(tmp_path / "a_file", "x")
    cases = [
        (["--config", str(tmp_path)], "is a folder; pass a TOML file"),
        (["--config", _write(tmp_path / "bin.toml", b"\xd0\xff\x00")], "is not valid TOML"),
        (["--config", _write(tmp_path / "typo.toml", "[modle]\nn_layer = 3\n")],
         "unknown config table [modle] in"),
        (["--checkpoint-dir", a_file], f"--checkpoint-dir {a_file} is a file, not a folder"),
        (["--log-dir", a_file], f"--log-dir {a_file} is a file, not a folder"),
        (["--metrics", str(tmp_path)], f"--metrics {tmp_path} is a folder; pass a file name"),
        (["--metrics", f"{a_file}/m.jsonl"], f"lies under {a_file}, a file, so nothing can "
                                             f"be written there"),
    ]
    if Path("/proc/self").is_dir():     # a folder that takes no new entries (as root too)
        cases += [(["--checkpoint-dir", "/proc/mpishard-ck"], "--checkpoint-dir "
                   "/proc/mpishard-ck cannot be written: writing in /proc fails"),
                  (["--metrics", "/proc/m.jsonl"], "--metrics /proc/m.jsonl cannot be "
                   "written: writing in /proc fails"),
                  (["--log-dir", "/proc/logs"], "--log-dir /proc/logs cannot be written")]
    for flags, message in cases:     # the paths: checked as the run starts (no dry run)
        dry = ["--dry-run", "true"] if flags[0] == "--config" else []
        status = main(["train", *GPT, *flags, "--steps", "1", *dry])
        out = capsys.readouterr()
        lines = out.err.strip().splitlines()
        assert status == 2 and len(lines) == 1, (flags, out.err + out.out)
        assert lines[0].startswith("mpishard: error: ") and message in lines[0], lines[0]
    assert "did you mean [model]?" in str(_refusal(tmp_path / "typo.toml"))


def _refusal(path):
    from mpishard.config.sections import ConfigError, load_config
    with pytest.raises(ConfigError) as err:
        load_config(path)
    return err.value


def test_a_saved_config_is_read_as_it_was_written(keep_hooks):
    """A checkpoint's config from before min_lr was bounded (the old default over a lower
    lr) loads as it is, so its run resumes and samples; only a given min_lr is refused."""
    from dataclasses import asdict

    from mpishard.config.sections import (ConfigError, TrainConfig, config_from_dict,
                                          flat_values, load_config)

    saved = asdict(TrainConfig())
    saved["optim"].update(lr=1e-4, min_lr=3e-4)
    before = config_from_dict(flat_values(saved, "checkpoint", []))
    assert (before.optim.lr, before.optim.min_lr) == (1e-4, 3e-4)
    with pytest.raises(ConfigError, match="min_lr = 0.0003 is above lr = 0.0001"):
        load_config(None, {"lr": 1e-4, "min_lr": 3e-4})
