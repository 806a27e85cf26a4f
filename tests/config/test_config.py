"""The training configuration: sections, flat keys of older files, types, bounds, --help."""
import argparse
from dataclasses import asdict

import pytest

from mpishard.config.sections import KEYS, SECTIONS, ConfigError, config_from_dict, flat_values, load_config
from mpishard.config.flags import add_config_flags


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_sections_read_into_their_dataclasses(tmp_path):
    cfg = load_config(write(tmp_path, "[model]\nname = 'mlp'\nhidden = [64, 32]\n"
                                      "[parallel]\nstrategy = 'ddp'\ntp = 1\n"
                                      "[optim]\nlr = 1e-3\noptimizer = 'sgd-momentum'\n"
                                      "[data]\npath = 'corpus.txt'\n[run]\nseed = 7\n"))
    assert (cfg.model.name, cfg.model.hidden, cfg.parallel.strategy) == ("mlp", [64, 32], "ddp")
    assert (cfg.optim.lr, cfg.optim.optimizer, cfg.data.path, cfg.run.seed) == \
        (1e-3, "sgd-momentum", "corpus.txt", 7)
    assert set(asdict(cfg)) == set(SECTIONS)


def test_flat_keys_still_read_with_a_note_each(tmp_path):
    notes = []
    cfg = load_config(write(tmp_path, "model = 'mlp'\nlr = 0.01\nschedule = 'gpipe'\n"
                                      "hidden = '128,64'\ndata = 'x.txt'\n"), notes=notes)
    assert cfg.optim.lr == 0.01 and cfg.parallel.pipeline_schedule == "gpipe"
    assert cfg.model.hidden == [128, 64] and cfg.data.path == "x.txt"
    assert any("'lr'" in n and "[optim]" in n for n in notes)
    assert any("'schedule'" in n and "'pipeline_schedule' under [parallel]" in n for n in notes)
    assert len(notes) == 5


def test_flags_override_the_file(tmp_path):
    cfg = load_config(write(tmp_path, "[optim]\nsteps = 9\n"), {"steps": 3, "model": "mlp"})
    assert cfg.optim.steps == 3 and cfg.model.name == "mlp"


@pytest.mark.parametrize("text,message", [
    ("[model]\nn_layers = 3\n", "unknown config key 'n_layers' in [model]; did you mean "
                                "'n_layer'?"),
    ("n_layers = 3\n", "unknown config key 'n_layers'; did you mean 'n_layer'?"),
    ("[optim]\nlr = -1e-3\n", "lr must be >= 0.0, got -0.001"),
    ("[model]\ndropout = 1.0\n", "dropout = 1.0: must be below 1.0"),
    ("[optim]\nsteps = 'ten'\n", "config key 'steps' wants a int, got 'ten'"),
    ("[model]\nhidden = [1.5]\n", "config key 'hidden' wants a list"),
    ("[parallel]\nstrategy = 'zero9'\n", "strategy = 'zero9' is not one of ddp, zero1"),
    ("[optim]\noptimizer = 'lion'\n", "optimizer = 'lion' is not one of adamw, adam, sgd"),
    ("[run]\nkeep_last = 0\n", "keep_last must be >= 1, got 0"),
])
def test_bad_values_name_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(write(tmp_path, text))


def test_a_saved_flat_config_from_before_the_sections_loads():
    old = {"model": "gpt", "n_layer": 3, "schedule": "1f1b", "hidden": "128,128",
           "strategy": "zero3", "lr": 0.003, "data": "", "dry_run": False}
    cfg = config_from_dict(flat_values(old, "checkpoint", []))
    assert cfg.model.n_layer == 3 and cfg.model.hidden == [128, 128]
    again = config_from_dict(flat_values(asdict(cfg), "checkpoint", []))
    assert again == cfg


def test_help_groups_flags_by_section_with_meaning_and_default():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, "train")
    text = parser.format_help()
    for cls in SECTIONS.values():
        assert cls.__doc__.strip() + ":" in text
    for key in KEYS.values():
        action = next(a for a in parser._actions if a.dest == key.flat)
        assert key.meta["help"] and "(default: " in action.help, key.flat
    estimate = argparse.ArgumentParser()
    add_config_flags(estimate, "estimate")
    flags = {a.option_strings[0] for a in estimate._actions if a.option_strings}
    assert {"--strategy", "--tp", "--n-layer", "--precision", "--reduce-dtype"} <= flags
    assert not {"--lr", "--seed", "--metrics", "--steps"} & flags


def test_given_keys_the_run_has_no_use_for_are_noted():
    """Each was carried silently: sequence parallelism with tp 1, a cp mode with cp 1, a
    checkpoint interval with no folder to save in."""
    notes = []
    load_config(None, {"sequence_parallel": True, "cp_mode": "all-to-all",
                       "checkpoint_interval": 5}, notes)
    assert notes == [
        "sequence_parallel = true does nothing with tp = 1: it splits the norms' rows over "
        "the tensor-parallel ranks",
        "cp_mode = 'all-to-all' does nothing with cp = 1: it is how context-parallel ranks "
        "share attention",
        "checkpoint_interval = 5 saves nothing without checkpoint_dir; add --checkpoint-dir "
        "DIR to keep checkpoints"]
    notes = []
    load_config(None, {"sequence_parallel": True, "tp": 2, "checkpoint_interval": 5,
                       "checkpoint_dir": "ck"}, notes)
    assert notes == []


def test_nan_is_refused_as_given_and_read_as_written_from_a_saved_config():
    """A checkpoint of a run that took ``grad_clip = nan`` before it was refused still
    resumes and samples: only given values are checked."""
    import math
    with pytest.raises(ConfigError, match=r"^grad_clip = nan: must be a finite number$"):
        load_config(None, {"grad_clip": float("nan")})
    assert math.isnan(config_from_dict({"grad_clip": float("nan")}, "saved").optim.grad_clip)


def test_adam_s_betas_under_sgd_and_a_warmup_longer_than_the_run_are_noted():
    notes = []
    load_config(None, {"optimizer": "sgd-momentum", "beta1": 0.5, "beta2": 0.3,
                       "warmup_steps": 100, "steps": 5}, notes)
    assert notes == ["beta1 and beta2 are Adam's: optimizer = 'sgd-momentum' does not read "
                     "them",
                     "warmup_steps = 100 is above steps = 5: the warm-up is cut to the "
                     "run's 5 steps"]
    notes = []
    load_config(None, {"optimizer": "adamw", "beta1": 0.5, "warmup_steps": 5, "steps": 5},
                notes)
    assert notes == []
