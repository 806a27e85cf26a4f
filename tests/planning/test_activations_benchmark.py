"""benchmarks/activations.py: what it prints is what the plan says, mode by mode."""
import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "activations.py"


def test_the_benchmarks_bytes_are_the_plans(capsys):
    """Each mode's measured bytes within 1% of its plan, and a block's selective share
    Korthikanti et al.'s ``34 / (34 + 5 a s / h)`` (16-bit rows, dropout 0.1), to the
    third decimal: no one-time allocation of the process's first forward counted."""
    from mpishard.kernels import reference
    reference._numpy_causal_bias.cache_clear()     # as a process's first forward finds it
    spec = importlib.util.spec_from_file_location("activations_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--n-layer", "2", "--steps", "1", "--warmup", "0", "--batch-size",
                          "2", "--block-size", "256", "--dropout", "0.1",
                          "--precision", "bfloat16"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    for mode, measured in result["activation_bytes"].items():
        assert abs(result["planned_activation_bytes"][mode] / measured - 1) < 0.01, mode
    assert result["selective_kept_fraction_per_block"] == \
        result["paper_selective_fraction_per_block"]
