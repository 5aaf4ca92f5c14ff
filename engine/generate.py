"""Sampling text from a trained model on one device, with a KV cache.

`load_model` reads a Forge checkpoint (or a Hugging Face folder) and its tokenizer; `prompt_ids` encodes a
prompt the way training documents began; `generate` yields token ids one at a time so a caller can stream
them; `TextStream` turns the ids back into text piece by piece without ever splitting a UTF-8 character.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engine.checkpoint.dcp import UNREADABLE, describe, load_checkpoint
from engine.checkpoint.hf import is_hf_folder, load_hf_weights, read_hf_model_config
from engine.checkpoint.locate import TOKENIZER, ForgeCheckpoint, averaged, find_checkpoint, merged
from engine.checkpoint.manager import initialize_from
from engine.data.tokenizer import Encoder, adds_special_tokens
from engine.errors import UserError
from engine.model import build_model
from engine.model.spec import LanguageModel, spec_for


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def load_model(target: Path, device: torch.device, ema: bool = False) -> tuple[LanguageModel, Encoder]:
    """The model of a run directory / checkpoint folder / step_N (its newest complete checkpoint), or of a
    Hugging Face folder, in eval mode on `device`, with the tokenizer.json that goes with it. `ema`: with the
    EMA of the weights the run kept."""
    if is_hf_folder(target) and ema:
        raise UserError(f"{target} is a Hugging Face model folder: it holds no EMA", "leave out --ema")
    if is_hf_folder(target):
        cfg, tokenizer = read_hf_model_config(target), target / TOKENIZER
        load_weights = partial(load_hf_weights, hf_dir=target)
    else:
        ckpt = find_checkpoint(target, ema=ema)
        cfg, tokenizer = ckpt.model, ckpt.tokenizer
        load_weights = partial(load_forge_weights, ckpt=ckpt)
    if tokenizer is None or not tokenizer.is_file():  # checked before the (possibly large) weights are read
        raise UserError(
            f"{target} has no {TOKENIZER} to turn text into tokens and back",
            f"copy the tokenizer the model was trained with there as {TOKENIZER}",
        )
    encoder = Encoder.from_file(tokenizer)
    # Sampling runs in fp32: a kernel the run pinned for training (flash needs bf16/fp16) may not apply.
    with torch.device(device):
        model = build_model(cfg.model_copy(update={"sdpa_backend": "auto"}))
    try:
        load_weights(model)
    except UserError:
        raise
    except UNREADABLE as err:
        raise UserError(
            f"cannot load the weights of {target} ({describe(err)})",
            "its files are damaged, or config.toml no longer matches them",
        ) from None
    return model.eval(), encoder


def load_forge_weights(model: LanguageModel, ckpt: ForgeCheckpoint) -> None:
    """The checkpoint's weights, averaged for a schedule-free run (what its eval loss was measured on), or
    its EMA of them when asked for. A LoRA run's adapters are merged into their base weights (in fp32, also
    for a QLoRA run, whose base trained in NF4); an adapters-only checkpoint's base comes from the run's
    checkpoint.load_path."""
    if ckpt.lora is not None and ckpt.lora.save_adapters_only:
        if ckpt.base_path is None:
            raise UserError(
                f"{ckpt.path} holds only LoRA adapters, and its run trained them on a seed-initialised base",
                "sample from a run whose base came from checkpoint.load_path",
            )
        initialize_from(Path(ckpt.base_path), model, [])
    else:
        load_checkpoint(ckpt.path, model)
    weights = {name: param.data for name, param in model.named_parameters()}
    averaged(ckpt, weights)
    merged(ckpt, weights)


def prompt_ids(encoder: Encoder, text: str) -> list[int]:
    """The prompt as the start of a document: after the tokenizer's own start tokens if it adds any (e.g.
    a Llama BOS), else after the end-of-text token, which is what precedes every document in Forge's data.
    (`forge convert to-hf` gives the exported tokenizer that same start, engine.checkpoint.hf.export_tokenizer.)"""
    if adds_special_tokens(encoder.tokenizer):
        return encoder.tokenizer.encode(text, add_special_tokens=True).ids
    return [encoder.eos_id, *encoder.tokenizer.encode(text, add_special_tokens=False).ids]


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits. temperature 0 is greedy (argmax); otherwise the
    logits are divided by the temperature, cut to the `top_k` most likely tokens (0: no cut) and to the
    smallest set whose probability reaches `top_p` (1: no cut), and one token is drawn from what is left.
    `seed` makes the draws reproducible (None: a fresh random seed)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN passes `< 0`, and then every draw
            raise UserError(
                f"--temperature {self.temperature} is not a finite number >= 0",
                "use 0 for greedy decoding, or a value > 0",
            )
        if self.top_k < 0:
            raise UserError(f"--top-k {self.top_k} is negative", "use 0 to sample from every token")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p {self.top_p} must be in (0, 1]", "e.g. --top-p 0.9; 1 disables the cut")

    def generator(self, device: torch.device) -> torch.Generator:
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


@torch.no_grad()
def generate(
    model: LanguageModel,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` ids that continue `prompt`, stopping early after one of `stop_ids`.

    The prompt is run once to fill the cache; each further step feeds only the newest token. Pass a
    `generator` to continue one random stream across several calls (an interactive session), else one is
    made from `sampling.seed`.
    """
    check_lengths(model, len(prompt), max_new_tokens)
    device = spec_for(model.cfg).parts.embedding_of(model).weight.device
    generator = generator or sampling.generator(device)
    cache = model.new_kv_cache(batch=1, capacity=len(prompt) + max_new_tokens)
    tokens = torch.tensor([list(prompt)], device=device)
    for _ in range(max_new_tokens):
        logits = model(tokens, cache)[0, -1].float()
        token = next_token(logits, sampling, generator)
        yield token
        if token in stop_ids:
            return
        tokens = torch.tensor([[token]], device=device)


def check_lengths(model: LanguageModel, prompt_len: int, max_new_tokens: int) -> None:
    """The model has RoPE positions for max_seq_len tokens; prompt and continuation must fit in them."""
    limit = model.cfg.max_seq_len
    if prompt_len == 0:
        raise UserError("the prompt is empty", "pass at least one token")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    if prompt_len + max_new_tokens > limit:
        room = limit - prompt_len
        raise UserError(
            f"prompt ({prompt_len} tokens) + --max-new-tokens {max_new_tokens} exceed the model's "
            f"context of {limit} tokens (model.max_seq_len)",
            f"use --max-new-tokens {room} or less" if room > 0 else "shorten the prompt",
        )


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One id drawn from fp32 logits [vocab] according to `sampling`."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        logits = nucleus(logits, sampling.top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens until their probability reaches top_p (always at least one)."""
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    enough_before = probs.cumsum(dim=-1) - probs >= top_p  # the more likely tokens already reach top_p
    drop = torch.zeros_like(enough_before).scatter(0, order, enough_before)
    return logits.masked_fill(drop, float("-inf"))


class TextStream:
    """Incremental detokenization: feed ids, get the text they add once it is complete (a byte-level BPE
    token can end in the middle of a UTF-8 character; that text waits for the next token). The prompt is
    fed first, unprinted, so the first new piece decodes in context (e.g. its leading space)."""

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
        for token in prompt:
            self.stream.step(tokenizer, token)

    def add(self, token: int) -> str:
        return self.stream.step(self.tokenizer, token) or ""
