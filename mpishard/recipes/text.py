"""The GPT on text read as bytes (``--model gpt``)."""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..data import VOCAB_SIZE, BatchSampler, load_corpus
from ..models import GPT, GPTConfig
from .base import Recipe, register_recipe

__all__ = ["TextGPT"]


@register_recipe("gpt")
class TextGPT(Recipe):
    """nanoGPT's GPT, trained on the bytes of a text file or folder."""

    can_sample = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.tokens_per_sample = cfg.model.block_size

    def model_config(self) -> GPTConfig:
        m = self.cfg.model
        try:
            return GPTConfig(vocab_size=m.vocab_size, block_size=m.block_size,
                             n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd,
                             dropout=m.dropout, bias=m.bias)
        except ValueError as err:     # n_embd not a multiple of n_head, ...
            raise ConfigError(str(err)) from None

    def model(self, backend):
        return GPT(self.model_config(), seed=self.cfg.run.seed, dtype=self.cfg.model.dtype,
                   backend=backend, materialize_now=False)

    def load_data(self) -> str:
        cfg = self.cfg
        if cfg.model.vocab_size < VOCAB_SIZE:
            raise ConfigError(f"vocab_size = {cfg.model.vocab_size}: text is read as bytes "
                              f"({VOCAB_SIZE} symbols); use vocab_size >= {VOCAB_SIZE}")
        corpus = load_corpus(cfg.data.path or None, cfg.data.max_bytes or None,
                             min_bytes=cfg.model.block_size + 1)
        self.train, self.val = corpus.train, corpus.val
        read = corpus.train.size + corpus.val.size
        cut = (f"; the first {read:,} of {corpus.available:,} bytes (max_bytes), raise "
               f"--max-bytes to read more" if corpus.truncated else "")
        return (f"{corpus.source}: {corpus.train.size:,} train / {corpus.val.size:,} val "
                f"bytes from {corpus.n_files} files{cut}")

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
        idx = np.frombuffer(prompt.encode("utf-8"), dtype=np.uint8).astype(np.int64)[None, :]
        out = module.generate(idx, n_tokens, temperature=temperature, top_k=top_k,
                              rng=np.random.default_rng(seed))
        return bytes(out[0].astype(np.uint8).tolist()).decode("utf-8", errors="replace")
