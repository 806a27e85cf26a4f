"""Token folders (nanoGPT's train.bin/val.bin): memmap, sampler, resume, memory, refusals."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpishard.data.corpus import BatchSampler, DataError
from mpishard.data.tokens import (RUN_TOKENS, SAMPLE_RUNS, TokenArray, Tokenizer, dtype_for_vocab,
                             is_token_dir, load_tokens)

ROOT = Path(__file__).resolve().parents[2]


def write_tokens(folder: Path, train, val, meta=None, dtype="uint16") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    np.asarray(train, dtype).tofile(folder / "train.bin")
    np.asarray(val, dtype).tofile(folder / "val.bin")
    if meta is not None:
        (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def listing(folder: Path) -> list:
    """Every path under ``folder``, with the size and mtime of files."""
    return sorted((str(p.relative_to(folder)),) + ((p.stat().st_size, p.stat().st_mtime_ns)
                  if p.is_file() else ()) for p in folder.rglob("*"))


def run_python(code: str, *args, timeout=240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_memmap_feeds_the_sampler_and_resumes(tmp_path):
    ids = np.random.default_rng(0).integers(0, 1000, 20_000)
    folder = write_tokens(tmp_path / "tok", ids[:18_000], ids[18_000:],
                          {"dtype": "uint16", "vocab_size": 1000})
    assert is_token_dir(folder) and not is_token_dir(folder / "train.bin")
    corpus = load_tokens(folder, min_tokens=33)
    assert isinstance(corpus.train, np.memmap) and isinstance(corpus.val, np.memmap)
    assert isinstance(corpus.train, TokenArray) and not corpus.train.flags.writeable
    assert (corpus.vocab_size, corpus.dtype, corpus.notes) == (1000, "uint16", [])
    assert corpus.tokenizer is None and corpus.source == str(folder)
    assert np.array_equal(corpus.val, ids[18_000:])
    sampler = BatchSampler(corpus.train, 32, 4, dp_rank=1, dp_size=2, seed=5)
    for _ in range(10):
        x, y = sampler.next_batch()
    assert x.shape == (4, 32) and x.dtype == np.int64 and type(x) is np.ndarray
    assert np.array_equal(x[:, 1:], y[:, :-1])
    windows = {tuple(w) for w in ids[: sampler.n_windows * 32].reshape(-1, 32)}
    assert all(tuple(row) in windows for row in x)                         # the file's own
    state = json.loads(json.dumps(sampler.state_dict()))                   # as a checkpoint
    expected = [sampler.next_batch() for _ in range(40)]                   # crosses an epoch
    resumed = BatchSampler(load_tokens(folder).train, 32, 4, dp_rank=1, dp_size=2, seed=5)
    resumed.load_state_dict(state)
    for x, y in expected:
        rx, ry = resumed.next_batch()
        assert np.array_equal(rx, x) and np.array_equal(ry, y)
    corpus.release_pages()
    assert np.array_equal(corpus.train[:100], ids[:100])      # still readable


RESUME_SCRIPT = """
import json, os, signal, sys
from mpishard.data.corpus import BatchSampler
from mpishard.data.tokens import load_tokens
folder, mode, state_path = sys.argv[1:]
sampler = BatchSampler(load_tokens(folder).train, 16, 4, dp_rank=1, dp_size=2, seed=3)
if mode == "kill":
    for step in range(3):
        sampler.next_batch()
        with open(state_path + ".tmp", "w") as f:
            json.dump(sampler.state_dict(), f)
        os.replace(state_path + ".tmp", state_path)
    os.kill(os.getpid(), signal.SIGKILL)
with open(state_path) as f:
    sampler.load_state_dict(json.load(f))
