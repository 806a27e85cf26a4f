"""Tokenized training data: nanoGPT's ``train.bin``/``val.bin``, read through ``np.memmap``.

A token folder holds the token ids of the training and validation text as flat
little-endian unsigned integers, the layout nanoGPT's ``prepare.py`` writes:

    DIR/train.bin        token ids, uint16 (uint32 when an id exceeds 65535)
    DIR/val.bin          the same for the validation text
    DIR/meta.json        {"dtype": "uint16", "vocab_size": N, "tokenizer": "tokenizer.json"}
    DIR/tokenizer.json   the Hugging Face ``tokenizers`` file that made the ids (optional)

``mpishard prepare`` (:mod:`mpishard.data.prepare`) writes all four. A folder from
nanoGPT has no ``meta.json``: the dtype defaults to uint16, and the vocabulary
size comes from its ``meta.pkl`` (character-level data: ``vocab_size``, and
``itos`` to decode), read as data only (:mod:`mpishard.data.meta_pkl`: no
Python object in it is ever built), else from the caller (``--vocab-size``).

The files are opened read-only as ``np.memmap`` and never loaded whole, so
:class:`mpishard.data.corpus.BatchSampler` draws windows from them as from bytes, with
the same distributed order and exact resume:

    >>> corpus = load_tokens("data/owt", vocab_size=50257)
    >>> sampler = BatchSampler(corpus.train, block_size=256, batch_size=8, seed=0)
    >>> x, y = sampler.next_batch()                       # (8, 256) int64 token ids
"""
from __future__ import annotations

import json
import mmap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mpishard.data.corpus import DataError
from mpishard.data.meta_pkl import CharTokenizer, read_meta_pkl

__all__ = ["TokenCorpus", "TokenArray", "Tokenizer", "is_token_dir", "load_tokens",
           "retokenize_hint", "open_tokenizer", "dtype_for_vocab", "TOKEN_DTYPES"]

#: the dtypes a token file may have (nanoGPT writes uint16)
TOKEN_DTYPES = ("uint16", "uint32")
#: the id check reads this many evenly spaced runs of RUN_TOKENS tokens (about 1 M tokens)
SAMPLE_RUNS = 64
RUN_TOKENS = 16384


class TokenArray(np.memmap):
    """A read-only ``np.memmap`` of token ids that keeps the resident set small.

    Pages of a memmap that were read stay mapped into the process, and the
    kernel may map a large folio (2 MiB) around every window read, so a
    sampler's random windows would let RSS grow towards the file size (page
    cache, which the kernel reclaims under pressure, but RSS and schedulers
    count it). So each read that copies (fancy indexing: one batch of
    :class:`~mpishard.data.corpus.BatchSampler`) drops the mapped pages afterwards:
    RSS holds one batch's pages, whatever the file size. The data stay in the
    page cache; the next read maps them again. Slices stay views, as for any
    memmap.
    """

    def __getitem__(self, index):
        out = super().__getitem__(index)
        if isinstance(out, TokenArray) and out._mmap is None:   # a copy, not a view
            out = out.view(np.ndarray)
            self.release_pages()
        return out

    def release_pages(self) -> None:
        """Drop this file's pages from the process's resident set (the data stay valid)."""
        handle = getattr(self, "_mmap", None)
        if handle is not None and hasattr(handle, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            try:
                handle.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):   # a closed map, or a platform without it
                pass


@dataclass
class TokenCorpus:
    """Token ids split into train and validation parts, both read-only ``np.memmap``.

    ``train`` and ``val`` are :class:`TokenArray` (an ``np.memmap`` that
    drops its pages after each batch read). ``tokenizer`` is the path of the
    ``tokenizer.json`` beside the data (to decode samples), or ``None``;
    ``notes`` are lines worth printing before training (a default that was
    assumed, a file that was not read).
    """

    train: np.memmap
    val: np.memmap
    source: str
    vocab_size: int
    dtype: str
    tokenizer: str | None = None
    notes: list = field(default_factory=list)

    def release_pages(self) -> None:
        """Drop the pages read so far of both files from the resident set."""
        for array in (self.train, self.val):
            if isinstance(array, TokenArray):
                array.release_pages()


