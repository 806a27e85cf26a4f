"""Planned activation memory against Korthikanti et al. 2022's Figure 1, both ways.

    python benchmarks/paper_activations.py          # a table on stderr, one JSON line

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198), Figure 1: activation memory per GPU of four GPT models
(22B, 175B, 530B, 1T) trained with tensor parallelism alone ("baseline", no
recomputation) and with sequence parallelism and selective recomputation
("present work"), on the first pipeline stage, against the 80 GB of an A100. The
layouts are its Table 3's (``h``, ``a``, ``L``, ``t``, ``p``, micro-batch ``b``,
``s = 2048``, no data parallelism, the global batch in micro-batches of ``b``;
175B and 530B on the interleaved schedule with three model chunks per rank, as
its section 6 says); the models are Megatron-LM's GPT (vocabulary 51200, MLP
``4h``, biases, dropout 0.1, 16-bit activations).

The figure's bars are the paper's formulas (its Table 2, per layer, in bytes):
``s b h (10 + 24 / t + 5 a s / (h t))`` with tensor parallelism alone, ``34 s b
h / t`` with sequence parallelism and selective recomputation, times ``L`` on the
first stage (1F1B keeps ``p`` micro-batches of ``L / p`` layers each, section 4.2.3),
times ``1 + (p - 1) / (p V)`` under the interleaved schedule of ``V`` chunks; the
embeddings and the output layer are left out (section 4.3: small next to that).
:data:`FIGURE_1` holds the bars' values (as calculon's validation reads them from
the figure, ``benchmarks/published_runs.json``'s ``memory`` of each Table 5 run)
and :func:`paper_formula` computes them, to the digit. Beside each, mpishard's plan
(:func:`~mpishard.planning.layout.estimate_layout`, precision float16) of the
first stage's activations and the busiest stage's total (model state included;
mixed precision's float32 masters and Adam's two states on every parameter, as
Megatron-LM keeps them without its distributed optimizer). As in Megatron-LM, a
stage keeps none of the outputs it sends on (``deallocate_output_tensor``, the
paper's Appendix B) and under sequence parallelism the embeddings' dropout drops
this rank's rows after the cut; every plan is then within 5% of the figure
(tests/planning/test_activation_paper.py).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from mpishard.models import GPT, GPTConfig  # noqa: E402
from mpishard.parallel.compose import build_stage  # noqa: E402
from mpishard.planning.layout import Layout, estimate_layout, mesh_shape  # noqa: E402

GIB = 2**30
#: an A100's 80 GB (Korthikanti et al. 2022, section 6: "8 NVIDIA 80GB A100 GPUs")
A100_BYTES = 80e9
SEQ, VOCAB, DROPOUT = 2048, 51200, 0.1
MODES = ("baseline", "present")


@dataclass(frozen=True)
class PaperModel:
    """One model of Figure 1: Table 3's layout and the figure's two bars (GiB)."""

    name: str
    h: int               # hidden size
    a: int               # attention heads
    L: int               # layers
    t: int               # tensor-parallel size
    p: int               # pipeline stages
    b: int               # micro-batch size
    global_batch: int
    V: int               # model chunks per pipeline rank (interleaved schedule)
    baseline_gib: float  # tensor parallel, no recomputation
    present_gib: float   # sequence parallel + selective recomputation

    @property
    def micro_batches(self) -> int:
        return self.global_batch // self.b


FIGURE_1 = (
    PaperModel("22B", 6144, 64, 48, 8, 1, 4, 4, 1, 59.25, 9.5625),
    PaperModel("175B", 12288, 96, 96, 8, 8, 1, 64, 3, 66.84375, 12.3515625),
    PaperModel("530B", 20480, 128, 105, 8, 35, 1, 280, 3, 114.0234375, 23.076171875),
    PaperModel("1T", 25600, 160, 128, 8, 64, 1, 512, 1, 131.25, 26.5625),
)


def paper_formula(m: PaperModel, mode: str) -> float:
    """The paper's activation bytes per GPU on the first stage (see the module's note)."""
    s, b, h, a, t = SEQ, m.b, m.h, m.a, m.t
    per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) if mode == "baseline" \
        else 34 * s * b * h / t
    interleaved = 1 + (m.p - 1) / (m.p * m.V) if m.V > 1 else 1.0
    return per_layer * m.L * interleaved


def layout_of(m: PaperModel, mode: str) -> Layout:
    """Table 3's layout of ``m``: ``"baseline"`` tensor parallel alone, ``"present"``
    with sequence parallelism and selective recomputation."""
    present = mode == "present"
    return Layout(dp=1, tp=m.t, pp=m.p, strategy="ddp", precision="float16", batch_size=m.b,
                  seq_len=SEQ, micro_batches=m.micro_batches,
                  schedule="interleaved" if m.V > 1 else "1f1b", virtual_stages=m.V,
                  sequence_parallel=present, selective=present)


def model_of(m: PaperModel) -> GPT:
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=m.L, n_head=m.a,
                         n_embd=m.h, dropout=DROPOUT, bias=True), materialize_now=False)


def plan(m: PaperModel, mode: str) -> dict:
    """mpishard's plan of ``m`` in ``mode`` beside the paper's figures (one stage of each
    kind: the first, the last, and one of those between with as many blocks, whose
    like hold no more)."""
    model, layout = model_of(m), layout_of(m, mode)

    def stage_of(s: int):
        return build_stage(model, mesh_shape(layout, s), None, layout.cp_mode,
                           layout.sequence_parallel, layout.virtual_stages)
    est = estimate_layout(model, layout, stage_of=stage_of, representative=True)
    first = est.stages[0]
    paper = m.baseline_gib if mode == "baseline" else m.present_gib
    planned = first.activation_bytes / GIB
    return {"model": m.name, "mode": mode, "paper_gib": paper,
            "formula_gib": round(paper_formula(m, mode) / GIB, 4),
            "planned_gib": round(planned, 4), "error": round(planned / paper - 1, 4),
            "busiest_total_gib": round(est.total_peak_bytes / GIB, 2),
            "fits_a100": est.total_peak_bytes <= A100_BYTES}


def main(argv=None) -> list:
    rows = [plan(m, mode) for m in FIGURE_1 for mode in MODES]
    print(f"{'model':<6}{'mode':<10}{'paper GiB':>10}{'formula':>9}{'planned':>9}{'error':>8}"
          f"{'busiest total':>15}  fits 80 GB", file=sys.stderr)
    for r in rows:
        print(f"{r['model']:<6}{r['mode']:<10}{r['paper_gib']:>10.2f}{r['formula_gib']:>9.2f}"
              f"{r['planned_gib']:>9.2f}{r['error']:>+8.1%}{r['busiest_total_gib']:>11.2f} GiB"
              f"  {'yes' if r['fits_a100'] else 'NO'}", file=sys.stderr)
    worst = max(abs(r["error"]) for r in rows)
    within = sum(abs(r["error"]) <= 0.05 for r in rows)
    print(f"worst |error| {worst:.1%}, {within} of {len(rows)} within 5% (baseline: tensor "
          f"parallel, no recomputation; present: sequence parallel + selective "
          f"recomputation; a stage's sent outputs let go of, as Megatron-LM)", file=sys.stderr)
    print(json.dumps({"benchmark": "paper_activations", "rows": rows, "worst_abs_error": worst,
                      "within_5_percent": within}))
    return rows


if __name__ == "__main__":
    main()
