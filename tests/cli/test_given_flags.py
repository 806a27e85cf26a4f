"""What a user gives is honoured or refused in one line, never ignored: layout flags under
``mpishard plan`` and ``--layout auto``, ``--memory-budget`` there, sampling's values, the
prompt of ``--sample-tokens`` (checked before the first step), an export's output path, and
a resume that has nothing left to train."""
import sys
import threading

import pytest

from mpishard.cli.main import main

TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
        "--batch-size", "4", "--max-bytes", "200000", "--progress", "false",
        "--eval-interval", "0", "--eval-batches", "1"]


@pytest.fixture
def keep_hooks(monkeypatch):
    """main() installs an abort-on-exception hook; put the test process's back after."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)


def _rows(text: str) -> list:
    """The table rows of ``mpishard plan``: ``(dp, cp, tp, pp, strategy, ckpt)``."""
    rows = []
    for line in text.splitlines():
        cells = line.split()
        if len(cells) > 7 and cells[0].isdigit() and cells[5] in ("ddp", "zero1", "zero2",
                                                                     "zero3"):
            rows.append((cells[1], cells[2], cells[3], cells[4], cells[5], cells[7]))
    return rows


def test_plan_keeps_the_layout_flags_given(keep_hooks, capsys):
    assert main(["plan", "--ranks", "4", "--top", "50"]) == 0
    free = _rows(capsys.readouterr().out)
    assert {r[2] for r in free} > {"2"}                 # tp is chosen when not given
    assert main(["plan", "--ranks", "4", "--top", "50", "--tp", "2", "--strategy", "zero1",
                 "--activation-checkpointing", "selective"]) == 0
    out = capsys.readouterr().out
    kept = _rows(out)
    assert kept and all(r[2] == "2" and r[4] == "zero1" and r[5] == "sel" for r in kept), out
    assert "with strategy=zero1, tp=2, activation_checkpointing=selective" in out
    assert main(["plan", "--ranks", "4", "--tp", "3"]) == 2
    assert "no layout of 4 ranks (global batch 32) has tp=3" in capsys.readouterr().err


def test_layout_auto_fits_the_memory_budget_and_keeps_or_replaces_given_keys(keep_hooks,
                                                                               capsys):
    from mpishard.config.sections import load_config
    from mpishard.cli.plan import apply_auto_layout
    from mpishard.core.backend import Backend
    from mpishard.planning.layout import estimate_layout
    from mpishard.recipes import recipe_for
    from mpishard.run.train import layout_of

    def planned_bytes(cfg, ranks):
        dp = ranks // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
        recipe = recipe_for(cfg)
        return estimate_layout(recipe.model(Backend()),
                               layout_of(cfg, dp, recipe)).total_peak_bytes

    flags = {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32, "batch_size": 4}
    free = load_config(None, {**flags, "layout": "auto"})
    apply_auto_layout(free, 4)
    budget = planned_bytes(free, 4) - 1              # the unbudgeted choice no longer fits
    given = set()
    cfg = load_config(None, {**flags, "layout": "auto", "memory_budget": budget}, None, given)
    line = apply_auto_layout(cfg, 4, given)
    assert planned_bytes(cfg, 4) <= budget, line
    given = set()
    cfg = load_config(None, {**flags, "layout": "auto", "tp": 2, "strategy": "zero1"}, None,
                      given)
    line = apply_auto_layout(cfg, 4, given)
    assert (cfg.parallel.tp, cfg.parallel.strategy) == (2, "zero1")
    assert "(strategy=zero1, tp=2 as given)" in line
    given = set()
    cfg = load_config(None, {**flags, "layout": "auto-all", "tp": 2, "pp": 2}, None, given)
    line = apply_auto_layout(cfg, 2, given)        # tp 2 x pp 2 cannot fit 2 ranks
    assert cfg.parallel.tp * cfg.parallel.pp <= 2
    assert "(replacing the given tp=2, pp=2)" in line
    assert main(["train", *TINY, "--layout", "auto", "--memory-budget", "10KiB",
                 "--dry-run", "true"]) == 2
    assert "fits 10.0 KiB (--memory-budget) per rank" in capsys.readouterr().err


def test_a_given_offload_is_kept_by_layout_auto_and_replaced_by_auto_all(keep_hooks):
    """``--offload none`` under ``--layout auto`` proposes no offload where only an
    offloaded layout fits (it was overridden without a word); ``auto-all`` replaces it."""
    from mpishard.config.sections import ConfigError, load_config
    from mpishard.cli.plan import apply_auto_layout

    flags = {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 16, "batch_size": 1,
             "machine": "h100-sxm", "memory_budget": 500 << 10}
    cfg = load_config(None, {**flags, "layout": "auto"})
    assert "offload optimizer" in apply_auto_layout(cfg, 2)    # only offloaded layouts fit
    given = set()
    cfg = load_config(None, {**flags, "layout": "auto", "offload": "none"}, None, given)
    with pytest.raises(ConfigError, match="--offload optimizer \\(or params\\) in place of "
                                          "--offload none"):
        apply_auto_layout(cfg, 2, given)
    given = set()
    cfg = load_config(None, {**flags, "layout": "auto-all", "offload": "none"}, None, given)
    line = apply_auto_layout(cfg, 2, given)
    assert cfg.parallel.offload == "optimizer" and "(replacing the given offload=none)" in line


def test_a_run_whose_plan_is_over_its_memory_budget_does_not_start(keep_hooks, capsys):
    """The ledger refuses model state past ``--memory-budget``, not activations: a plan
    over the budget is refused before step 1 (it printed "DOES NOT FIT" and trained)."""
    assert main(["train", *TINY, "--steps", "2", "--memory-budget", "500KiB"]) == 2
    captured = capsys.readouterr()
    assert "  budget          0.49 MiB per rank: does not fit" in captured.out
    assert "step 1/2" not in captured.out
    assert captured.err.startswith("mpishard: error: the plan above needs ")
    assert "over --memory-budget 500.0 KiB; use more ranks, a smaller --batch-size, " \
        "--activation-checkpointing full, --offload optimizer, or a larger budget" \
        in captured.err                      # zero3 already: not proposed again
    assert main(["train", *TINY, "--steps", "2", "--memory-budget", "500KiB",
                 "--dry-run", "true"]) == 0
    assert "note: a real run would stop here: the plan above needs " in capsys.readouterr().out


def test_plan_and_layout_auto_take_the_mlp(keep_hooks, capsys):
    assert main(["plan", "--model", "mlp", "--ranks", "2", "--top", "1"]) == 0
    assert "ddp" in capsys.readouterr().out


def test_sampling_values(tmp_path, keep_hooks, capsys):
    ckpt = tmp_path / "ck"
    assert main(["train", *TINY, "--steps", "2", "--checkpoint-dir", str(ckpt)]) == 0
    capsys.readouterr()
    sample = ["sample", "--checkpoint", str(ckpt), "--tokens", "12"]
    assert main([*sample, "--temperature", "0", "--seed", "1"]) == 0
    greedy = capsys.readouterr().out
    assert main([*sample, "--temperature", "0", "--seed", "2"]) == 0
    assert capsys.readouterr().out == greedy            # the most likely token each time
    for flags, message in ((["--temperature", "-1"], "--temperature -1.0 must be >= 0"),
                           (["--top-k", "-3"], "--top-k -3 must be >= 0")):
        assert main([*sample, *flags]) == 2
        assert message in capsys.readouterr().err
    assert main([*sample, "--top-k", "0"]) == 0         # all tokens


def test_a_prompt_that_cannot_be_read_stops_the_run_before_it_trains(tmp_path, keep_hooks,
                                                                       capsys):
    metrics = tmp_path / "m.jsonl"
    status = main(["train", *TINY, "--steps", "2", "--sample-tokens", "5", "--sample-prompt",
                   "", "--metrics", str(metrics)])
    err = capsys.readouterr().err
    assert status == 2 and "--sample-prompt is empty (no tokens)" in err, err
    assert not metrics.exists()                          # no step was taken


def test_resume_with_nothing_left_to_train_says_so(tmp_path, keep_hooks, capsys):
    ckpt = tmp_path / "ck"
    assert main(["train", *TINY, "--steps", "3", "--checkpoint-dir", str(ckpt)]) == 0
    capsys.readouterr()
    assert main(["train", *TINY, "--steps", "2", "--checkpoint-dir", str(ckpt),
                 "--resume", "true"]) == 0
    out = capsys.readouterr().out
    assert "nothing to train: the checkpoint is at step 3 and --steps is 2; pass --steps " \
           "above 3 to train on" in out, out
    assert "val loss" not in out


def test_an_export_into_a_folder_or_under_a_file_is_refused_before_writing(tmp_path,
                                                                         keep_hooks, capsys):
    ckpt = tmp_path / "ck"
    assert main(["train", *TINY, "--steps", "1", "--checkpoint-dir", str(ckpt)]) == 0
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out, message in ((tmp_path, "is a folder; pass a file name, e.g. "),
                         (a_file / "m.safetensors", "a file, so nothing can be written there")):
        capsys.readouterr()
        assert main(["checkpoint", "consolidate", str(ckpt), str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mpishard: error: ") and message in err, err
    assert not list(tmp_path.glob("*.tmp*"))
    deep = tmp_path / "new" / "folder" / "m.safetensors"
    assert main(["checkpoint", "consolidate", str(ckpt), str(deep)]) == 0 and deep.is_file()


def test_sampling_a_token_model_whose_data_is_gone_says_so(tmp_path, keep_hooks, capsys):
    """A model of token ids whose folder (and tokenizer) moved away: one line naming the
    folder, not bytes read from token ids."""
    tokens = tmp_path / "tokens"
    assert main(["prepare", "default", str(tokens), "--train-bpe", "300", "--max-bytes",
                 "60000", "--progress", "false"]) == 0
    ckpt = tmp_path / "ck"
    flags = [f for f in TINY if f not in ("--max-bytes", "200000")]
    assert main(["train", *flags, "--steps", "1", "--data", str(tokens),
                 "--checkpoint-dir", str(ckpt)]) == 0
    tokens.rename(tmp_path / "moved")
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(ckpt), "--tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert f"the data this model was trained on, {tokens}, is gone" in err, err


def test_a_diverged_run_ends_with_status_3(keep_hooks, capsys):
    """A loss that is not finite stops the run with a line saying so and status 3, which
    mpishard supervise takes as final (a restart would diverge again)."""
    from mpishard.run.supervise import FINAL

    status = main(["train", *TINY, "--steps", "8", "--lr", "1e4", "--warmup-steps", "0",
                   "--grad-clip", "0"])
    out = capsys.readouterr().out
    assert status == 3 and "diverged: the loss was not finite at step" in out, out
    assert "val loss" not in out.splitlines()[-1]
    assert 3 in FINAL


def test_a_resume_names_the_settings_it_changes(tmp_path, keep_hooks, capsys):
    ckpt = tmp_path / "ck"
    assert main(["train", *TINY, "--steps", "2", "--checkpoint-dir", str(ckpt)]) == 0
    capsys.readouterr()
    assert main(["train", *TINY, "--steps", "3", "--lr", "0.001", "--checkpoint-dir",
                 str(ckpt), "--resume", "true"]) == 0
    out = capsys.readouterr().out
    assert "note: resuming with --steps 3 (was 2), --lr 0.001 (was 0.003)" in out, out
    assert main(["train", *TINY, "--steps", "4", "--lr", "0.001", "--checkpoint-dir",
                 str(ckpt), "--resume", "true"]) == 0
    assert "--lr 0.001 (was" not in capsys.readouterr().out      # the same as the last run
    assert main(["train", *TINY, "--steps", "5", "--lr", "0.001", "--checkpoint-dir",
                 str(ckpt), "--resume", "true", "--dropout", "0.2", "--dtype", "float64"]) == 0
    assert "note: resuming with --dtype 'float64' (was 'float32'), --dropout 0.2 (was 0.0), " \
        "--steps 5 (was 4)" in capsys.readouterr().out      # they shape no parameter


def test_sampling_a_byte_model_of_a_wider_vocabulary_needs_no_data(tmp_path, keep_hooks,
                                                                   capsys):
    """A model of bytes whose vocabulary is wider than 256 (its own choice) and whose text
    moved away samples (ids past the bytes as "?"): only token data need their folder."""
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 2000)
    ckpt = tmp_path / "ck"
    flags = [f for f in TINY if f not in ("--max-bytes", "200000")]
    assert main(["train", *flags, "--steps", "1", "--data", str(text), "--vocab-size", "300",
                 "--checkpoint-dir", str(ckpt)]) == 0
    text.rename(tmp_path / "moved.txt")
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(ckpt), "--tokens", "4"]) == 0
