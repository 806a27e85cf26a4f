"""Language models on text (every family whose spec's task is ``text``: ``--model gpt``,
``--model llama``, ...): bytes, or token files.

Text is read as bytes (256 symbols) unless ``--data`` names a folder of token
files (``train.bin``/``val.bin``, see docs/data.md). The model is built from the
``[model]`` section by its family's spec; a ``--preset`` fills it with a
published shape.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mpishard.data.corpus import VOCAB_SIZE, BatchSampler, DataError, load_corpus
from mpishard.core.errors import ConfigError
from mpishard.models import MODELS
from mpishard.data.tokens import is_token_dir, load_tokens, open_tokenizer, retokenize_hint
from mpishard.models.hf_mapping import CONFIG
from mpishard.recipes.base import Recipe, register_recipe

__all__ = ["TextLM"]


@register_recipe("text")
class TextLM(Recipe):
    """A causal language model trained on the bytes of a text file or folder, or on the
    token ids of a token folder."""

    can_sample = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.tokens_per_sample = cfg.model.block_size
        #: whether the data are token ids (a checkpoint records it; None: not known, as
        #: in a checkpoint from before it was recorded)
        self.token_data = None

    def model_config(self):
        """The model's own config dataclass from ``[model]`` (a ConfigError if it does not
        fit); the vocabulary is the data's until they are read."""
        m = self.cfg.model
        try:
            return MODELS[m.name].config_of(m, vocab_size=m.vocab_size or VOCAB_SIZE)
        except ValueError as err:     # n_embd not a multiple of n_head, ...
            raise ConfigError(str(err)) from None

    def model(self, backend):
        return MODELS[self.cfg.model.name].model_class(
            self.model_config(), seed=self.cfg.run.seed, dtype=self.cfg.model.dtype,
            backend=backend, materialize_now=False)

    def load_data(self) -> str:
        cfg = self.cfg
        self.token_data = is_token_dir(cfg.data.path)
        if self.token_data:
            return self._load_tokens()
        if cfg.data.dtype:
            where = cfg.data.path or "the built-in corpus"
            raise ConfigError(f"data_dtype = {cfg.data.dtype}: {where} is text, read as bytes; "
                              f"data_dtype is for a folder of token ids (train.bin, val.bin); "
                              f"leave it out")
        if cfg.model.vocab_size == 0:
            cfg.model.vocab_size = VOCAB_SIZE
        vocab, folder = cfg.model.vocab_size, cfg.run.init_from
        folder = folder if folder and (Path(folder) / CONFIG).is_file() else None
        if vocab < VOCAB_SIZE:
            raise ConfigError(
                f"the model in {folder} has a vocabulary of {vocab} ids, fewer than the "
                f"{VOCAB_SIZE} byte values text is read as; {retokenize_hint(folder)}"
                if folder else f"vocab_size = {vocab}: text is read as bytes "
                f"({VOCAB_SIZE} symbols); use vocab_size >= {VOCAB_SIZE}")
        # the ids are bytes: right for the model of a folder only if its tokenizer reads
        # bytes (docs/data.md: a smaller vocabulary than the model's is trained, with a note)
        padded = (f"; vocab_size {vocab} (the config.json of --init-from {folder}) pads the "
                  f"{VOCAB_SIZE} byte values of the text: right only if the model's own "
                  f"tokenizer made such ids (else {retokenize_hint(folder)})"
                  if folder and vocab > VOCAB_SIZE else "")
        corpus = load_corpus(cfg.data.path or None, cfg.data.max_bytes or None,
                             min_bytes=cfg.model.block_size + 1)
        self.train, self.val = corpus.train, corpus.val
        read = corpus.train.size + corpus.val.size
        cut = (f"; the first {read:,} of {corpus.available:,} bytes (max_bytes), raise "
               f"--max-bytes to read more" if corpus.truncated else "")
        return (f"{corpus.source}: {corpus.train.size:,} train / {corpus.val.size:,} val "
                f"bytes from {corpus.n_files} files{cut}{padded}")

    def _load_tokens(self) -> str:
        """A folder of token ids (train.bin, val.bin), memory-mapped; the vocabulary size
        comes from its meta.json unless [model] gives one (which must hold every id)."""
        cfg = self.cfg
        if cfg.data.max_bytes:
            raise ConfigError(f"max_bytes = {cfg.data.max_bytes}: {cfg.data.path} holds token "
                              f"ids, read in place without a cut; leave --max-bytes out")
        corpus = load_tokens(cfg.data.path, cfg.data.dtype or None,
                             cfg.model.vocab_size or None, min_tokens=cfg.model.block_size + 1,
                             model_folder=cfg.run.init_from or None)
        cfg.model.vocab_size = corpus.vocab_size
        self.train, self.val = corpus.train, corpus.val
        notes = "".join(f"; {note}" for note in corpus.notes)
        return (f"{corpus.source}: {corpus.train.size:,} train / {corpus.val.size:,} val "
                f"tokens ({corpus.dtype}, vocabulary {corpus.vocab_size:,}){notes}")

    def train_sampler(self, dp_rank: int, dp_size: int):
        c = self.cfg
        return BatchSampler(self.train, c.model.block_size, c.optim.batch_size, dp_rank,
                            dp_size, c.run.seed)

    def eval_batches(self, dp_rank: int, dp_size: int) -> list:
        c = self.cfg
        sampler = BatchSampler(self.val, c.model.block_size, c.optim.batch_size, dp_rank,
                               dp_size, seed=12345)
        return [self.step_batch(sampler) for _ in range(c.run.eval_batches)]

    def sample(self, module, prompt: str, n_tokens: int, seed: int, temperature: float = 0.8,
               top_k: int | None = 40) -> str:
        """Continue ``prompt`` by ``n_tokens`` tokens: bytes, or the ids of the data's
        tokenizer (the ``tokenizer.json`` or nanoGPT ``meta.pkl`` beside token data)."""
        tokenizer = self._tokenizer()
        idx = self._ids(prompt, tokenizer, "--prompt")
        out = module.generate(idx[None, :], n_tokens, temperature=temperature, top_k=top_k,
                              rng=np.random.default_rng(seed))
        if tokenizer is None:       # ids past the bytes (a wider vocabulary) as "?"
            ids = np.where(out[0] < VOCAB_SIZE, out[0], ord("?"))
            return bytes(ids.astype(np.uint8).tolist()).decode("utf-8", errors="replace")
        return tokenizer.decode(out[0])

    def prompt_ids(self, prompt: str, flag: str = "--prompt"):
        """``prompt`` as token ids (its bytes, or its tokenizer's ids); a ConfigError or
        DataError, naming ``flag``, for a prompt that gives none, or for a token folder
        without a tokenizer (``mpishard train`` asks before its first step)."""
        return self._ids(prompt, self._tokenizer(), flag)

    @staticmethod
    def _ids(prompt: str, tokenizer, flag: str):
        """:meth:`prompt_ids` with the tokenizer already opened (``None``: bytes)."""
        if tokenizer is None:
            idx = np.frombuffer(prompt.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        else:
            try:
                idx = tokenizer.encode(prompt)
            except DataError as err:         # a character the vocabulary lacks
                raise DataError(f"{flag}: {err}") from None
        if idx.size == 0:
            raise ConfigError(f"{flag} is empty (no tokens); give some text to continue")
        return idx

    def _tokenizer(self):
        """The tokenizer of token data (None for bytes): a tokenizer.json, or the characters
        of nanoGPT's meta.pkl (a DataError when the folder has neither, or when the token
        folder a model was trained on is gone: ids with no tokenizer to read them, which
        as bytes would print nonsense; where the checkpoint does not say, a vocabulary
        wider than bytes is taken for token ids)."""
        path, vocab = self.cfg.data.path, self.cfg.model.vocab_size
        if is_token_dir(path):
            return open_tokenizer(path)
        tokens = self.token_data if self.token_data is not None else vocab > VOCAB_SIZE
        if path and not Path(path).exists() and tokens:
            raise DataError(f"the data this model was trained on, {path}, is gone, and with "
                            f"it the tokenizer of its {vocab:,} token ids; put that folder "
                            f"(its tokenizer.json or meta.pkl) back there to sample")
        return None
