"""Training data: byte-level text corpora and a distributed, resumable sampler.

The default corpus is present on every machine: the Python standard library's
own source files (a deterministic, sorted selection), so ``make demo`` needs no
download. Any file or folder of text works with ``--data PATH``.

    >>> corpus = load_corpus(None, max_bytes=2_000_000)       # stdlib sources
    >>> sampler = BatchSampler(corpus.train, block_size=64, batch_size=8,
    ...                        dp_rank=mesh.dp_rank, dp_size=mesh.dp.size, seed=0)
    >>> x, y = sampler.next_batch()                           # (8, 64) uint8 -> int64
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Corpus", "load_corpus", "default_corpus_files", "BatchSampler", "ArraySampler",
           "DataError", "load_digits", "VOCAB_SIZE", "DEFAULT_CORPUS_BYTES"]

VOCAB_SIZE = 256  # bytes
#: how much of the built-in corpus (the standard library's sources) is read by default
DEFAULT_CORPUS_BYTES = 4_000_000
#: files that hold token ids or pickles (nanoGPT's prepared data), not text
_NOT_TEXT = ("train.bin", "val.bin", "meta.pkl")


class DataError(ValueError):
    """A data path or corpus that cannot be trained on."""


@dataclass
class Corpus:
    """A byte corpus split into train and validation parts.

    ``available`` is how many bytes the source holds; fewer were read when
    ``max_bytes`` cut it (``truncated``).
    """

    train: np.ndarray
    val: np.ndarray
    source: str
    n_files: int
    available: int = 0

    @property
    def truncated(self) -> bool:
        return self.available > self.train.size + self.val.size

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE


#: folders of the standard library left out of the default corpus (and not walked:
#: a site-packages can hold ten times the library's own files)
_NOT_CORPUS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                         "__pycache__", "lib2to3"})


def default_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files (tests and site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _NOT_CORPUS]
        files.extend(Path(folder, name) for name in names if name.endswith(".py"))
    return sorted(files)


def token_files_in(path: Path) -> list:
    """The names of nanoGPT's token files (``train.bin``, ``val.bin``, ``meta.pkl``) that
    ``path`` is or holds: text loaders refuse them."""
    return sorted(p.name for p in ([path] if path.is_file() else path.iterdir())
                  if p.name in _NOT_TEXT)


def text_files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [p for p in sorted(path.rglob("*")) if p.is_file() and not p.name.startswith(".")]


def load_corpus(path: str | Path | None = None, max_bytes: int | None = None,
                val_fraction: float = 0.1, min_bytes: int = 2) -> Corpus:
    """Read text bytes from a file or folder (default: the stdlib sources).

    Args:
        path: a file or a folder (read recursively, sorted); ``None`` for the default.
        max_bytes: stop reading after this many bytes (deterministic selection);
            ``None`` or 0: all of ``path``, or :data:`DEFAULT_CORPUS_BYTES` of the
            built-in corpus.
        val_fraction: the last part of the bytes kept for validation.
        min_bytes: each split must hold at least this many bytes (pass
            ``block_size + 1``); otherwise :class:`DataError`.

    Raises:
        DataError: missing path, a folder of token files (nanoGPT's prepared
            ``train.bin``/``val.bin``/``meta.pkl``), empty corpus, or too short
            for one block.
    """
    if path is None:
        files, source = default_corpus_files(), "python stdlib sources"
        max_bytes = max_bytes or DEFAULT_CORPUS_BYTES
    else:
        path = Path(path)
        if not path.exists():
            raise DataError(f"data path {str(path)!r} does not exist; pass a text file or a "
                            f"folder of text files, or leave --data out for the default corpus")
        found = token_files_in(path)
        if found:
            raise DataError(f"data path {str(path)!r} is, or holds, {', '.join(found)}: token "
                            f"files as nanoGPT's prepare.py writes them, not text, and no "
                            f"folder of token ids (that needs train.bin and val.bin). Point "
                            f"--data at the folder holding both, or at the text itself")
        files, source = text_files_under(path), str(path)
    available = sum(f.stat().st_size for f in files)
    max_bytes = max_bytes or available
    chunks, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        data = f.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
    raw = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if raw.size == 0:
        raise DataError(f"the corpus at {source!r} is empty (no bytes in "
                        f"{len(files)} files); point --data at text")
    n_val = int(raw.size * val_fraction)
    train, val = raw[: raw.size - n_val], raw[raw.size - n_val:]
    if train.size < min_bytes or val.size < min_bytes:
        raise DataError(
            f"the corpus at {source!r} has {raw.size} bytes: {train.size} for training and "
            f"{val.size} for validation, but one block needs {min_bytes}; use more text or "
            f"a smaller --block-size")
    return Corpus(train, val, source, len(chunks), available)


class BatchSampler:
    """Disjoint batches per dp rank, the same batch on tp/pp peers, resumable.

    Each epoch is a seeded permutation of the non-overlapping windows of
    ``block_size + 1`` bytes. A global batch takes the next ``dp_size *
    batch_size`` windows; dp rank ``r`` gets the ``r``-th slice. Ranks that
    share a dp rank (tensor/pipeline peers) therefore get the same batch. The
    position is two integers (:meth:`state_dict`), so training resumes mid-epoch.
    """

    def __init__(self, data: np.ndarray, block_size: int, batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0):
        if batch_size < 1 or block_size < 1:
            raise ValueError(f"batch_size and block_size must be >= 1, got {batch_size}, "
                             f"{block_size}")
        self.data, self.block_size, self.batch_size = data, block_size, batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.n_windows = (data.size - 1) // block_size
        if self.n_windows < dp_size * batch_size:
            unit = "bytes" if data.dtype == np.uint8 else "tokens"   # text, or token ids
            raise DataError(
                f"{data.size} {unit} hold {self.n_windows} windows of {block_size + 1}, fewer "
                f"than one global batch ({dp_size} dp ranks x {batch_size}); use more data, "
                f"a smaller batch or a smaller block size")
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """The next ``(x, y)`` for this rank, each ``(batch_size, block_size)`` int64."""
        per_step = self.dp_size * self.batch_size
        if self.index + per_step > self.n_windows:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        lo = self.index + self.dp_rank * self.batch_size
        starts = self._order[lo: lo + self.batch_size] * self.block_size
        self.index += per_step
        offsets = starts[:, None] + np.arange(self.block_size + 1)
        window = self.data[offsets].astype(np.int64)
        return window[:, :-1], window[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)


class ArraySampler:
    """Like :class:`BatchSampler` for ``(x, y)`` arrays: disjoint per dp rank, resumable."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0):
        if len(x) < dp_size * batch_size:
            raise DataError(f"{len(x)} samples are fewer than one global batch "
                            f"({dp_size} dp ranks x {batch_size})")
        self.x, self.y, self.batch_size = x, y, batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.epoch, self.index = 0, 0
        self._order = np.random.default_rng([seed, 0]).permutation(len(x))

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        per_step = self.dp_size * self.batch_size
        if self.index + per_step > len(self.x):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.x))
        lo = self.index + self.dp_rank * self.batch_size
        rows = self._order[lo: lo + self.batch_size]
        self.index += per_step
        return self.x[rows], self.y[rows]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.x))


def load_digits(seed: int = 0, val_fraction: float = 0.2):
    """scikit-learn's 8x8 digits (shipped inside the package): train/val arrays.

    Returns ``(x_train, y_train, x_val, y_val)`` with pixels scaled to [0, 1].
    Needs ``pip install 'mpishard[digits]'``.
    """
    try:
        from sklearn.datasets import load_digits as sk_digits  # noqa: PLC0415
    except ImportError as err:
        raise DataError("the digits dataset needs scikit-learn: "
                        "pip install 'mpishard[digits]'") from err
    bunch = sk_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_val = int(len(y) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return x[train], y[train], x[val], y[val]
