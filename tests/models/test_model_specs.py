"""Model families as specs: the registry, per-family keys and defaults, presets.

Every family in ``mpishard.models.MODELS`` builds from its own defaults, its
presets name only keys it reads, ``--model NAME`` alone takes that family's
defaults, and no code outside models/ and hf/ names a model's attributes.
"""
import ast
import re
from pathlib import Path

import pytest

from mpishard.config.presets import PRESETS
from mpishard.config.sections import KEYS, config_from_dict, load_config
from mpishard.models import MODELS, spec_of

PKG = Path(__file__).resolve().parents[2] / "mpishard"
TEXT = [name for name, spec in MODELS.items() if spec.build_config is not None]


@pytest.mark.parametrize("name", TEXT)
def test_a_family_builds_from_its_own_defaults(name):
    spec = MODELS[name]
    cfg = load_config(None, {"model": name, "vocab_size": 64})
    config = spec.config_of(cfg.model)
    assert type(config) is spec.config_class and spec_of(config) is spec
    model = spec.model_class(config, seed=0)
    assert spec_of(model) is spec
    for key in spec.keys:                      # resolved to this family's default
        assert getattr(cfg.model, key.name) == key.default, key.name


def test_keys_a_family_does_not_read_stay_unset():
    gpt = load_config(None, {"model": "gpt"}).model
    llama = load_config(None, {"model": "llama"}).model
    assert gpt.bias is True and llama.bias is False
    assert gpt.n_kv_head is None and llama.n_kv_head == 0 and llama.hidden is None
    again = config_from_dict({"model": "gpt", "n_kv_head": None})   # as a saved config
    assert again.model == gpt


def test_a_familys_bounds_apply_under_it():
    from mpishard.config.sections import ConfigError

    with pytest.raises(ConfigError, match="rope_scaling = 'yarn' is not one of none, llama3"):
        load_config(None, {"model": "llama", "rope_scaling": "yarn"})
    assert KEYS["n_kv_head"].meta["families"].keys() >= {"llama"}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_name_only_keys_their_family_reads(preset):
    keys = dict(PRESETS[preset])
    spec = MODELS[keys.pop("name")]
    own = {k.name for k in spec.keys} | {"vocab_size", "block_size", "n_layer", "n_head",
                                         "n_embd"}
    assert set(keys) <= own, set(keys) - own
    spec.config_of(load_config(None, {"preset": preset}).model,
                   vocab_size=keys.get("vocab_size", 256))


def test_no_model_attribute_names_outside_models_and_hf():
    """The planner, the recipe, the config and the CLI read the spec: no code outside
    models/ and hf/ reaches for ``.c_attn`` or ``.q_proj``, or spells such a name in a
    string it looks up (docstrings and messages aside)."""
    names = re.compile(r"(c_attn|q_proj|k_proj|v_proj|o_proj|c_fc|gate_proj|up_proj)")
    hits = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith(("models/", "hf/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and names.fullmatch(node.attr) or (
                    isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and " " not in node.value and names.search(node.value)):
                hits.append(f"{rel}:{node.lineno}")
    assert not hits, hits
