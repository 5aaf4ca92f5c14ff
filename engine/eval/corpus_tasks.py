"""The data of the tasks Forge ships (engine/eval/tasks/*.yaml), built from the embedded corpus at load time:
nothing to download, the same questions on every machine.

`forge_next_line`: four lines of a speech in a held-out play (Hamlet, The Tempest: works the debug preset never
trains on) and the first two words of the next line; four candidates for how that line goes on: its true rest
and the rests of three other lines of the same play of similar length. Chance is 25%; a model that has learnt
how speeches run on (syntax, metre, sense) does better.
"""

from __future__ import annotations

import bisect
import gzip
import json
import random

from engine.data.embedded import CORPUS, HELD_OUT

CONTEXT_LINES = 4  # lines of the speech shown before the one to finish
CUE_WORDS = 2  # the next line's first words, shown: the choices are how it goes on
CHOICES = 4
QUESTIONS = 500  # per play at most; --limit N takes the first N
SEED = 0


def held_out_plays() -> dict[str, list[str]]:
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        works = (json.loads(line) for line in f)
        return {w["title"]: w["text"].splitlines() for w in works if w["title"] in HELD_OUT}


def is_speech(line: str) -> bool:
    """A line someone says: not blank, not a speaker's name (ends in '.', no lowercase), not a stage direction."""
    text = line.strip()
    if len(text) < 12 or text.startswith("[") or text.isupper():
        return False
    return not (text.endswith(".") and len(text.split()) == 1)


def questions(lines: list[str], rng: random.Random) -> list[dict]:
    """Every line preceded by CONTEXT_LINES speech lines of the same speech (and long enough to split): its
    first CUE_WORDS words end the context; the rest of it and of three other such lines of similar length
    are the choices. The distractors come from the same kind of line as the answer (a line inside a speech),
    so a model that ignores the context has no reason to prefer either: it scores chance."""
    speech = [i for i, line in enumerate(lines) if is_speech(line)]
    inside = [
        i
        for i in speech
        if i >= CONTEXT_LINES
        and all(is_speech(line) for line in lines[i - CONTEXT_LINES : i])
        and len(lines[i].split()) > CUE_WORDS + 1
    ]
    rests = sorted({rest(lines[i]) for i in inside}, key=lambda text: (len(text), text))
    lengths = [len(text) for text in rests]
    found = []
    for i in inside:
        true = rest(lines[i])
        lo, hi = bisect.bisect_left(lengths, 0.75 * len(true)), bisect.bisect_right(lengths, 1.33 * len(true))
        similar = [text for text in rests[lo:hi] if text != true]
        if len(similar) < CHOICES - 1:
            continue
        choices = [true, *rng.sample(similar, CHOICES - 1)]
        rng.shuffle(choices)
        before = [line.strip() for line in lines[i - CONTEXT_LINES : i]]
        cue = " ".join(lines[i].split()[:CUE_WORDS])
        found.append({"context": "\n".join([*before, cue]), "choices": choices, "gold": choices.index(true)})
    return found


def rest(line: str) -> str:
    """A line without its first CUE_WORDS words."""
    return " ".join(line.split()[CUE_WORDS:])


def next_line(**kwargs):
    """The `forge_next_line` data set: a `test` split of QUESTIONS questions per held-out play, shuffled."""
    from datasets import Dataset, DatasetDict

    rng = random.Random(SEED)
    items = []
    for title, lines in sorted(held_out_plays().items()):
        found = questions(lines, rng)
        items += [{"play": title, **q} for q in rng.sample(found, min(QUESTIONS, len(found)))]
    rng.shuffle(items)
    return DatasetDict({"test": Dataset.from_list(items)})
