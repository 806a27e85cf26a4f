"""What a new user meets first: a truthful estimate, runs that cannot be clobbered,
errors once and only the error, and a run that says what happened.

Each test runs the ``mpishard`` command as a user would (under ``mpiexec`` where
ranks matter) and checks its output and files.
"""
import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
FAST = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
        "--batch-size", "2", "--max-bytes", "20000", "--eval-batches", "1", "--progress", "false"]
XL = ["--vocab-size", "50304", "--n-layer", "48", "--n-head", "25", "--n-embd", "1600",
      "--block-size", "1024", "--batch-size", "1"]


from ckpt_scripts.common import ranks_stderr, run_mpishard as mpishard  # noqa: E402


def figures(text: str) -> dict:
    """``{label: MiB}`` of the plan lines, ``traffic`` split per axis."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if "MiB" in parts and parts.index("MiB") >= 2:
            at = parts.index("MiB")
            out.setdefault(" ".join(parts[:at - 1]), float(parts[at - 1]))
        if line.strip().startswith("traffic"):
            inside = line[line.index("(") + 1:line.index(" MiB)")]
            out.update({f"bus {a}": float(v) for a, v in (p.split() for p in inside.split(", "))})
    return out


# -- the estimate and the plan tell the truth -------------------------------------

def test_estimate_plans_the_layout_it_is_given():
    dp8 = mpishard("estimate", *XL, "--dp", "8", "--strategy", "zero3")
    tp8 = mpishard("estimate", *XL, "--dp", "8", "--tp", "8", "--strategy", "zero3")
    pp8 = mpishard("estimate", *XL, "--pp", "8", "--micro-steps", "8", "--strategy", "ddp")
    for out in (dp8, tp8, pp8):
        assert out.returncode == 0, out.stderr
    a, b, c = figures(dp8.stdout), figures(tp8.stdout), figures(pp8.stdout)
    assert "zero3 on dp=8 x tp=8 x pp=1" in tp8.stdout
    # tp splits every matrix 8 ways (norms, biases and positions stay whole)
    assert 7.0 < a["params"] / b["params"] < 8.0 and 7.0 < a["optim"] / b["optim"] < 8.0
    assert b["activations"] < a["activations"] / 2          # split heads and MLP widths
    assert a["bus tp"] == 0 < b["bus tp"] and b["bus dp"] < a["bus dp"] / 7
    # pp: one stage's blocks (the busiest stage), 7 micro-batches alive under 1F1B
    full = figures(mpishard("estimate", *XL, "--strategy", "ddp").stdout)
    assert c["params"] < full["params"] / 6 and c["bus pp"] > 0
    assert "7 micro-batch(es) of 1 x 1024" in pp8.stdout and "pipeline stage" in pp8.stdout


def test_train_plan_counts_tensor_and_pipeline_traffic():
    # (a batch of 4: each tp rank sends half the rows, and 2 KiB would print as 0.00 MiB)
    out = mpishard("train", *FAST, "--n-layer", "2", "--tp", "2", "--pp", "2", "--micro-steps",
                   "2", "--batch-size", "4", "--strategy", "zero1", "--dry-run", n=4)
    assert out.returncode == 0, out.stderr
    f = figures(out.stdout)
    assert f["bus tp"] > 0 and f["bus pp"] > 0 and f["bus tied"] > 0
    assert "comm buffers" in out.stdout and "traffic" in out.stdout
    assert not re.search(r"^\s+comm\s+\d", out.stdout, re.M)   # no two lines called 'comm'
    assert out.stdout.strip().endswith("dry run: nothing was trained")


def test_ddp_and_zero1_hold_the_same_gradients_on_one_rank():
    ddp = figures(mpishard("estimate", "--strategy", "ddp").stdout)
    zero1 = figures(mpishard("estimate", "--strategy", "zero1").stdout)
    assert ddp["grads"] == zero1["grads"] == ddp["params"] > 0


def test_estimate_help_shows_only_what_it_reads():
    text = mpishard("estimate", "--help").stdout
    assert "--tp" in text and "--batch-size" in text and "--activation-checkpointing" in text
    for ignored in ("--lr", "--seed", "--metrics", "--checkpoint-dir", "--steps"):
        assert ignored + " " not in text, ignored


# -- never lose a run ---------------------------------------------------------------

def test_a_fresh_run_never_clobbers_an_earlier_one(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    base = [*FAST, "--steps", "2", "--checkpoint-dir", ckpt, "--metrics", metrics]
    assert mpishard("train", *base, n=2).returncode == 0
    lines = metrics.read_text().splitlines()
    again = mpishard("train", *base, n=2)
    assert again.returncode == 2 and "--resume true" in again.stderr \
        and "--overwrite true" in again.stderr and "step-2" in again.stderr
    assert metrics.read_text().splitlines() == lines and (ckpt / "step-2").is_dir()
    # the metrics file alone is protected too
    other = mpishard("train", *FAST, "--steps", "1", "--metrics", metrics, n=2)
    assert other.returncode == 2 and f"{metrics} already holds {len(lines)} records" \
        in other.stderr
    # resume continues both, appending
    more = mpishard("train", *[*FAST, "--steps", "3", "--checkpoint-dir", ckpt, "--metrics",
                               metrics], "--resume", "true", n=2)
    assert more.returncode == 0, more.stderr
    assert metrics.read_text().splitlines()[:len(lines)] == lines
    assert (ckpt / "step-3").is_dir()
    # overwrite deletes the old checkpoints and starts the metrics afresh
    fresh = mpishard("train", *base, "--steps", "1", "--overwrite", "true", n=2)
    assert fresh.returncode == 0, fresh.stderr
    assert "deleted 2 checkpoint(s)" in fresh.stdout
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == ["step-1"]
    assert json.loads(metrics.read_text().splitlines()[0])["step"] == 0


def test_resume_needs_a_checkpoint_dir_that_holds_this_model(tmp_path):
    out = mpishard("train", *FAST, "--resume", "true")
    assert out.returncode == 2 and "resume = true needs checkpoint_dir" in out.stderr
    # checked before the data are read: the data path is bad too
    out = mpishard("train", *FAST, "--resume", "true", "--checkpoint-dir", tmp_path / "nope",
                   "--data", "/no/such/path")
    assert out.returncode == 2 and "found no complete checkpoint" in out.stderr
    ckpt = tmp_path / "ckpt"
    assert mpishard("train", *FAST, "--steps", "1", "--checkpoint-dir", ckpt).returncode == 0
    out = mpishard("train", *FAST, "--n-layer", "2", "--n-embd", "32", "--steps", "2",
                   "--checkpoint-dir", ckpt, "--resume", "true")
    assert out.returncode == 2
    assert "written for n_layer=1, n_embd=16; this run has n_layer=2, n_embd=32" in out.stderr


def test_resuming_on_other_ranks_says_the_global_batch_changes(tmp_path):
    ckpt, copy = tmp_path / "ckpt", tmp_path / "copy"
    assert mpishard("train", *FAST, "--steps", "1", "--checkpoint-dir", ckpt, n=2).returncode == 0
    shutil.copytree(ckpt, copy)
    out = mpishard("train", *FAST, "--checkpoint-dir", ckpt, "--steps", "2", "--resume", "true")
    assert out.returncode == 0, out.stderr
    assert "resuming a run of global batch 4 (2 per rank x 1 micro-steps x 2 dp ranks) with " \
           "global batch 2" in out.stdout and "--global-batch 4" in out.stdout
    args = [*FAST, "--checkpoint-dir", copy]
    kept = mpishard("train", *args, "--steps", "2", "--resume", "true", "--global-batch", "4")
    assert kept.returncode == 0, kept.stderr
    assert "global batch" not in kept.stdout and "x 2 micro-steps x 1 dp ranks" in kept.stdout
    bad = mpishard("train", *args, "--steps", "4", "--resume", "true", "--global-batch", "5")
    assert bad.returncode == 2 and "global_batch = 5 is not a multiple of batch_size 2" \
        in bad.stderr


def test_data_cuts_are_said_and_token_folders_refused(tmp_path):
    out = mpishard("train", *FAST[:-4], "--progress", "false", "--steps", "1", "--dry-run")
    assert out.returncode == 0 and "the first 20,000 of" in out.stdout
    text = tmp_path / "all.txt"
    text.write_bytes(b"hello mpishard " * 4000)                      # 60,000 bytes
    out = mpishard("train", *[a for a in FAST if a not in ("--max-bytes", "20000")],
                   "--data", text, "--steps", "1", "--dry-run")
    assert out.returncode == 0 and "54,000 train / 6,000 val bytes" in out.stdout
    assert "the first" not in out.stdout
    prepared = tmp_path / "shakespeare"               # as nanoGPT's BPE prepare.py leaves it
    prepared.mkdir()
    for name in ("train.bin", "val.bin"):
        (prepared / name).write_bytes((np.arange(400) % 65).astype("<u2").tobytes())
    no_cut = [a for a in FAST if a not in ("--max-bytes", "20000")]
    out = mpishard("train", *no_cut, "--data", prepared)
    assert out.returncode == 2 and "--vocab-size N (50257 for GPT-2's BPE" in out.stderr
    out = mpishard("train", *no_cut, "--data", prepared, "--vocab-size", "65", "--steps", "1")
    assert out.returncode == 0, out.stderr
    assert "400 train / 400 val tokens (uint16, vocabulary 65)" in out.stdout
    (prepared / "meta.pkl").write_bytes(b"cos\nsystem\n(Vtouch " + str(tmp_path).encode()
                                        + b"/ran\ntR.")          # os.system("touch .../ran")
    out = mpishard("train", *no_cut, "--data", prepared, "--vocab-size", "65", "--steps", "1")
    assert out.returncode == 2 and not (tmp_path / "ran").exists()
    assert "meta.pkl names the Python object os.system: refused" in out.stderr
    out = mpishard("train", *no_cut, "--data", prepared / "train.bin")
    assert out.returncode == 2 and "folder holding both" in out.stderr


def test_nanogpt_character_data_trains_and_samples_characters(tmp_path):
    """A folder as nanoGPT's shakespeare_char/prepare.py writes it: the vocabulary comes
    from its meta.pkl (no --vocab-size), and the samples are its characters."""
    from test_meta_pkl import N_CHARS, TEXT, write_shakespeare_char

    data, ckpt = write_shakespeare_char(tmp_path / "shakespeare_char"), tmp_path / "ckpt"
    tiny = [a for a in FAST if a not in ("--max-bytes", "20000")]
    out = mpishard("train", *tiny, "--data", data, "--steps", "2", "--checkpoint-dir", ckpt,
                   "--sample-tokens", "60", "--sample-prompt", "All:", n=2)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"tokens (uint16, vocabulary {N_CHARS})" in out.stdout
    # wte N_CHARS x 16 (tied head), a 16-wide block, positions 16 x 16: not GPT-2's 50257 rows
    n_params = N_CHARS * 16 + 16 * 16 + 12 * 16 * 16 + 13 * 16 + 2 * 16
    assert f": {n_params:,} parameters" in out.stdout
    sample = out.stdout.split("sample:\n", 1)[1].split("\nval loss", 1)[0]
    assert sample.startswith("All:") and len(sample) == len("All:") + 60
    assert set(sample) <= set(TEXT)
    out = mpishard("sample", "--checkpoint", ckpt, "--prompt", "Speak", "--tokens", "40")
    assert out.returncode == 0, out.stderr
    text = out.stdout[:-1]                                    # print's own line break
    assert text.startswith("Speak") and len(text) == len("Speak") + 40 and set(text) <= set(TEXT)
    out = mpishard("sample", "--checkpoint", ckpt, "--prompt", "Zounds")
    assert out.returncode == 2
    assert f"holds 'Z', which is not one of the {N_CHARS} characters of" in out.stderr


TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 1024,
              "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
              "num_hidden_layers": 1, "intermediate_size": 64, "max_position_embeddings": 128,
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def test_data_of_another_tokenizer_says_to_prepare_with_the_models_own(tmp_path):
    """--init-from a model (vocabulary 1024) with --data tokenized by a 4096-token BPE:
    no --vocab-size was given, so the fix is the model's tokenizer.json, not a flag."""
    model = tmp_path / "models" / "tiny-llama"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))      # weights never read
    data = tmp_path / "data" / "bpe"
    data.mkdir(parents=True)
    ids = np.random.default_rng(0).integers(0, 4096, 3000).astype("<u2")
    ids[:2700].tofile(data / "train.bin")
    ids[2700:].tofile(data / "val.bin")
    (data / "meta.json").write_text('{"dtype": "uint16", "vocab_size": 4096}')
    out = mpishard("train", "--init-from", model, "--data", data, "--steps", "1",
                   "--progress", "false")
    assert out.returncode == 2, out.stdout + out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert f"the model in {model} has a vocabulary of 1024 ids, but {data}/meta.json says the " \
           f"ids of {data} come from one of 4096" in line
    assert f"(its tokenizer.json, which {model} does not hold): mpishard prepare TEXT_PATH " \
           f"OUT_DIR --tokenizer TOKENIZER_JSON" in line                # no file to name
    assert "--vocab-size" not in line
    (data / "meta.json").write_text('{"dtype": "uint16", "vocab_size": 512}')
    ids[ids >= 512] = 7
    ids[:2700].tofile(data / "train.bin")
    ids[2700:].tofile(data / "val.bin")
    out = mpishard("train", "--init-from", model, "--data", data, "--dry-run", "true",
                   "--progress", "false")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"vocab_size 1024 (the config.json of --init-from {model}) pads the 512 token ids" \
           in out.stdout and "--tokenizer" in out.stdout


