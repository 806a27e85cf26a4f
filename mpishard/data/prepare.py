"""Text to token ids on disk (``mpishard prepare``), for ``mpishard train --data DIR``.

    mpishard prepare input.txt data/mytext --tokenizer ~/models/gpt2/tokenizer.json
    mpishard prepare default data/stdlib --train-bpe 4096      # offline, no download
    python -m mpishard.data.prepare texts/ data/texts --train-bpe 512

TEXT_PATH is a text file, a folder of text files (read recursively, sorted,
as :func:`mpishard.data.corpus.load_corpus` reads them) or the word ``default`` for
the built-in corpus (the Python standard library's sources). The tokenizer is
either a Hugging Face ``tokenizers`` file (the ``tokenizer.json`` beside a
downloaded model) or a byte-level BPE trained here on the training part of
the text itself (``--train-bpe N``), deterministic for the same text.

Memory stays bounded: the text is read in pieces of 64 KiB cut after a line
break, encoded 1 MiB at a time (``encode_batch``) and appended to
``OUT/train.bin.tmp`` / ``val.bin.tmp``. The last ``val_fraction`` of the
bytes (the split moved back to the start of a UTF-8 character) is the
validation part, as :func:`~mpishard.data.corpus.load_corpus` splits bytes. Only when
everything is written are the files renamed into place, ``train.bin`` last,
so a folder with a ``train.bin`` is always complete. The folder is nanoGPT's
layout plus ``meta.json`` and ``tokenizer.json``; see :mod:`mpishard.data.tokens`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from mpishard.data.corpus import (DEFAULT_CORPUS_BYTES, DataError, default_corpus_files, text_files_under,
                                  token_files_in)
from mpishard.core.parse import parse_bool, parse_bytes
from mpishard.data.tokens import Tokenizer, tokenizers_module, dtype_for_vocab

__all__ = ["prepare", "add_prepare_command", "main", "train_bpe_tokenizer"]

#: text is read in pieces of this many bytes, cut after their last line break
PIECE_BYTES = 1 << 16
#: this many bytes of pieces are encoded at once (encode_batch)
BATCH_BYTES = 1 << 20
#: a byte-level BPE holds the 256 bytes and <|endoftext|> before any merge
MIN_BPE = 257
END_OF_TEXT = "<|endoftext|>"
OUTPUTS = ("tokenizer.json", "meta.json", "val.bin", "train.bin")   # renamed in this order


class _Progress:
    """A tqdm bar over bytes when installed and wanted, else a plain line on stderr every
    tenth; nothing at all when ``enabled`` is false."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.enabled, self.done, self.bar = total, desc, enabled, 0, None
        self._tenths = 0
        if enabled:
            try:
                from tqdm import tqdm  # noqa: PLC0415
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True,
                                mininterval=0.5, file=sys.stderr)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and 10 * self.done // max(self.total, 1) > self._tenths:
            self._tenths = 10 * self.done // max(self.total, 1)
            print(f"prepare: {self.desc} {100 * self.done // max(self.total, 1)}% "
                  f"({self.done / 1e6:.1f} of {self.total / 1e6:.1f} MB)", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _char_start(data: bytes, k: int) -> int:
    """``k`` moved back to the start of the UTF-8 character it falls in."""
    for _ in range(3):   # a character has at most 3 continuation bytes
        if 0 < k < len(data) and 0x80 <= data[k] < 0xC0:
            k -= 1
    return k


def _pieces(files: list, total: int, split: int):
    """``(bytes, is_val)`` pieces of the first ``total`` bytes of ``files``: at most about
    PIECE_BYTES, cut after a line break where there is one, never across a file's end;
    the piece holding byte ``split`` is cut there (at a character's start)."""
    offset, left = 0, total
    for path in files:
        if left <= 0:
            return
        buffer = b""
        with open(path, "rb") as handle:
            while True:
                data = handle.read(min(PIECE_BYTES, left)) if left > 0 else b""
                left -= len(data)
                buffer += data
                if data and len(buffer) < PIECE_BYTES:
                    continue
                cut = len(buffer) if not data else (buffer.rfind(b"\n") + 1 or
                                                    _char_start(buffer, len(buffer) - 1))
                piece, buffer = buffer[:cut], buffer[cut:]
                if offset < split < offset + len(piece):
                    k = _char_start(piece, split - offset)
                    yield from ((p, v) for p, v in ((piece[:k], False), (piece[k:], True)) if p)
                elif piece:
                    yield piece, offset >= split
                offset += len(piece)
                if not data:
                    break


def _text(pieces, progress: _Progress):
    for piece, is_val in pieces:
        progress.update(len(piece))
        yield piece.decode("utf-8", errors="replace"), is_val


def train_bpe_tokenizer(texts, vocab_size: int) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` included) trained on an
    iterator of strings; deterministic for the same strings. May hold fewer tokens when
    the text has too few distinct pairs to merge."""
    tokenizers = tokenizers_module()
    from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    inner = tokenizers.Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[END_OF_TEXT])
    inner.train_from_iterator(texts, trainer)
    return Tokenizer(inner)


def _sources(text_path, out_dir: Path, max_bytes):
    """(files, source name, bytes to read) of TEXT_PATH; refuses what is not text."""
    if str(text_path) == "default":
        return default_corpus_files(), "python stdlib sources", max_bytes or DEFAULT_CORPUS_BYTES
    path = Path(text_path)
    if not path.exists():
        raise DataError(f"text path {str(path)!r} does not exist; pass a text file, a folder "
                        f"of text files, or 'default' for the built-in corpus")
    found = token_files_in(path)
    if found:
        raise DataError(f"text path {str(path)!r} holds {', '.join(found)}: token ids already "
                        f"(nanoGPT's layout); train on it with --data {path}, or pass the text")
    if path.is_dir() and path.resolve() == out_dir.resolve():
        raise DataError(f"OUT_DIR {str(out_dir)!r} is TEXT_PATH; write the tokens to a folder "
                        f"of their own")
    out = out_dir.resolve()
    files = [f for f in text_files_under(path) if out not in f.resolve().parents]
    return files, str(path), max_bytes or None


def _check_arguments(tokenizer, train_bpe, val_fraction, max_bytes, out_dir: Path,
                     overwrite: bool) -> None:
    if (tokenizer is None) == (train_bpe is None):
        got = "both" if tokenizer is not None else "neither"
        raise DataError(f"give exactly one of --tokenizer FILE (a Hugging Face tokenizer.json, "
                        f"as beside a downloaded model) or --train-bpe N (train a byte-level "
                        f"BPE of N tokens on the text, offline); got {got}")
    if tokenizer is not None and Path(tokenizer).is_dir():
        inside = Path(tokenizer) / "tokenizer.json"
        raise DataError(f"--tokenizer {tokenizer} is a folder; pass " +
                        (f"the file in it: --tokenizer {inside}" if inside.is_file() else
                         "a tokenizer.json file (this folder holds none)"))
    if train_bpe is not None and (isinstance(train_bpe, bool) or not isinstance(train_bpe, int)
                                  or train_bpe < MIN_BPE):
        raise DataError(f"--train-bpe {train_bpe!r}: a byte-level BPE needs at least {MIN_BPE} "
                        f"tokens (256 bytes and {END_OF_TEXT}); try 4096")
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction!r} must lie strictly between 0 and 1 "
                        f"(e.g. 0.1): training needs both a train.bin and a val.bin")
    if max_bytes is not None and max_bytes < 0:
        raise DataError(f"--max-bytes {max_bytes!r} must be >= 0 (0: all of the text)")
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"OUT_DIR {str(out_dir)!r} is a file; pass a folder (it is created)")
    if (out_dir / "train.bin").exists() and not overwrite:
        raise DataError(f"{out_dir / 'train.bin'} exists; pass --overwrite true to replace the "
                        f"prepared data, or choose another OUT_DIR")


def prepare(text_path, out_dir, tokenizer=None, train_bpe=None, val_fraction=0.1,
            max_bytes=None, progress=True, overwrite=False) -> dict:
    """Tokenize text into ``out_dir/train.bin``, ``val.bin``, ``meta.json``, ``tokenizer.json``.

    Args:
        text_path: a text file, a folder of text files, or ``"default"`` (the
            standard library's sources, :data:`~mpishard.data.corpus.DEFAULT_CORPUS_BYTES`
            of them unless ``max_bytes`` says otherwise).
        out_dir: the folder to write (created if missing).
        tokenizer: a ``tokenizer.json`` to encode with (copied to ``out_dir``).
        train_bpe: instead, train a byte-level BPE of this many tokens on the
            training part of the text.
        val_fraction: the last part of the text's bytes kept for validation.
        max_bytes: read at most this many bytes (the command line also takes
            ``1KB``, ``64MiB``: :func:`~mpishard.core.parse.parse_bytes`); ``None`` or
            0: all.
        progress: a progress bar (tqdm when installed, else lines on stderr).
        overwrite: replace an ``out_dir`` that already holds ``train.bin``.

    Returns:
        ``{"source", "out_dir", "bytes", "train_tokens", "val_tokens",
        "vocab_size", "dtype", "tokenizer", "files", "notes"}``; ``dtype`` is uint16
        when every id fits (vocabulary <= 65536), else uint32; ``notes``: lines for
        the user, e.g. that a trained BPE came out smaller than ``train_bpe``.

    Raises:
        DataError: both or neither of ``tokenizer``/``train_bpe``, a ``tokenizer``
            that is a folder, a BPE size
            below 257, a ``val_fraction`` outside (0, 1), a missing or empty
            text path, text that is already token ids, an ``out_dir`` holding
            ``train.bin`` (without ``overwrite``), a file that is not a tokenizer,
            ``tokenizers`` not installed, or too little text for both splits.
            Nothing is written then (temporary files are removed).
    """
    out_dir = Path(out_dir)
    _check_arguments(tokenizer, train_bpe, val_fraction, max_bytes, out_dir, overwrite)
    files, source, limit = _sources(text_path, out_dir, max_bytes)
    available = sum(f.stat().st_size for f in files)
    total = min(available, limit) if limit else available
    n_val = int(total * val_fraction)
    if total - n_val < 2 or n_val < 2:
        raise DataError(f"the text at {source!r} has {total} bytes ({len(files)} files): too "
                        f"little for a training and a validation part; use more text")
    split = total - n_val
    given = Tokenizer.from_file(tokenizer) if tokenizer is not None else None
    tokenizers_module()   # refuse before writing when tokenizers is missing
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    notes = []
    tmp = {name: out_dir / f"{name}.tmp" for name in OUTPUTS}
    try:
        if given is None:
            bar = _Progress(split, "train bpe", progress)
            train_text = (t for t, is_val in _text(_pieces(files, split, split), bar))
            given = train_bpe_tokenizer(train_text, train_bpe)
            bar.close()
            if given.vocab_size < train_bpe:
                notes.append(f"the BPE came out at {given.vocab_size} tokens of the "
                             f"{train_bpe} asked: by then every word of the training text "
                             f"is one token, and merges never join words; more (or more "
                             f"varied) text gives more")
            given.inner.save(str(tmp["tokenizer.json"]))
            described = f"byte-level BPE of {given.vocab_size} tokens trained on {source}"
        else:
            shutil.copyfile(tokenizer, tmp["tokenizer.json"])
            described = str(tokenizer)
        dtype = dtype_for_vocab(given.vocab_size)
        counts = _encode_all(given, _pieces(files, total, split), tmp, dtype,
                             _Progress(total, "tokenize", progress))
        if min(counts) < 2:
            raise DataError(f"the text at {source!r} gave {counts[0]} training and {counts[1]} "
                            f"validation tokens: too few for one block; use more text")
        meta = {"format": "mpishard-tokens", "dtype": dtype, "vocab_size": given.vocab_size,
                "tokenizer": "tokenizer.json", "tokenizer_source": described,
                "source": source, "bytes": total, "train_tokens": counts[0],
                "val_tokens": counts[1], "val_fraction": val_fraction}
        tmp["meta.json"].write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        (out_dir / "train.bin").unlink(missing_ok=True)   # never old train.bin, new rest
        for name in OUTPUTS:
            os.replace(tmp[name], out_dir / name)
    except BaseException:
        for path in tmp.values():
            path.unlink(missing_ok=True)
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise
    return {"source": source, "out_dir": str(out_dir), "bytes": total,
            "train_tokens": counts[0], "val_tokens": counts[1], "vocab_size": given.vocab_size,
            "dtype": dtype, "tokenizer": described,
            "files": [str(out_dir / name) for name in reversed(OUTPUTS)], "notes": notes}


def _encode_all(tok: Tokenizer, pieces, tmp: dict, dtype: str, bar: _Progress) -> list:
    """Encode pieces a batch at a time into train.bin.tmp / val.bin.tmp; token counts."""
    counts, little = [0, 0], np.dtype(dtype).newbyteorder("<")
    with open(tmp["train.bin"], "wb") as train, open(tmp["val.bin"], "wb") as val:
        batch, size, batch_val = [], 0, False

        def flush():
            for ids in tok.encode_batch(batch):
                (val if batch_val else train).write(ids.astype(little).tobytes())
                counts[batch_val] += ids.size
            batch.clear()

        for text, is_val in _text(pieces, bar):
            if batch and (is_val != batch_val or size >= BATCH_BYTES):
                flush()
                size = 0
            batch_val = is_val
            batch.append(text)
            size += len(text)
        if batch:
            flush()
    bar.close()
    return counts


def _add_arguments(parser) -> None:
    parser.add_argument("text_path", metavar="TEXT_PATH",
                        help="a text file, a folder of text files, or 'default' (the Python "
                             "standard library's sources)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write train.bin, "
                        "val.bin, meta.json and tokenizer.json to")
    parser.add_argument("--tokenizer", metavar="FILE", default=None,
                        help="a Hugging Face tokenizers file (tokenizer.json)")
    parser.add_argument("--train-bpe", metavar="N", type=int, default=None,
                        help="train a byte-level BPE of N tokens on the text instead")
    parser.add_argument("--val-fraction", type=float, default=0.1,
                        help="last part of the text kept for validation (default 0.1)")
    parser.add_argument("--max-bytes", type=parse_bytes, default=None, metavar="SIZE",
                        help="read at most this many bytes of text, e.g. 20000, 500KB, "
                             f"64MiB (default: all; {DEFAULT_CORPUS_BYTES} of 'default')")
    parser.add_argument("--progress", type=parse_bool, default=True, metavar="true|false")
    parser.add_argument("--overwrite", type=parse_bool, default=False, metavar="true|false",
                        help="replace an OUT_DIR that already holds train.bin")
    parser.set_defaults(func=_cmd_prepare)


def _cmd_prepare(args) -> int:
    ranks = next((int(os.environ[v]) for v in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")
                  if os.environ.get(v, "").isdigit()), 1)
    if ranks > 1:   # every rank would write the same files
        raise DataError(f"prepare runs as one process, not on {ranks} MPI ranks: run "
                        f"'mpishard prepare ...' without mpiexec")
    summary = prepare(args.text_path, args.out_dir, tokenizer=args.tokenizer,
                      train_bpe=args.train_bpe, val_fraction=args.val_fraction,
                      max_bytes=args.max_bytes, progress=args.progress,
                      overwrite=args.overwrite)
    print(f"wrote {summary['out_dir']}: {summary['train_tokens']} training and "
          f"{summary['val_tokens']} validation tokens ({summary['dtype']}, vocabulary "
          f"{summary['vocab_size']}) from {summary['bytes']} bytes of {summary['source']}")
    for note in summary["notes"]:
        print(f"note: {note}")
    print(f"train on it with: mpishard train --data {summary['out_dir']}")
    return 0


_DESCRIPTION = ("Tokenize text into a folder of token ids (train.bin, val.bin, meta.json, "
                "tokenizer.json: nanoGPT's layout) for 'mpishard train --data OUT_DIR'. Give "
                "exactly one of --tokenizer FILE or --train-bpe N.")


def add_prepare_command(subparsers) -> None:
    """Register ``mpishard prepare TEXT_PATH OUT_DIR`` on an argparse subparsers object."""
    parser = subparsers.add_parser("prepare", help="tokenize text into train.bin/val.bin "
                                   "(a tokenizer.json, or a BPE trained on the text)",
                                   description=_DESCRIPTION)
    _add_arguments(parser)


def main(argv=None) -> int:
    """``python -m mpishard.data.prepare TEXT_PATH OUT_DIR ...``; returns the exit status (2 on a
    refusal, printed as one line)."""
    parser = argparse.ArgumentParser(prog="python -m mpishard.data.prepare", allow_abbrev=False,
                                     description=_DESCRIPTION)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except DataError as err:
        print(f"mpishard prepare: error: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