print(json.dumps(sampler.next_batch()[0].tolist()))
"""


def test_resume_after_a_kill_continues_at_the_same_token(tmp_path):
    ids = np.random.default_rng(1).integers(0, 70_000, 5_000)
    folder = write_tokens(tmp_path / "tok", ids[:4_000], ids[4_000:],
                          {"dtype": "uint32", "vocab_size": 70_000}, dtype="uint32")
    state = tmp_path / "state.json"
    killed = run_python(RESUME_SCRIPT, folder, "kill", state)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = run_python(RESUME_SCRIPT, folder, "resume", state)
    assert resumed.returncode == 0, resumed.stderr
    whole = BatchSampler(load_tokens(folder).train, 16, 4, dp_rank=1, dp_size=2, seed=3)
    for _ in range(3):
        whole.next_batch()
    assert json.loads(resumed.stdout) == whole.next_batch()[0].tolist()


def test_nanogpt_folder_needs_the_vocab_size_and_defaults_to_uint16(tmp_path):
    folder = write_tokens(tmp_path / "owt", np.arange(100) % 50257, np.arange(10))
    with pytest.raises(DataError, match=r"no meta.json .* pass --vocab-size N \(50257"):
        load_tokens(folder)
    corpus = load_tokens(folder, vocab_size=50257)
    assert (corpus.dtype, corpus.train.dtype, corpus.notes) == ("uint16", np.uint16, [])
    (folder / "tokenizer.json").write_text("{}")
    assert load_tokens(folder, vocab_size=50304).tokenizer == str(folder / "tokenizer.json")
    with pytest.raises(DataError, match="holds token id 6488162, .*check --data-dtype"):
        load_tokens(folder, dtype="uint32", vocab_size=50257)    # uint16 pairs read as one


def test_meta_json_sets_dtype_and_vocab(tmp_path):
    ids = np.arange(300) + 65_600
    folder = write_tokens(tmp_path / "big", ids, ids[:20],
                          {"dtype": "uint32", "vocab_size": 66_000, "tokenizer": "tok.json"},
                          dtype="uint32")
    corpus = load_tokens(folder)
    assert corpus.dtype == "uint32" and corpus.train.dtype == np.uint32
    assert int(corpus.train.max()) == 65_899 and corpus.vocab_size == 66_000
    assert corpus.tokenizer is None and "'tok.json', which is not in" in corpus.notes[0]
    assert load_tokens(folder, dtype="uint32", vocab_size=66_000).vocab_size == 66_000
    padded = load_tokens(folder, vocab_size=66_048)
    assert padded.vocab_size == 66_048 and any("pads the 66000" in n for n in padded.notes)
    with pytest.raises(DataError, match="--data-dtype uint16 contradicts .*says uint32"):
        load_tokens(folder, dtype="uint16")
    with pytest.raises(DataError, match="--vocab-size 1000 is smaller than the 66000"):
        load_tokens(folder, vocab_size=1000)
    assert (dtype_for_vocab(65_536), dtype_for_vocab(65_537)) == ("uint16", "uint32")


def test_a_vocabulary_from_the_model_folder_names_its_tokenizer(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")             # a Hugging Face folder
    folder = write_tokens(tmp_path / "owt", np.arange(100) * 11, np.arange(10))   # ids < 1100
    with pytest.raises(DataError, match=r"holds token id 1089, but the vocabulary of the model "
                                        r"in .*model has 1000 ids .*; tokenize the text with the "
                                        r"model's own tokenizer \(its tokenizer.json, which "
                                        r".*model does not hold\): mpishard prepare TEXT_PATH "
                                        r"OUT_DIR --tokenizer TOKENIZER_JSON"):
        load_tokens(folder, vocab_size=1000, model_folder=str(model))
    (model / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match=r"model's own tokenizer: mpishard prepare TEXT_PATH "
                                        r"OUT_DIR --tokenizer .*model/tokenizer.json"):
        load_tokens(folder, vocab_size=1000, model_folder=str(model))
    with pytest.raises(DataError, match=r"pass the tokenizer's --vocab-size"):
        load_tokens(folder, vocab_size=1000, model_folder=str(tmp_path / "weights.safetensors"))


@pytest.mark.parametrize("meta,complaint", [
    ('{"dtype": "int8", "vocab_size": 10}', r"token dtype 'int8' .* not one of uint16, uint32"),
    ('{"dtype": "uint16", "vocab_size": -3}', r"vocab_size -3 .* positive integer"),
    ("[1, 2]", "not a JSON object"),
    ("{dtype: uint16", "is not JSON"),
])
def test_bad_meta_json(tmp_path, meta, complaint):
    folder = write_tokens(tmp_path / "tok", np.arange(10), np.arange(10))
    (folder / "meta.json").write_text(meta)
    with pytest.raises(DataError, match=complaint):
        load_tokens(folder)


def test_refusals_name_the_file_and_the_fix(tmp_path):
    folder = write_tokens(tmp_path / "tok", np.arange(100), np.arange(10),
                          {"dtype": "uint16", "vocab_size": 100})
    raw = write_tokens(tmp_path / "raw", [1, 2], [1, 2])
    before = listing(tmp_path)
    with pytest.raises(DataError, match="is not a folder"):
        load_tokens(folder / "train.bin")
    with pytest.raises(DataError, match="has no train.bin"):
        load_tokens(tmp_path)
    with pytest.raises(DataError, match="one block needs 11; use more text or a smaller "
                                        "--block-size"):
        load_tokens(folder, min_tokens=11)                      # val.bin holds 10
    with pytest.raises(DataError, match="--data-dtype\\) is not one of uint16, uint32"):
        load_tokens(raw, dtype="int64", vocab_size=5)
    assert listing(tmp_path) == before                          # nothing written
    (folder / "val.bin").unlink()
    assert is_token_dir(folder)
    with pytest.raises(DataError, match=r"has no val.bin; a token folder holds train.bin and "
                                        r"val.bin"):
        load_tokens(folder)
    write_tokens(folder, np.arange(100), np.arange(10))
    with open(folder / "train.bin", "ab") as f:
        f.write(b"\0")                                          # 201 bytes
    with pytest.raises(DataError, match=r"has 201 bytes, not a multiple of 2 \(uint16"):
        load_tokens(folder)


def test_ids_beyond_the_vocabulary_are_found_in_a_bounded_sample(tmp_path):
    folder = write_tokens(tmp_path / "small", np.arange(100), np.arange(10),
                          {"dtype": "uint16", "vocab_size": 99})
    with pytest.raises(DataError, match=r"train.bin holds token id 99, but the vocabulary "
                                        r"has 99 ids \(0..98\)"):
        load_tokens(folder)
    n = 2 * SAMPLE_RUNS * RUN_TOKENS
    ids = np.zeros(n, np.uint16)
    starts = np.linspace(0, n - RUN_TOKENS, SAMPLE_RUNS).astype(np.int64)
    unread = int(starts[1]) - 1                             # between the first two runs
    ids[unread] = 5000
    big = write_tokens(tmp_path / "big", ids, ids[:100], {"dtype": "uint16", "vocab_size": 10})
    assert load_tokens(big, min_tokens=64).train.size == n  # not read: a bounded check
    ids[n - 3] = 777                                        # in the last block
    write_tokens(big, ids, ids[:100])
    with pytest.raises(DataError, match="holds token id 777"):
        load_tokens(big, min_tokens=64)


def test_tokenizer_file_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="does not exist; pass the tokenizer.json"):
        Tokenizer.from_file(tmp_path / "none.json")
    (tmp_path / "vocab.json").write_text('{"a": 0}')
    with pytest.raises(DataError, match="is not a Hugging Face tokenizers file"):
        Tokenizer.from_file(tmp_path / "vocab.json")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(DataError, match="pip install tokenizers"):
        Tokenizer.from_file(tmp_path / "vocab.json")


RSS_SCRIPT = """
import json, resource, sys
import numpy as np
from mpishard.data.corpus import BatchSampler
from mpishard.data.tokens import load_tokens
def peak():   # VmHWM: ru_maxrss would still hold the forked parent's RSS from before exec
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
folder, mode = sys.argv[1:]
base = peak()
if mode == "whole":                                    # the meter sees data read into memory
    data = np.fromfile(folder + "/train.bin", np.uint16)
    print(json.dumps({"base": base, "peak": peak()}))
    sys.exit()
