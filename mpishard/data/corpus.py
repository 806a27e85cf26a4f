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
    """``path`` itself, or the files under the folder ``path``, sorted, without hidden
    ones: a name starting with ``.``, or anything inside such a folder (``.git/``,
    ``.venv/``)."""
    if path.is_file():
        return [path]
    return [p for p in sorted(path.rglob("*")) if p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(path).parts)]


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


class _Stream:
    """Item indices as one stream, resumable: epoch after epoch, each a seeded
    permutation of the ``n`` items, nothing dropped where an epoch ends (a batch that
    crosses it takes the epoch's last items and the next epoch's first). A micro-batch
    takes the next ``dp_size * batch_size`` items, dp rank ``r`` the ``r``-th slice, so
    the items a step trains on are the same for every split of the same global batch
    over dp ranks and micro-batches (the layouts a run is compared across, or resumed
    on). The position is two integers (:meth:`state_dict`), so training resumes
    mid-epoch."""

    def __init__(self, n: int, batch_size: int, dp_rank: int, dp_size: int, seed: int):
        self.n, self.batch_size = n, batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.epoch, self.index = 0, 0
        self._orders: dict = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:     # at most this epoch's and the next one's
            self._orders = {e: o for e, o in self._orders.items() if e >= self.epoch}
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._orders[epoch]

    def next_rows(self) -> np.ndarray:
        """This rank's ``batch_size`` items of the next micro-batch; the stream moves on
        by the whole micro-batch."""
        at = self.epoch * self.n + self.index
        mine = np.arange(at, at + self.batch_size) + self.dp_rank * self.batch_size
        epochs, places = np.divmod(mine, self.n)
        rows = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            rows[epochs == epoch] = self._order(int(epoch))[places[epochs == epoch]]
        self.epoch, self.index = divmod(at + self.dp_size * self.batch_size, self.n)
        return rows

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


class BatchSampler(_Stream):
    """Disjoint batches per dp rank, the same batch on tp/pp peers, resumable.

    The items are the non-overlapping windows of ``block_size + 1`` bytes (or
    tokens), drawn as :class:`_Stream` says: dp rank ``r`` gets the ``r``-th slice of
    each micro-batch's windows; ranks that share a dp rank (tensor/pipeline peers)
    get the same batch.
    """

    def __init__(self, data: np.ndarray, block_size: int, batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0):
        if batch_size < 1 or block_size < 1:
            raise ValueError(f"batch_size and block_size must be >= 1, got {batch_size}, "
                             f"{block_size}")
        n_windows = (data.size - 1) // block_size
        if n_windows < dp_size * batch_size:
            unit = "bytes" if data.dtype == np.uint8 else "tokens"   # text, or token ids
            raise DataError(
                f"{data.size} {unit} hold {n_windows} windows of {block_size + 1}, fewer "
                f"than one global batch ({dp_size} dp ranks x {batch_size}); use more data, "
                f"a smaller batch or a smaller block size")
        super().__init__(n_windows, batch_size, dp_rank, dp_size, seed)
        self.data, self.block_size, self.n_windows = data, block_size, n_windows

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """The next ``(x, y)`` for this rank, each ``(batch_size, block_size)`` int64."""
        starts = self.next_rows() * self.block_size
        offsets = starts[:, None] + np.arange(self.block_size + 1)
        window = self.data[offsets].astype(np.int64)
        return window[:, :-1], window[:, 1:]


class ArraySampler(_Stream):
    """Like :class:`BatchSampler` for ``(x, y)`` arrays: disjoint per dp rank, resumable."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0):
        if len(x) < dp_size * batch_size:
            raise DataError(f"{len(x)} samples are fewer than one global batch "
                            f"({dp_size} dp ranks x {batch_size})")
        super().__init__(len(x), batch_size, dp_rank, dp_size, seed)
        self.x, self.y = x, y

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        rows = self.next_rows()
        return self.x[rows], self.y[rows]


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
