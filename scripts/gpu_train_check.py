"""GPU check of the math: ops and a GPT training step on CuPy equal NumPy.

    python scripts/gpu_train_check.py          # called by scripts/gpu_check.sh

Runs every op of the autodiff core on float64 CuPy arrays and compares values
and gradients with NumPy (relative 1e-10), then trains a small GPT for 5 AdamW
steps on both backends from the same (seed, name) initialisation and compares
losses (relative 1e-9). Exits non-zero on any mismatch.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import cupy  # noqa: E402

from mpishard.autodiff import Tensor  # noqa: E402
from mpishard.backend import Backend  # noqa: E402
from mpishard.models import GPT, GPTConfig  # noqa: E402
from mpishard.optim import AdamW  # noqa: E402
from test_autodiff_gradcheck import CASES  # noqa: E402


def run_case(fn, inputs, xp):
    tensors = [Tensor(xp.asarray(a), requires_grad=True) for a in inputs]
    out = fn(*tensors)
    outs = out if isinstance(out, (list, tuple)) else [out]
    total = None
    for k, o in enumerate(outs):
        r = xp.asarray(np.random.default_rng(k).standard_normal(o.shape))
        term = (o * Tensor(r)).sum()
        total = term if total is None else total + term
    total.backward()
    to_np = (lambda a: a.get()) if xp is cupy else (lambda a: a)
    return [to_np(o.data) for o in outs], [None if t.grad is None else to_np(t.grad)
                                           for t in tensors]


def main() -> int:
    failures = 0
    for name, cases in CASES.items():
        if name == "dropout":  # CuPy's generator draws other numbers by design
            continue
        for i, make in enumerate(cases):
            fn, inputs = make(np.random.default_rng(i))
            try:
                (o1, g1), (o2, g2) = run_case(fn, inputs, np), run_case(fn, inputs, cupy)
            except Exception as err:  # noqa: BLE001 (report every op, then fail)
                print(f"FAIL {name}[{i}]: {type(err).__name__}: {err}")
                failures += 1
                continue
            for a, b in zip(o1 + g1, o2 + g2):
                if a is None and b is None:
                    continue
                if not np.allclose(a, b, rtol=1e-10, atol=1e-12):
                    print(f"FAIL {name}[{i}]: CuPy differs from NumPy")
                    failures += 1
                    break
    cfg = GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=4, n_embd=64)
    losses = {}
    for backend in ("numpy", "cupy"):
        be = Backend.resolve(backend)
        model = GPT(cfg, seed=0, dtype="float64", backend=be)
        opt = AdamW(model.parameters(), lr=1e-3)
        r = np.random.default_rng(0)
        losses[backend] = []
        for _ in range(5):
            x = be.asarray(r.integers(0, 65, (4, 32)))
            _, loss = model(x, x)
            model.zero_grad()
            loss.backward()
            opt.step()
            losses[backend].append(loss.item())
    if not np.allclose(losses["numpy"], losses["cupy"], rtol=1e-9):
        print(f"FAIL GPT steps: numpy {losses['numpy']} vs cupy {losses['cupy']}")
        failures += 1
    print(f"gpu_train_check: {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
