"""A Forge model and its tokenizer as a language model of lm-evaluation-harness (`lm_eval`).

The harness turns each task into requests of three kinds; `ForgeLM` answers them on the native model:
  - loglikelihood (context, continuation): through `engine.eval.scoring`, many requests per forward;
  - loglikelihood_rolling (text): the harness's own disjoint windows over the text, scored the same way;
  - generate_until (context, generation arguments): greedy decoding with the KV cache (`engine.generate`).
Text becomes tokens exactly as the harness's Hugging Face model tokenizes for the model `forge convert to-hf`
exports: a text starts after the run's start token (the end-of-text token Forge puts before every document,
or the tokenizer's own BOS), a continuation's tokens are those the whole text has after the context's, and a
request longer than the model's context keeps its last tokens (cut from the left, as the harness does). So
the numbers equal the harness's on the export (tests/eval/test_eval.py compares them request by request).
"""

from __future__ import annotations

from collections.abc import Callable

from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from engine.data.tokenizer import Encoder
from engine.errors import UserError
from engine.eval.scoring import score
from engine.eval.split import ALONE, WorkSplit
from engine.generate import Sampling, generate, prompt_ids
from engine.model.spec import LanguageModel

DEFAULT_MAX_GEN_TOKS = 256  # what the harness's models generate when a task does not say


class ForgeLM(TemplateLM):
    """`model` (in eval mode, on its device) with `encoder`; `batch_size` rows per forward (see scoring.score).
    `progress(n)` is told each time n more requests are answered.

    Several processes (`split`): the harness runs in each as if alone (its own rank 0 of 1: every process builds
    every request and computes every metric), and the model's work is what they share (engine.eval.split):
    each answers its share of the forwards and generations and gathers the others'. So the results are one
    process's, where the harness's own data parallelism would give each rank other few-shot examples (it
    draws them in document order from one random stream) and change the order its stderr resamples."""

    def __init__(
        self,
        model: LanguageModel,
        encoder: Encoder,
        batch_size: int = 8,
        progress: Callable[[int], None] | None = None,
        split: WorkSplit = ALONE,
    ) -> None:
        super().__init__()
        self.model, self.encoder, self.batch_size = model, encoder, batch_size
        self.progress, self.split = progress, split
        self.start = prompt_ids(encoder, "")  # what every text starts with: the end-of-text token or a BOS

    @property
    def eot_token_id(self) -> int:
        return self.encoder.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context stands for, and before a rolling text's first window: the start token."""
        return self.start[0]

    @property
    def max_length(self) -> int:
        return self.model.cfg.max_seq_len

    @property
    def tokenizer_name(self) -> str:
        return f"forge-{self.encoder.sha256[:16]}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As the exported tokenizer encodes: after the start token(s) unless `add_special_tokens` is False."""
        if add_special_tokens is False:
            return self.encoder.tokenizer.encode(string, add_special_tokens=False).ids
        return prompt_ids(self.encoder, string)

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """The harness's tokenizing of the requests without its progress bar, which it draws whatever
        TQDM_DISABLE says (it passes `disable` itself): the caller's `progress` reports the scoring."""
        return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        return score(self.model, pairs, self.batch_size, self.progress, self.split)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over the harness's disjoint windows of the model's context, all windows of
        all texts scored together."""
        windows, owner = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            tokens = self.tok_encode(text)
            for window in get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1):
                windows.append(make_disjoint_window(window))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, score(self.model, windows, self.batch_size, split=self.split)):
            totals[index] += logprob
        if self.progress is not None:
            self.progress(len(requests))
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, each stopped at the end-of-text token, at the first of the task's stop strings
        (and cut there), or after max_gen_toks. The context keeps its last max_length - max_gen_toks tokens."""
        eos_text = self.encoder.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        asks = [self.generation(context, gen_kwargs, eos_text) for context, gen_kwargs in (r.args for r in requests)]
        out = {}
        for index in self.split.mine(len(asks)):  # every request was checked above, on every process
            out[index] = self.continuation(*asks[index])
            if self.progress is not None:
                self.progress(1)
        out = self.split.gather(out)
        return [out[index] for index in range(len(asks))]

    def generation(self, context: str, gen_kwargs: dict, eos_text: str) -> tuple[list[int], int, list[str]]:
        """(prompt ids, tokens to generate at most, stop strings) of one request; a request Forge cannot answer
        as asked is a UserError."""
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
        if kwargs.get("do_sample"):
            raise UserError(
                "a task asks for sampled generations (do_sample: true); forge eval decodes greedily",
                "set do_sample: false in the task's generation_kwargs",
            )
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
        max_new = kwargs.pop("max_gen_toks")
        room = self.max_length - max_new
        if room < 1:
            raise UserError(
                f"a task asks for {max_new} generated tokens, as many as the model's whole context "
                f"({self.max_length} tokens)",
                "lower max_gen_toks in the task's generation_kwargs",
            )
        return self.tok_encode(context)[-room:], max_new, until

    def continuation(self, prompt: list[int], max_new: int, until: list[str]) -> str:
        tokenizer, made = self.encoder.tokenizer, []
        for token in generate(self.model, prompt, max_new, Sampling(temperature=0), stop_ids=[self.eot_token_id]):
            made.append(token)
            if any(stop and stop in tokenizer.decode(made) for stop in until):
                break
        return postprocess_generated_text(tokenizer.decode(made), until, None)