corpus = load_tokens(folder, min_tokens=513)
loaded = peak()
sampler = BatchSampler(corpus.train, 512, 4, seed=0)   # stands in for a training loop
checksum = 0
for _ in range(500):
    x, y = sampler.next_batch()
    checksum += int(x[:, 0].sum())
print(json.dumps({"base": base, "loaded": loaded, "peak": peak(), "windows": sampler.n_windows}))
"""


def _synthetic(folder: Path, chunks: int, chunk: np.ndarray) -> Path:
    folder.mkdir()
    with open(folder / "train.bin", "wb") as f:
        for _ in range(chunks):
            f.write(chunk.tobytes())
    chunk.tofile(folder / "val.bin")
    (folder / "meta.json").write_text('{"dtype": "uint16", "vocab_size": 50257}')
    return folder


@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB on Linux")
def test_peak_rss_does_not_grow_with_the_file_size(tmp_path):
    if shutil.disk_usage(tmp_path).free < 2 * 2**30:
        pytest.skip(f"needs 2 GB free in {tmp_path} for a 420 MiB token file")
    chunk = np.random.default_rng(0).integers(0, 50257, 2**21, dtype=np.uint16)  # 4 MiB
    try:
        small = _synthetic(tmp_path / "small", 11, chunk)                          # 44 MiB
        big = _synthetic(tmp_path / "big", 105, chunk)                             # 420 MiB
        size, small_size = ((f / "train.bin").stat().st_size for f in (big, small))
        whole = json.loads(run_python(RSS_SCRIPT, small, "whole").stdout)
        reports = {}
        for name, folder in (("small", small), ("big", big)):
            proc = run_python(RSS_SCRIPT, folder, "memmap")
            assert proc.returncode == 0, proc.stderr
            reports[name] = json.loads(proc.stdout)
    finally:
        for name in ("big", "small"):
            shutil.rmtree(tmp_path / name, ignore_errors=True)
    mib = {n: {k: round(v / 2**20, 1) for k, v in r.items() if k != "windows"}
           for n, r in reports.items()}
    print(f"train.bin {size / 2**20:.0f} MiB vs {small_size / 2**20:.0f} MiB: peak RSS "
          f"MiB {mib}; np.fromfile of the small one: {whole['peak'] / 2**20:.1f} MiB")
    assert whole["peak"] - whole["base"] > 0.9 * small_size   # the meter sees a whole load
    grown = {n: r["peak"] - r["base"] for n, r in reports.items()}
    assert grown["big"] < size / 8, (grown, size)                        # far below the file
    # the sampler's own epoch permutation holds 8 bytes per window (data.BatchSampler)
    order = 8 * (reports["big"]["windows"] - reports["small"]["windows"])
    assert grown["big"] - grown["small"] < order + 8 * 2**20, (grown, order)
    assert reports["big"]["loaded"] - reports["big"]["base"] < 16 * 2**20   # the id check
