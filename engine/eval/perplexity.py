"""Perplexity and bits per byte of a model over a data set, in rolling windows.

The tokens come from the same sources as `forge extract --data` (engine.interp.tokens: a `forge tokenize`
folder, text/JSONL/Parquet files, `hf:NAME`, `embedded:val`), documents joined the way training joins them;
the start token goes first so that the data's first token is predicted too. Windows of the model's context
(`max_seq_len` tokens fed) advance by `stride` tokens; each token is scored once, in the first window that
predicts it, so with a stride shorter than the context every token after the first window is predicted
from at least `max_seq_len - stride` tokens before it. stride = max_seq_len: disjoint windows, the harness's
rolling log-likelihood.

Bits per byte divide the summed negative log-likelihood (in bits) by the UTF-8 bytes of the scored text
(documents decoded whole; the end-of-text tokens count no bytes): a number that does not depend on the
tokenizer, unlike perplexity.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.data.tokenizer import Encoder
from engine.errors import UserError
from engine.eval.scoring import Request, score
from engine.eval.split import ALONE, WorkSplit
from engine.generate import prompt_ids
from engine.interp.tokens import TokenStream, open_tokens
from engine.model.spec import LanguageModel


@dataclass(frozen=True)
class Perplexity:
    data: str
    tokens: int  # scored tokens
    bytes: int  # UTF-8 bytes of the scored text
    windows: int
    stride: int
    nll: float  # summed negative log-likelihood, nats

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def bits_per_byte(self) -> float:
        return self.nll / math.log(2) / self.bytes

    @property
    def loss(self) -> float:
        """Mean negative log-likelihood per token (nats), as training's eval_loss reports it."""
        return self.nll / self.tokens


def windows(tokens: np.ndarray, max_len: int, stride: int) -> list[Request]:
    """(context, continuation) per window over `tokens` (the start token first): window k feeds tokens from
    k·stride on, at most max_len of them, and is scored on those it predicts that no earlier window did."""
    if not 1 <= stride <= max_len:
        raise UserError(f"--stride {stride} must be between 1 and the model's context ({max_len})")
    requests, scored_to = [], 1  # tokens[1:scored_to] are scored; tokens[0] is the start token
    begin = 0
    while scored_to < len(tokens):
        end = min(begin + max_len + 1, len(tokens))  # the window holds tokens[begin:end], feeds all but the last
        if end > scored_to:
            requests.append((tokens[begin:scored_to].tolist(), tokens[scored_to:end].tolist()))
            scored_to = end
        begin += stride
    return requests


def text_bytes(stream: TokenStream, encoder: Encoder) -> int:
    """UTF-8 bytes of the stream's text, decoded a document at a time so no character is split."""
    tokens = stream.read(0, len(stream))
    ends = np.flatnonzero(tokens == encoder.eos_id)
    pieces = np.split(tokens, ends + 1)
    docs = [piece[piece != encoder.eos_id].tolist() for piece in pieces]
    texts = encoder.tokenizer.decode_batch([d for d in docs if d], skip_special_tokens=True)
    return sum(len(text.encode("utf-8")) for text in texts)


def perplexity(
    model: LanguageModel,
    encoder: Encoder,
    data: str,
    stride: int | None = None,
    max_tokens: int | None = None,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
    split: WorkSplit = ALONE,
) -> Perplexity:
    """Perplexity and bits per byte of `model` on `data` (see the module docstring); `stride` defaults to the
    model's context (disjoint windows); `max_tokens` keeps the data's first tokens only. Under a `split` the
    processes share the windows' batches (engine.eval.scoring.score) and sum the same numbers in the same order."""
    max_len = model.cfg.max_seq_len
    stride = max_len if stride is None else stride
    stream = open_tokens(encoder, data, None, max_tokens)
    start = prompt_ids(encoder, "")[:1]
    tokens = np.concatenate([np.array(start, np.int64), stream.read(0, len(stream))])
    requests = windows(tokens, max_len, stride)
    nll = -sum(logprob for logprob, _ in score(model, requests, batch_size, progress, split))
    return Perplexity(data, len(stream), text_bytes(stream, encoder), len(requests), stride, nll)
