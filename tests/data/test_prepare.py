"""``mpishard prepare``: text to a token folder, with a given or a freshly trained tokenizer."""
import argparse
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import mpishard.data.prepare as prep
from mpishard.data.corpus import DataError
from mpishard.data.prepare import add_prepare_command, main, prepare
from mpishard.data.tokens import Tokenizer, load_tokens

ROOT = Path(__file__).resolve().parents[2]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
ODD = "naïve café 日本語 — ünïcode\t tabs\r\n  <|endoftext|> inside\n"


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "input.txt"
    path.write_text((STDLIB / "textwrap.py").read_text(encoding="utf-8") + ODD * 20,
                    encoding="utf-8")
    return path


def listing(folder: Path) -> list:
    """Every path under ``folder``, with the size and mtime of files."""
    return sorted((str(p.relative_to(folder)),) + ((p.stat().st_size, p.stat().st_mtime_ns)
                  if p.is_file() else ()) for p in folder.rglob("*"))


def test_round_trip_with_a_trained_bpe(tmp_path, text_file):
    out = tmp_path / "tok"
    summary = prepare(text_file, out, train_bpe=400, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json",
                                                      "train.bin", "val.bin"]
    assert summary["files"] == [str(out / n) for n in ("train.bin", "val.bin", "meta.json",
                                                       "tokenizer.json")]
    corpus = load_tokens(out)
    assert isinstance(corpus.train, np.memmap) and corpus.dtype == "uint16"
    assert corpus.vocab_size == summary["vocab_size"] == 400
    assert (corpus.train.size, corpus.val.size) == (summary["train_tokens"],
                                                    summary["val_tokens"])
    tok = Tokenizer.from_file(corpus.tokenizer)
    text = text_file.read_bytes().decode()              # read_text would drop the \r
    assert tok.decode(corpus.train) + tok.decode(corpus.val) == text
    assert tok.decode(tok.encode(text)) == text and tok.vocab_size == 400
    assert tok.encode("<|endoftext|>").tolist() == [0]
    n_val = int(len(text.encode()) * 0.1)                  # the last tenth of the bytes
    assert tok.decode(corpus.val).encode() == text.encode()[-n_val:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == "tokenizer.json"


def test_same_text_same_files_and_a_given_tokenizer(tmp_path, text_file):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    prepare(text_file, a, train_bpe=300, progress=False)
    prepare(text_file, b, train_bpe=300, progress=False)
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    summary = prepare(text_file, c, tokenizer=a / "tokenizer.json", progress=False)
    assert summary["tokenizer"] == str(a / "tokenizer.json")
    assert (c / "train.bin").read_bytes() == (a / "train.bin").read_bytes()
    assert (c / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()


def test_small_pieces_change_nothing_but_memory(tmp_path, text_file, monkeypatch):
    prepare(text_file, tmp_path / "a", train_bpe=300, progress=False)
    tok = Tokenizer.from_file(tmp_path / "a" / "tokenizer.json")
    monkeypatch.setattr(prep, "PIECE_BYTES", 100)           # many pieces, lines cut too
    monkeypatch.setattr(prep, "BATCH_BYTES", 1000)
    prepare(text_file, tmp_path / "b", tokenizer=tmp_path / "a" / "tokenizer.json",
            progress=False)
    corpus = load_tokens(tmp_path / "b")
    assert tok.decode(corpus.train) + tok.decode(corpus.val) == text_file.read_bytes().decode()
    line = tmp_path / "line.txt"                           # no line break: cut by characters
    line.write_text("ü日x" * 300 + "😀" * 99, encoding="utf-8")
    prepare(line, tmp_path / "c", tokenizer=tmp_path / "a" / "tokenizer.json", progress=False)
    corpus = load_tokens(tmp_path / "c")
    assert tok.decode(corpus.train) + tok.decode(corpus.val) == line.read_text("utf-8")


def test_uint32_when_the_vocabulary_exceeds_uint16(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000}
    inner = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    inner.save(str(tmp_path / "words.json"))
    (tmp_path / "words.txt").write_text("w69999 w5 w65536 w1\n" * 50)
    summary = prepare(tmp_path / "words.txt", tmp_path / "tok",
                      tokenizer=tmp_path / "words.json", progress=False)
    assert (summary["dtype"], summary["vocab_size"]) == ("uint32", 70_001)
    corpus = load_tokens(tmp_path / "tok")
    assert corpus.train.dtype == np.uint32 and corpus.train[:4].tolist() == [69999, 5, 65536, 1]
    assert (tmp_path / "tok" / "train.bin").stat().st_size == 4 * corpus.train.size


def test_folders_and_the_default_corpus(tmp_path, capsys):
    texts = tmp_path / "texts"
    (texts / "b").mkdir(parents=True)
    (texts / "a.txt").write_text("first file\n" * 30)
    (texts / "b" / "c.txt").write_text("second file\n" * 30)
    (texts / ".hidden").write_text("not read\n")
    out = texts / "tok"                                    # inside the text folder
    prepare(texts, out, train_bpe=300, progress=False)
    prepare(texts, out, train_bpe=300, progress=False, overwrite=True)   # its own output unread
    tok, corpus = Tokenizer.from_file(out / "tokenizer.json"), load_tokens(out)
    assert tok.decode(corpus.train) + tok.decode(corpus.val) == \
        "first file\n" * 30 + "second file\n" * 30
    summary = prepare("default", tmp_path / "std", train_bpe=300, max_bytes=100_000,
                      progress=False)
    assert summary["source"] == "python stdlib sources" and summary["bytes"] == 100_000
    assert capsys.readouterr().err == ""                   # progress=False: silent


def test_progress_lines_without_tqdm(tmp_path, text_file, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    prepare(text_file, tmp_path / "tok", train_bpe=300)
    err = capsys.readouterr().err
    assert "prepare: train bpe" in err and "prepare: tokenize 100%" in err


@pytest.mark.parametrize("kwargs,complaint", [
    ({}, "give exactly one of --tokenizer FILE .* or --train-bpe N .*; got neither"),
    ({"train_bpe": 300, "tokenizer": "t.json"}, "give exactly one of .*; got both"),
    ({"train_bpe": 100}, "--train-bpe 100: a byte-level BPE needs at least 257"),
    ({"train_bpe": 300, "val_fraction": 0.0}, "--val-fraction 0.0 must lie strictly"),
    ({"train_bpe": 300, "val_fraction": 1}, "--val-fraction 1 must lie strictly"),
    ({"train_bpe": 300, "max_bytes": -1}, "--max-bytes -1 must be >= 0"),
    ({"tokenizer": "missing.json"}, "tokenizer file .*missing.json' does not exist"),
    ({"tokenizer": "input.txt"}, "is not a Hugging Face tokenizers file"),
    ({"train_bpe": 300, "max_bytes": 3}, "has 3 bytes .* too little for a training and a "
                                         "validation part"),
])
def test_refusals_write_nothing(tmp_path, text_file, kwargs, complaint, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = listing(tmp_path)
    with pytest.raises(DataError, match=complaint):
        prepare(text_file, tmp_path / "out", progress=False, **kwargs)
    assert listing(tmp_path) == before


def test_refused_text_paths(tmp_path, text_file):
    token_dir = tmp_path / "owt"
    token_dir.mkdir()
    (token_dir / "train.bin").write_bytes(b"\0\0")
    (tmp_path / "empty.txt").write_text("")
    before = listing(tmp_path)
    for path, complaint in ((tmp_path / "nowhere", "does not exist; pass a text file, a "
                                                   "folder of text files, or 'default'"),
                            (token_dir, "holds train.bin: token ids already"),
                            (tmp_path / "empty.txt", "has 0 bytes"),
                            (tmp_path, "OUT_DIR .* is TEXT_PATH")):
        with pytest.raises(DataError, match=complaint):
            prepare(path, tmp_path if path == tmp_path else tmp_path / "out", train_bpe=300)
    with pytest.raises(DataError, match="is a file; pass a folder"):
        prepare(text_file, text_file, train_bpe=300)
    assert listing(tmp_path) == before


def test_existing_output_is_refused_or_replaced_whole(tmp_path, text_file, monkeypatch):
    out = tmp_path / "tok"
    prepare(text_file, out, train_bpe=300, progress=False)
    before = listing(tmp_path)
    with pytest.raises(DataError, match=r"train.bin exists; pass --overwrite true"):
        prepare(text_file, out, train_bpe=400, progress=False)
    assert listing(tmp_path) == before

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(prep, "_encode_all", broken)      # a failure half way
    with pytest.raises(RuntimeError, match="disk full"):
        prepare(text_file, out, train_bpe=400, progress=False, overwrite=True)
    assert listing(tmp_path) == before                     # old data intact, no .tmp left
    with pytest.raises(RuntimeError):
        prepare(text_file, tmp_path / "new", train_bpe=400, progress=False)
    assert not (tmp_path / "new").exists()                 # the folder it made is gone
    monkeypatch.undo()
    assert prepare(text_file, out, train_bpe=400, progress=False,
                   overwrite=True)["vocab_size"] == 400
    assert load_tokens(out).vocab_size == 400


def test_tokenizers_missing(tmp_path, text_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(DataError, match="pip install tokenizers"):
        prepare(text_file, tmp_path / "out", train_bpe=300)
    assert not (tmp_path / "out").exists()


def test_command_line(tmp_path, text_file, capsys):
    parser = argparse.ArgumentParser(prog="mpishard")
    add_prepare_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["prepare", str(text_file), str(tmp_path / "a"), "--train-bpe",
                              "300", "--progress", "false", "--val-fraction", "0.2"])
    assert (args.train_bpe, args.progress, args.overwrite, args.val_fraction) == \
        (300, False, False, 0.2)
    assert args.func(args) == 0
    out = capsys.readouterr()
    assert f"mpishard train --data {tmp_path / 'a'}" in out.out and out.err == ""
    assert main([str(text_file), str(tmp_path / "a"), "--train-bpe", "300",
                 "--progress", "false"]) == 2
    assert "error: " in capsys.readouterr().err
    assert main([str(text_file), str(tmp_path / "b"), "--progress", "false"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpishard prepare: error: give exactly one of --tokenizer")
    assert not (tmp_path / "b").exists()
    args.out_dir = str(tmp_path / "d")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PMI_SIZE", "4")
        with pytest.raises(DataError, match="prepare runs as one process, not on 4 MPI ranks"):
            args.func(args)
    assert not (tmp_path / "d").exists()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RAYON_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "mpishard.data.prepare", str(text_file),
                           str(tmp_path / "c"), "--train-bpe", "300", "--progress", "false",
                           "--val-fraction", "0.2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("train.bin", "tokenizer.json"):          # one thread or several: the same
        assert (tmp_path / "c" / name).read_bytes() == (tmp_path / "a" / name).read_bytes()


MEMORY_SCRIPT = """
import json, sys
from mpishard.data.prepare import prepare
def hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
base = hwm()
summary = prepare(sys.argv[1], sys.argv[2], tokenizer=sys.argv[3], progress=False)
print(json.dumps({"base": base * 1024, "peak": hwm() * 1024, "tokens": summary["train_tokens"]}))
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_memory_does_not_grow_with_the_text(tmp_path, text_file):
    prepare(text_file, tmp_path / "tok", train_bpe=300, progress=False)
    block = (STDLIB / "argparse.py").read_bytes() + (STDLIB / "typing.py").read_bytes()
    reports = {}
    for name, size in (("small", 2 << 20), ("big", 12 << 20)):
        path = tmp_path / f"{name}.txt"
        path.write_bytes((block * (size // len(block) + 1))[:size])
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(path),
                               str(tmp_path / name), str(tmp_path / "tok" / "tokenizer.json")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
        assert proc.returncode == 0, proc.stderr
        reports[name] = json.loads(proc.stdout)
        path.unlink()
    grown = {n: (r["peak"] - r["base"]) / 2**20 for n, r in reports.items()}
    print(f"prepare of 2 MiB and 12 MiB of text: peak RSS grew by {grown} MiB")
    assert reports["big"]["tokens"] > 5 * reports["small"]["tokens"]
    assert grown["big"] < grown["small"] + 16, grown


def test_prepared_data_and_runs_stay_out_of_git():
    """The docs prepare into data/ and train into runs/: a checkout's git ignores both, and
    not the package's own mpishard/data/."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    paths = ["data/stdlib/train.bin", "runs/demo/metrics.jsonl", "mpishard/data/tokens.py"]
    out = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.stdout.split() == paths[:2], out.stdout + out.stderr


def test_a_tokenizer_folder_names_the_file_in_it(tmp_path, text_file):
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(DataError, match=f"^--tokenizer {model} is a folder; pass a "
                                        r"tokenizer.json file \(this folder holds none\)$"):
        prepare(text_file, tmp_path / "out", tokenizer=model, progress=False)
    (model / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match=f"^--tokenizer {model} is a folder; pass the file in "
                                        f"it: --tokenizer {model / 'tokenizer.json'}$"):
        prepare(text_file, tmp_path / "out", tokenizer=model, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_bpe_smaller_than_asked_says_so(tmp_path, capsys):
    """Merges never join words: a text of a few distinct words runs out of pairs before
    300 tokens, and a note says how many it came out at, of how many, and why."""
    text = tmp_path / "few.txt"
    text.write_text("the cat sat on the mat\n" * 200)
    summary = prepare(text, tmp_path / "out", train_bpe=300, progress=False)
    got = summary["vocab_size"]
    assert got < 300 and load_tokens(tmp_path / "out").vocab_size == got
    note = (f"the BPE came out at {got} tokens of the 300 asked: by then every word of the "
            f"training text is one token, and merges never join words; more (or more "
            f"varied) text gives more")
    assert summary["notes"] == [note]
    parser = argparse.ArgumentParser(prog="mpishard")
    add_prepare_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["prepare", str(text), str(tmp_path / "cli"), "--train-bpe", "300",
                              "--progress", "false"])
    assert args.func(args) == 0
    assert f"note: {note}" in capsys.readouterr().out.splitlines()
    assert prepare(text, tmp_path / "fits", train_bpe=got, progress=False)["notes"] == []


def test_max_bytes_takes_sizes_as_other_size_flags_do(tmp_path, text_file, capsys):
    parser = argparse.ArgumentParser(prog="mpishard")
    add_prepare_command(parser.add_subparsers(dest="command", required=True))
    for given, size in (("1KB", 1000), ("2KiB", 2048), ("1500", 1500), ("0", 0)):
        assert parser.parse_args(["prepare", "t", "o", "--max-bytes", given]).max_bytes == size
    args = parser.parse_args(["prepare", str(text_file), str(tmp_path / "kb"), "--train-bpe",
                              "257", "--max-bytes", "2KiB", "--progress", "false"])
    assert args.func(args) == 0
    assert json.loads((tmp_path / "kb" / "meta.json").read_text())["bytes"] == 2048
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([str(text_file), str(tmp_path / "x"), "--train-bpe", "257", "--max-bytes", "1x"])
    assert exit_info.value.code == 2
    assert "argument --max-bytes: '1x' is not a size: give one such as 5GB" in \
        capsys.readouterr().err