def dtype_for_vocab(vocab_size: int) -> str:
    """``"uint16"`` when every id of a ``vocab_size`` vocabulary fits (< 65536), else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def is_token_dir(path) -> bool:
    """Whether ``path`` is a folder of token ids (it holds ``train.bin``).

    A folder with ``train.bin`` but no ``val.bin`` is one too, so that
    :func:`load_tokens` can say what is missing.
    """
    path = Path(path)
    return path.is_dir() and (path / "train.bin").is_file()


def _read_meta(folder: Path) -> tuple:
    """``(meta dict, its path)``: meta.json's, else meta.pkl's (data only), else (None, None)."""
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        pkl = folder / "meta.pkl"
        return (read_meta_pkl(pkl), pkl) if pkl.is_file() else (None, None)
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{meta_path} is not JSON ({err}); rewrite it as "
                        f'{{"dtype": "uint16", "vocab_size": N}} or remove it and pass '
                        f"--data-dtype and --vocab-size") from None
    if not isinstance(meta, dict):
        raise DataError(f"{meta_path} holds {type(meta).__name__}, not a JSON object "
                        f'such as {{"dtype": "uint16", "vocab_size": N}}')
    return meta, meta_path


def _check_dtype(dtype, where: str) -> str:
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"token dtype {dtype!r} ({where}) is not one of "
                        f"{', '.join(TOKEN_DTYPES)}; nanoGPT writes uint16")
    return dtype


def _check_vocab(vocab_size, where: str) -> int:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise DataError(f"vocab_size {vocab_size!r} ({where}) must be a positive integer")
    return vocab_size


def _open(path: Path, dtype: str, min_tokens: int) -> np.memmap:
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise DataError(f"{path} has {size} bytes, not a multiple of {itemsize} ({dtype} "
                        f"tokens): the file is truncated or holds another dtype; check "
                        f"--data-dtype (or meta.json) against how it was written")
    n = size // itemsize
    if n < max(min_tokens, 1):
        raise DataError(f"{path} holds {n} tokens, but one block needs {min_tokens}; use "
                        f"more text or a smaller --block-size")
    return TokenArray(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", shape=(n,))


def _sample_max(array: TokenArray, block: int) -> int:
    """The largest id among the first and last ``block`` tokens and SAMPLE_RUNS evenly
    spaced runs of RUN_TOKENS tokens (all of a smaller file): a bounded read of a few
    MB, never the whole file; the pages are dropped after each run."""
    n = array.size
    if n <= SAMPLE_RUNS * RUN_TOKENS + 2 * block:
        runs = [(0, n)]
    else:
        starts = np.linspace(0, n - RUN_TOKENS, SAMPLE_RUNS).astype(np.int64)
        runs = [(0, block), (n - block, n)] + [(int(s), int(s) + RUN_TOKENS) for s in starts]
    largest = 0
    for lo, hi in runs:
        largest = max(largest, int(array[lo:hi].max()))
        array.release_pages()
    return largest


def load_tokens(path, dtype: str | None = None, vocab_size: int | None = None,
                min_tokens: int = 2, model_folder: str | None = None) -> TokenCorpus:
    """Open a folder's ``train.bin`` and ``val.bin`` read-only as ``np.memmap``.

    The folder's metadata is its ``meta.json``, else nanoGPT's ``meta.pkl``
    (read as data only, see :mod:`mpishard.data.meta_pkl`). The dtype comes
    from the metadata, else from ``dtype``, else it is uint16 (nanoGPT's
    default). The vocabulary size comes from the metadata, else from
    ``vocab_size``; a ``vocab_size`` larger than the metadata's (an embedding
    padded to a round size) is used, with a note.

    The ids are checked against the vocabulary on a bounded sample only: the
    first and last ``min_tokens`` tokens and 64 evenly spaced runs of 16384
    tokens (about 1 M tokens, a few MB) of each file, all of a file smaller
    than that. An out-of-range id elsewhere is not found here.

    Args:
        path: the folder.
        dtype: ``"uint16"`` or ``"uint32"`` (``--data-dtype``), when the
            metadata has none; one that contradicts it is an error.
        vocab_size: the vocabulary size (``--vocab-size``), when the metadata
            has none; must be at least the metadata's.
        min_tokens: each split must hold at least this many tokens (pass
            ``block_size + 1``).
        model_folder: the ``--init-from`` path. When it is a Hugging Face folder
            (it holds config.json), ``vocab_size`` came from there, and a
            vocabulary that does not fit says to tokenize the text with that
            folder's ``tokenizer.json`` (``mpishard prepare --tokenizer``).

    Raises:
        DataError: not a folder, ``train.bin`` or ``val.bin`` missing, a
            meta.json that is not JSON, a meta.pkl that holds more than data,
            metadata that contradicts ``dtype``/``vocab_size``, an unknown
            dtype, no vocabulary size, a file size that is not a multiple of
            the dtype's, a split shorter than ``min_tokens``, or a sampled id
            >= vocab size.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise DataError(f"token data {str(folder)!r} is not a folder; pass a folder holding "
                        f"train.bin and val.bin (write one with 'mpishard prepare')")
    for name in ("train.bin", "val.bin"):
        if not (folder / name).is_file():
            raise DataError(f"{folder} has no {name}; a token folder holds train.bin and "
                            f"val.bin (nanoGPT's prepare.py and 'mpishard prepare' write both)")
    (meta, meta_path), notes = _read_meta(folder), []
    given = _VocabSource(model_folder)
    dtype = _settle_dtype(meta, meta_path, dtype)
    vocab_size = _settle_vocab(folder, meta, meta_path, vocab_size, given, notes)
    train, val = (_open(folder / name, dtype, min_tokens) for name in ("train.bin", "val.bin"))
    for name, array in (("train.bin", train), ("val.bin", val)):
        largest = _sample_max(array, min_tokens)
        if largest >= vocab_size:
            fix = (given.retokenize if given.model_folder else
                   "pass the tokenizer's --vocab-size, or check --data-dtype")
            raise DataError(f"{folder / name} holds token id {largest}, but the vocabulary "
                            f"{given.of_what}has {vocab_size} ids (0..{vocab_size - 1}); "
                            f"{fix}")
    tokenizer = _tokenizer_file(folder, meta, meta_path, notes)
    return TokenCorpus(train, val, str(folder), vocab_size, dtype, tokenizer, notes)


