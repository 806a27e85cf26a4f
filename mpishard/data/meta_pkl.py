"""nanoGPT's ``meta.pkl``, read as data only: the vocabulary of character-level token folders.

nanoGPT's ``data/shakespeare_char/prepare.py`` writes, beside ``train.bin`` and
``val.bin`` (uint16 ids, one per character), a pickled dict:

    {"vocab_size": 65, "itos": {0: "\\n", 1: " ", ...}, "stoi": {"\\n": 0, " ": 1, ...}}

Unpickling may run any code the file names (a ``__reduce__`` returning
``os.system`` and a command), so :func:`read_meta_pkl` never resolves a Python
object: its unpickler's ``find_class`` refuses every name, and without it a
pickle can build only what its own opcodes make (dicts, lists, tuples,
strings, numbers, bytes, sets, None). What comes out is then checked to hold
dicts, lists, tuples, strings and integers only. Any other object is refused
with one line, and nothing in the file runs.

    >>> meta = read_meta_pkl("shakespeare_char/meta.pkl")       # {"vocab_size": 65, ...}
    >>> chars = CharTokenizer.from_meta(meta, "shakespeare_char/meta.pkl")
    >>> chars.decode(chars.encode("To be"))
    'To be'
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np

from mpishard.data.corpus import DataError

__all__ = ["read_meta_pkl", "CharTokenizer", "PLAIN_TYPES"]

#: the only types a meta.pkl may hold
PLAIN_TYPES = (dict, list, tuple, str, int)
_PLAIN_NAMES = "dicts, lists, tuples, strings and integers"


class _ObjectRefused(pickle.UnpicklingError):
    """A pickle named a class or function."""


class _DataOnlyUnpickler(pickle.Unpickler):
    """An unpickler that resolves no global: every class or function a pickle names is
    refused, so no code from the file is reached, let alone run."""

    def find_class(self, module, name):
        raise _ObjectRefused(f"names the Python object {module}.{name}")


def _check_plain(value, path) -> None:
    """Refuse any object in ``value`` (walked without recursion, each container once)
    whose type is not one of :data:`PLAIN_TYPES`."""
    seen, todo = set(), [value]
    while todo:
        item = todo.pop()
        if type(item) not in PLAIN_TYPES:
            raise DataError(f"{path} holds a {type(item).__name__} ({item!r:.40}); mpishard "
                            f"reads only {_PLAIN_NAMES} from a meta.pkl (nanoGPT's "
                            f"vocab_size, itos, stoi); write a meta.json instead (docs/data.md)")
        if isinstance(item, (dict, list, tuple)) and id(item) not in seen:
            seen.add(id(item))
            todo.extend([*item.keys(), *item.values()] if isinstance(item, dict) else item)


def read_meta_pkl(path) -> dict:
    """The dict a nanoGPT ``meta.pkl`` holds, without unpickling any Python object.

    Raises:
        DataError: the file names a class or function (an instance, a
            ``__reduce__`` such as ``os.system``: refused before anything runs),
            holds a value other than a dict, list, tuple, str or int, is not a
            pickle, or is not a dict.
    """
    path = Path(path)
    try:
        meta = _DataOnlyUnpickler(io.BytesIO(path.read_bytes())).load()
    except _ObjectRefused as err:
        raise DataError(f"{path} {err}: refused, nothing in it was run; mpishard reads "
                        f"only {_PLAIN_NAMES} from a meta.pkl (nanoGPT's vocab_size, itos, "
                        f"stoi). Write a meta.json instead (docs/data.md), or remove the "
                        f"file and pass --vocab-size") from None
    except Exception as err:  # noqa: BLE001 -- a damaged pickle raises many types
        raise DataError(f"{path} is not a pickle nanoGPT's prepare.py wrote ({type(err).__name__}: "
                        f"{err}); write it again, or remove it and pass --vocab-size") from None
    _check_plain(meta, path)
    if not isinstance(meta, dict):
        raise DataError(f"{path} holds a {type(meta).__name__}, not the dict nanoGPT's "
                        f"prepare.py writes ({{'vocab_size': N, 'itos': ..., 'stoi': ...}})")
    return meta


class CharTokenizer:
    """nanoGPT's character vocabulary: one id per character (``itos``/``stoi`` of a meta.pkl).

    Same use as :class:`~mpishard.data.tokens.Tokenizer`: ``encode`` gives int64 ids,
    ``decode`` text (an id outside ``itos``, in an embedding padded past it, decodes
    as U+FFFD).
    """

    def __init__(self, itos: dict, path: str):
        self.itos, self.path = itos, path
        self.stoi = {text: i for i, text in itos.items()}
        #: one more than the largest id
        self.vocab_size = max(itos, default=-1) + 1

    @classmethod
    def from_meta(cls, meta: dict, path) -> "CharTokenizer":
        """The tokenizer of a meta.pkl's ``itos`` (id -> character).

        Raises:
            DataError: no ``itos``, or one that does not map integers to strings.
        """
        itos = meta.get("itos")
        if not isinstance(itos, dict) or not all(
                type(i) is int and isinstance(s, str) for i, s in itos.items()):
            found = "none" if itos is None else type(itos).__name__
            raise DataError(f"{path} has no 'itos' mapping ids to characters (found "
                            f"{found}), so its ids cannot be turned into text; write it again "
                            f"with nanoGPT's prepare.py, or put a tokenizer.json beside it")
        return cls(itos, str(path))

    def encode(self, text: str) -> np.ndarray:
        """The id of each character of ``text``, int64.

        Raises:
            DataError: a character that is not in the vocabulary, named.
        """
        missing = next((c for c in text if c not in self.stoi), None)
        if missing is not None:
            raise DataError(f"the text {text!r:.40} holds {missing!r}, which is not one of the "
                            f"{len(self.stoi)} characters of {self.path}; use only those "
                            f"(e.g. {''.join(sorted(self.stoi))[-20:]!r})")
        return np.array([self.stoi[c] for c in text], dtype=np.int64)

    def decode(self, ids) -> str:
        """The text of token ids (any integer sequence or array)."""
        return "".join(self.itos.get(int(i), "\ufffd") for i in np.asarray(ids).ravel())
