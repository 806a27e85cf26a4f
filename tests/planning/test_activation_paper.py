"""The activation plan against Korthikanti et al. 2022's Figure 1 (benchmarks/paper_activations.py).

    python -m pytest -q tests/planning/test_activation_paper.py

Four GPT models (22B, 175B, 530B, 1T) on their Table 3 layouts, tensor parallel alone
(no recomputation) and with sequence parallelism and selective recomputation: the
paper's own formula gives its figure's bars; mpishard's plan of the first pipeline
stage's activations must be within 5% of them, and every present-work run must fit
an A100's 80 GB with its model state.

All eight are within 5% (+0.4% to +2.4%) since a stage lets go of each output it
sends and the sequence-parallel embeddings drop their cut rows, as Megatron-LM does.
A case that falls outside goes on KNOWN_OVER with its bound and the reason; its gap
must then stay under that bound, and closing it fails the test until it comes off.
"""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "paper_activations", ROOT / "benchmarks" / "paper_activations.py")
paper = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = paper          # its dataclass looks its module up
_spec.loader.exec_module(paper)

MODELS = {m.name: m for m in paper.FIGURE_1}
#: (model, mode) -> the most the plan may be over the paper today, and why; none now.
#: (530B and 1T were 7-18% over while a chunk kept its output after sending it and the
#: sequence-parallel embeddings' dropout kept a mask of every row.)
KNOWN_OVER: dict = {}


@pytest.fixture(scope="module")
def rows():
    return {(r["model"], r["mode"]): r for r in
            (paper.plan(m, mode) for m in paper.FIGURE_1 for mode in paper.MODES)}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", paper.MODES)
def test_the_formula_gives_the_figure(name, mode):
    m = MODELS[name]
    want = m.baseline_gib if mode == "baseline" else m.present_gib
    assert paper.paper_formula(m, mode) / paper.GIB == pytest.approx(want, rel=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", paper.MODES)
def test_planned_activations_within_5_percent_of_figure_1(rows, name, mode):
    row = rows[name, mode]
    assert row["planned_gib"] >= row["paper_gib"] * 0.95, row
    bound = KNOWN_OVER.get((name, mode))
    if bound is None:
        assert row["error"] <= 0.05, row
    else:       # the known gap must not grow; once closed, take it off the list
        assert 0.05 < row["error"] <= bound, row


@pytest.mark.timeout(300)
def test_every_present_work_run_fits_an_a100(rows):
    for name in MODELS:
        row = rows[name, "present"]
        assert row["fits_a100"], row
        assert row["busiest_total_gib"] < paper.A100_BYTES / paper.GIB, row


@pytest.mark.timeout(300)
def test_selective_with_sequence_parallelism_keeps_34_sbh_over_t_a_layer():
    """One layer's share (a 2-layer model minus a 1-layer one, no pipeline): Table 2's
    ``34 s b h / t`` to 1%, the embeddings and the head taken away."""
    m = MODELS["22B"]
    by_layers = {}
    for layers in (1, 2):
        model = paper.GPT(paper.GPTConfig(vocab_size=paper.VOCAB, block_size=paper.SEQ,
                                          n_layer=layers, n_head=m.a, n_embd=m.h,
                                          dropout=paper.DROPOUT), materialize_now=False)
        est = paper.estimate_layout(model, paper.layout_of(m, "present"))
        by_layers[layers] = est.stages[0].activation_bytes
    per_layer = by_layers[2] - by_layers[1]
    assert per_layer == pytest.approx(34 * paper.SEQ * m.b * m.h / m.t, rel=0.01)
