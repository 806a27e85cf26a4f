"""nanoGPT's character-level folders: meta.pkl read as data only, its vocabulary and characters."""
import os
import pickle

import numpy as np
import pytest

from mpishard.data.corpus import DataError
from mpishard.data.meta_pkl import CharTokenizer, read_meta_pkl
from mpishard.data.tokens import load_tokens, open_tokenizer

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
        "\nFirst Citizen:\nYou are all resolved rather to die than to famish?\n\n") * 40
N_CHARS = len(set(TEXT))                                 # 33


def write_shakespeare_char(folder, text=TEXT):
    """What nanoGPT's data/shakespeare_char/prepare.py writes for ``text`` (its own lines,
    the download left out): uint16 ids of the sorted characters, 90/10, and meta.pkl."""
    os.makedirs(folder, exist_ok=True)
    data = text
    chars = sorted(list(set(data)))
    vocab_size = len(chars)
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}

    def encode(s):
        return [stoi[c] for c in s]

    n = len(data)
    train_data = data[:int(n * 0.9)]
    val_data = data[int(n * 0.9):]
    train_ids = np.array(encode(train_data), dtype=np.uint16)
    val_ids = np.array(encode(val_data), dtype=np.uint16)
    train_ids.tofile(os.path.join(folder, 'train.bin'))
    val_ids.tofile(os.path.join(folder, 'val.bin'))
    meta = {'vocab_size': vocab_size, 'itos': itos, 'stoi': stoi}
    with open(os.path.join(folder, 'meta.pkl'), 'wb') as f:
        pickle.dump(meta, f)
    return folder


def test_the_vocabulary_and_characters_come_from_meta_pkl(tmp_path):
    folder = write_shakespeare_char(tmp_path / "shakespeare_char")
    corpus = load_tokens(folder, min_tokens=17)
    assert (corpus.vocab_size, corpus.dtype, corpus.notes) == (N_CHARS, "uint16", [])
    assert corpus.tokenizer is None                       # no tokenizer.json
    chars = open_tokenizer(folder)
    assert isinstance(chars, CharTokenizer) and chars.vocab_size == corpus.vocab_size
    split = int(len(TEXT) * 0.9)
    assert chars.decode(corpus.train) == TEXT[:split] and chars.decode(corpus.val) == TEXT[split:]
    assert chars.decode(chars.encode("Speak, speak.")) == "Speak, speak."
    assert chars.decode([0, corpus.vocab_size + 3]) == "\n\ufffd"   # a padded row's id
    with pytest.raises(DataError, match=rf"holds 'Z', which is not one of the {N_CHARS} characters of "
                                        r".*meta.pkl; use only those"):
        chars.encode("Zounds")
    padded = load_tokens(folder, vocab_size=64)
    assert padded.vocab_size == 64 and f"pads the {N_CHARS} token ids of" in padded.notes[0]
    with pytest.raises(DataError, match=rf"--vocab-size 20 is smaller than the {N_CHARS} of .*meta.pkl"):
        load_tokens(folder, vocab_size=20)
    (folder / "meta.json").write_text('{"dtype": "uint16", "vocab_size": 40}')
    assert load_tokens(folder).vocab_size == 40             # meta.json wins over meta.pkl


class Shell:
    """Unpickling one of these runs a shell command (the classic pickle exploit)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class Vocabulary:
    """A plain class: its instances pickle by name (find_class) and __dict__."""

    def __init__(self):
        self.size = 65


@pytest.mark.parametrize("case", ["os.system", "instance", "builtins.open", "float", "set"])
def test_meta_pkl_holding_anything_but_data_is_refused_and_never_run(case, tmp_path):
    folder = write_shakespeare_char(tmp_path / "char")
    trap = tmp_path / "ran"
    payload = {
        "os.system": {"vocab_size": N_CHARS, "itos": Shell(f"touch {trap}")},
        "instance": {"vocab_size": N_CHARS, "vocab": Vocabulary()},
        "float": {"vocab_size": N_CHARS, "val_fraction": 0.1},
        "set": {"vocab_size": N_CHARS, "chars": {"a", "b"}},
    }
    if case == "builtins.open":       # opens (creates) the trap file when unpickled
        raw = b"cbuiltins\nopen\n(V" + str(trap).encode() + b"\nVw\ntR."
    else:
        raw = pickle.dumps(payload[case])
    (folder / "meta.pkl").write_bytes(raw)
    if case in ("os.system", "builtins.open"):    # the payload is live for pickle itself
        pickle.loads(raw)
        assert trap.exists()
        trap.unlink()
    expected = {"os.system": r"names the Python object (posix|os|nt)\.system: refused, nothing "
                             r"in it was run",
                "instance": r"names the Python object test_meta_pkl\.Vocabulary: refused",
                "builtins.open": r"names the Python object builtins\.open: refused",
                "float": r"holds a float \(0\.1\); mpishard reads only dicts, lists, tuples, "
                         r"strings and integers",
                "set": r"holds a set "}[case]
    for call in (lambda: read_meta_pkl(folder / "meta.pkl"), lambda: load_tokens(folder),
                 lambda: load_tokens(folder, vocab_size=N_CHARS), lambda: open_tokenizer(folder)):
        with pytest.raises(DataError, match=expected) as err:
            call()
        assert "\n" not in str(err.value)                     # one line
    assert not trap.exists()


@pytest.mark.parametrize("raw, complaint", [
    (b"not a pickle", r"is not a pickle nanoGPT's prepare.py wrote \(UnpicklingError"),
    (pickle.dumps([1, 2]), r"holds a list, not the dict nanoGPT's prepare.py writes"),
    (pickle.dumps({"itos": {0: "a"}}), r"has no vocab_size \(it holds \['itos'\]\); pass "
                                       r"--vocab-size N"),
])
def test_meta_pkl_that_is_not_nanogpts_is_one_clear_line(raw, complaint, tmp_path):
    folder = write_shakespeare_char(tmp_path / "char")
    (folder / "meta.pkl").write_bytes(raw)
    with pytest.raises(DataError, match=complaint):
        load_tokens(folder)


def test_a_folder_without_a_tokenizer_says_so(tmp_path):
    folder = write_shakespeare_char(tmp_path / "char")
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": N_CHARS}))
    assert load_tokens(folder).vocab_size == N_CHARS
    with pytest.raises(DataError, match=r"has no 'itos' mapping ids to characters \(found "
                                        r"none\)"):
        open_tokenizer(folder)
    (folder / "meta.pkl").unlink()
    with pytest.raises(DataError, match=r"has no tokenizer.json \(nor a nanoGPT meta.pkl of "
                                        r"characters\)"):
        open_tokenizer(folder)
