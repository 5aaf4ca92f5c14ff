"""Downstream evaluation: a Forge model as a language model of lm-evaluation-harness (`harness.py`), many
requests per forward (`scoring.py`), the work shared by several processes (`split.py`), task lookup and
results (`suite.py`), the tasks Forge ships built from the embedded corpus (`corpus_tasks.py`, `tasks/*.yaml`),
perplexity over a data set (`perplexity.py`), the run directory's record of results (`record.py`), and tasks
during training (`in_training.py`, with its torch-free config rules in `rules.py`). The CLI is `forge eval`
(forgecli/eval.py)."""