def _settle_dtype(meta, meta_path, dtype) -> str:
    """The metadata's dtype (``dtype`` must agree), else ``dtype``, else uint16."""
    if meta is not None and "dtype" in meta:
        file_dtype = _check_dtype(meta["dtype"], f"in {meta_path}")
        if dtype is not None and dtype != file_dtype:
            raise DataError(f"--data-dtype {dtype} contradicts {meta_path}, which says "
                            f"{file_dtype}; leave --data-dtype out")
        return file_dtype
    return _check_dtype(dtype, "--data-dtype") if dtype is not None else "uint16"


class _VocabSource:
    """Where the caller's vocabulary size came from: ``--vocab-size``, or the config.json
    of the Hugging Face folder ``--init-from`` names (then the data must be the ids of
    that folder's tokenizer.json)."""

    def __init__(self, model_folder):
        hf = model_folder is not None and (Path(model_folder) / "config.json").is_file()
        self.model_folder = str(model_folder) if hf else None
        self.flag = f"the config.json of --init-from {model_folder}" if hf else "--vocab-size"
        self.of_what = f"of the model in {model_folder} " if hf else ""
        self.retokenize = retokenize_hint(model_folder) if hf else ""


def retokenize_hint(model_folder) -> str:
    """How to make the token ids the model of the Hugging Face folder ``model_folder``
    reads: its own tokenizer (its tokenizer.json, named only where the folder holds it)."""
    own = Path(model_folder) / "tokenizer.json"
    if own.is_file():
        return (f"tokenize the text with the model's own tokenizer: mpishard prepare "
                f"TEXT_PATH OUT_DIR --tokenizer {own}, then train on --data OUT_DIR")
    return (f"tokenize the text with the model's own tokenizer (its tokenizer.json, which "
            f"{model_folder} does not hold): mpishard prepare TEXT_PATH OUT_DIR --tokenizer "
            f"TOKENIZER_JSON, then train on --data OUT_DIR")


def _settle_vocab(folder: Path, meta, meta_path, vocab_size, given: _VocabSource,
                  notes: list) -> int:
    """The metadata's vocabulary size (``vocab_size`` may pad it), else ``vocab_size``."""
    meta_vocab = meta.get("vocab_size") if meta is not None else None
    if meta_vocab is not None:
        meta_vocab = _check_vocab(meta_vocab, f"in {meta_path}")
        if vocab_size is not None and _check_vocab(vocab_size, given.flag) < meta_vocab:
            if given.model_folder:
                raise DataError(f"the model in {given.model_folder} has a vocabulary of "
                                f"{vocab_size} ids, but {meta_path} says the ids of {folder} "
                                f"come from one of {meta_vocab}: another tokenizer made them; "
                                f"{given.retokenize}")
            raise DataError(f"--vocab-size {vocab_size} is smaller than the {meta_vocab} of "
                            f"{meta_path}; leave --vocab-size out")
        if vocab_size is not None and vocab_size > meta_vocab:
            also = (f"; right only if the model's own tokenizer made them (else "
                    f"{given.retokenize})" if given.model_folder else "")
            notes.append(f"vocab_size {vocab_size} ({given.flag}) pads the {meta_vocab} "
                         f"token ids of {meta_path}{also}")
        return vocab_size or meta_vocab
    if vocab_size is not None:
        return _check_vocab(vocab_size, given.flag)
    if meta_path is not None:
        raise DataError(f"{meta_path} has no vocab_size (it holds {sorted(map(str, meta))}); "
                        f"pass --vocab-size N, the size of the vocabulary that made the ids")
    raise DataError(f"{folder} has no meta.json or meta.pkl naming the vocabulary size: pass "
                    f"--vocab-size N (50257 for GPT-2's BPE, as nanoGPT's openwebtext and "
                    f"shakespeare prepare.py write it)")