def test_a_model_folder_and_text_read_as_bytes(tmp_path):
    """Without --data the text is bytes (256 ids): a model of 300 trains with the note
    that its vocabulary pads them; one of 200 cannot, and the fix is token data made by
    its tokenizer (named: the folder holds it), not --vocab-size, which --init-from
    refuses."""
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**TINY_LLAMA, "vocab_size": 300}))
    out = mpishard("train", "--init-from", model, "--dry-run", "true", "--progress", "false")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"vocab_size 300 (the config.json of --init-from {model}) pads the 256 byte " \
           f"values of the text: right only if the model's own tokenizer made such ids" \
           in out.stdout
    (model / "config.json").write_text(json.dumps({**TINY_LLAMA, "vocab_size": 200}))
    (model / "tokenizer.json").write_text("{}")
    out = mpishard("train", "--init-from", model, "--dry-run", "true", "--progress", "false")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr == (f"mpishard: error: the model in {model} has a vocabulary of 200 "
                          f"ids, fewer than the 256 byte values text is read as; tokenize "
                          f"the text with the model's own tokenizer: mpishard prepare "
                          f"TEXT_PATH OUT_DIR --tokenizer {model}/tokenizer.json, then train "
                          f"on --data OUT_DIR\n")


# -- errors once, and only the error -----------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--lr=-1e-3"], "lr must be >= 0.0, got -0.001"),
    (["--tp", "2", "--pp", "2", "--n-layer", "2"], "tp=2 x pp=2 = 4 exceeds the world size 2"),
    (["--dropout", "1.5"], "dropout = 1.5: must be below 1.0"),
])
def test_an_agreed_error_is_one_line_and_no_abort(args, message):
    """Every rank exits 2 and MPI is finalised, not aborted: MPICH prints nothing more;
    Open MPI's launcher adds its own note that a process exited with status 2."""
    from mpi4py import MPI

    out = mpishard("train", *FAST, *args, n=2)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[0] == f"mpishard: error: {lines[0].split(': ', 2)[2]}" and message in lines[0]
    if MPI.get_vendor()[0] == "MPICH":
        assert len(lines) == 1, lines
    else:
        assert "exited with non-zero status" in out.stderr and "Exit code:    2" in out.stderr
    assert "Abort" not in out.stderr and "MPI_ABORT" not in out.stderr
    assert "Traceback" not in out.stderr
    assert "mpishard train:" not in out.stdout                # nothing was planned


