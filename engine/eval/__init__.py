"""Downstream evaluation: a Forge model as a language model of lm-evaluation-harness (`harness.py`), many
requests per forward (`scoring.py`), task lookup and results (`suite.py`), the tasks Forge ships built from
the embedded corpus (`corpus_tasks.py`, `tasks/*.yaml`), perplexity over a data set (`perplexity.py`) and
the run directory's record of results (`record.py`). The CLI is `forge eval` (forgecli/eval.py)."""