def _tokenizer_file(folder: Path, meta, meta_path, notes: list) -> str | None:
    """The ``tokenizer.json`` the metadata names (a note when it is missing), else the
    folder's own ``tokenizer.json``, else None."""
    name = meta.get("tokenizer") if meta is not None else None
    if isinstance(name, str) and (folder / name).is_file():
        return str(folder / name)
    if isinstance(name, str):
        notes.append(f"{meta_path} names the tokenizer {name!r}, which is not in {folder}: "
                     f"token ids cannot be decoded to text")
        return None
    return str(folder / "tokenizer.json") if (folder / "tokenizer.json").is_file() else None


def open_tokenizer(path):
    """What turns a token folder's ids into text and back: the ``tokenizer.json`` its
    meta.json names or that lies in it (a :class:`Tokenizer`), else the characters of
    nanoGPT's ``meta.pkl`` (a :class:`~mpishard.data.meta_pkl.CharTokenizer`).

    Raises:
        DataError: the folder has neither, or what it has cannot be read.
    """
    folder = Path(path)
    meta, meta_path = _read_meta(folder)
    tokenizer = _tokenizer_file(folder, meta, meta_path, [])
    if tokenizer is not None:
        return Tokenizer.from_file(tokenizer)
    if meta_path is not None and meta_path.suffix == ".pkl":
        return CharTokenizer.from_meta(meta, meta_path)
    raise DataError(f"{folder} has no tokenizer.json (nor a nanoGPT meta.pkl of characters) "
                    f"to turn text into ids and back; copy the tokenizer.json that made the "
                    f"ids into {folder}")


def tokenizers_module():
    try:
        import tokenizers  # noqa: PLC0415
    except ImportError as err:
        raise DataError("token data and 'mpishard prepare' need Hugging Face tokenizers: "
                        "pip install tokenizers") from err
    return tokenizers


class Tokenizer:
    """A Hugging Face ``tokenizers`` tokenizer (a ``tokenizer.json``), ids as NumPy arrays.

    No special tokens are added when encoding and none are dropped when
    decoding, so ``decode(encode(text)) == text`` for a byte-level BPE.
    """

    def __init__(self, inner, path: str | None = None):
        self.inner, self.path = inner, path
        vocab = inner.get_vocab(with_added_tokens=True)
        #: one more than the largest id (ids may leave gaps)
        self.vocab_size = max(inner.get_vocab_size(with_added_tokens=True),
                              max(vocab.values(), default=-1) + 1)

    @classmethod
    def from_file(cls, path) -> "Tokenizer":
        """Load a ``tokenizer.json``.

        Raises:
            DataError: ``tokenizers`` is not installed, or the file is missing or
                not a tokenizer.
        """
        tokenizers = tokenizers_module()
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer file {str(path)!r} does not exist; pass the "
                            f"tokenizer.json that came with the model, or use --train-bpe N")
        try:
            inner = tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:   # tokenizers raises plain Exception on a bad file
            raise DataError(f"{path} is not a Hugging Face tokenizers file ({err}); pass a "
                            f"tokenizer.json (not vocab.json or tokenizer_config.json)") from None
        return cls(inner, str(path))

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text``, int64."""
        return np.asarray(self.inner.encode(text, add_special_tokens=False).ids, np.int64)

    def encode_batch(self, texts: list) -> list:
        """Token ids of each text (in parallel, without offsets where the installed
        ``tokenizers`` can), int64 arrays."""
        encode = getattr(self.inner, "encode_batch_fast", self.inner.encode_batch)
        return [np.asarray(e.ids, np.int64) for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        """The text of token ids (any integer sequence or array)."""
        return self.inner.decode([int(i) for i in np.asarray(ids).ravel()],
                                 skip_special_tokens=False)