def test_a_missing_init_from_is_refused_before_anything_is_planned(tmp_path):
    for path, found in ((tmp_path / "models" / "tiny-llama", "does not exist"),
                        (tmp_path, "is a folder without a config.json")):
        out = mpishard("train", *FAST, "--init-from", path, "--steps", "1", n=2)
        assert out.returncode == 2, out.stdout + out.stderr
        assert ranks_stderr(out.stderr) == (f"mpishard: error: --init-from {path} {found}; pass a Hugging "
                              f"Face model folder (config.json and its safetensors files) or a "
                              f"consolidated mpishard .safetensors file\n")
        assert out.stdout == ""                                   # no plan, no rank lines


def test_a_mistyped_flag_or_key_names_the_real_one(tmp_path):
    out = mpishard("train", "--n-layers", "2")
    assert out.returncode == 2
    assert out.stderr == ("mpishard train: error: unrecognized arguments: --n-layers 2; did you "
                          "mean --n-layer? (see mpishard train --help)\n")
    out = mpishard("train", "--learning-rate", "0.1", n=2)
    assert out.returncode == 2 and len(ranks_stderr(out.stderr).splitlines()) == 1  # rank 0 only
    assert "did you mean --lr?" in out.stderr
    for args, message in ((["train", "--steps", "abc"], "argument --steps: invalid int value"),
                          (["trian"], "argument command: invalid choice: 'trian'"),
                          ([], "the following arguments are required: command")):
        out = mpishard(*args)
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
        assert message in out.stderr and "--help)" in out.stderr
    cfg = tmp_path / "c.toml"
    cfg.write_text("[optim]\nlearning_rate = 0.1\n")
    out = mpishard("train", "--config", cfg)
    assert out.returncode == 2 and "unknown config key 'learning_rate' in [optim]; did you " \
        "mean 'lr'?" in out.stderr


