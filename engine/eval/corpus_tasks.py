"""The data of the tasks Forge ships (engine/eval/tasks/*.yaml), built from the embedded corpus at load time:
nothing to download, the same questions on every machine.

`forge_next_line`: a few lines of a held-out play (Hamlet, The Tempest: works the debug preset never trains
on), and four candidates for the line that follows: the true one and three other lines of the same play of
similar length. Chance is 25%; a model that has learnt how speeches run on (syntax, metre, sense) does better.
"""

from __future__ import annotations

import bisect
import gzip
import json
import random

from engine.data.embedded import CORPUS, HELD_OUT

CONTEXT_LINES = 4  # lines of the speech shown before the one to choose
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
    """Every line preceded by CONTEXT_LINES speech lines of the same speech, with three distractors."""
    speech = [i for i, line in enumerate(lines) if is_speech(line)]
    pool = sorted({lines[i].strip() for i in speech}, key=lambda line: (len(line), line))
    lengths = [len(line) for line in pool]
    found = []
    for i in speech:
        before = lines[i - CONTEXT_LINES : i]
        if len(before) < CONTEXT_LINES or not all(is_speech(line) for line in before):
            continue
        true = lines[i].strip()
        lo, hi = bisect.bisect_left(lengths, 0.75 * len(true)), bisect.bisect_right(lengths, 1.33 * len(true))
        similar = [line for line in pool[lo:hi] if line != true]
        if len(similar) < CHOICES - 1:
            continue
        choices = [true, *rng.sample(similar, CHOICES - 1)]
        rng.shuffle(choices)
        found.append(
            {"context": "\n".join(line.strip() for line in before), "choices": choices, "gold": choices.index(true)}
        )
    return found


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