# -- say what happened ----------------------------------------------------------------------

def test_validation_losses_are_printed_and_rank_logs_are_their_own(tmp_path):
    logs = tmp_path / "logs"
    out = mpishard("train", *FAST, "--steps", "4", "--eval-interval", "2", "--log-dir", logs,
                   n=2)
    assert out.returncode == 0, out.stderr
    assert "step 0: val loss" in out.stdout and "step 2: val loss" in out.stdout
    # each rank's line, and on CPUs nothing about CUDA or NCCL
    assert "rank 1/2 on " in out.stdout and "device numpy/cpu" in out.stdout
    assert "CUDA" not in out.stdout and "NCCL" not in out.stdout
    rank0, rank1 = (logs / "rank-0.log").read_text(), (logs / "rank-1.log").read_text()
    assert "mpishard train:" in rank0 and "mpishard train:" not in rank1
    own = [line for line in rank1.splitlines() if " held, collectives " in line]
    assert len(own) == 4 and all("dp " in line for line in own)


def test_help_names_the_environment_variables():
    text = mpishard("train", "--help").stdout
    for var in ("MPISHARD_TIMEOUT", "MPISHARD_DEBUG", "MPISHARD_COMM_BACKEND",
                "MPISHARD_CUDA_AWARE", "OMP_NUM_THREADS"):
        assert var in text
