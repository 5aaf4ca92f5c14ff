"""The names of the files a run directory holds that more than one room reads (training writes them; `forge
runs`, checkpoint lookup, `forge slurm status` and the metric sinks read or append them). Torch-free."""

RUN_CONFIG = "config.toml"  # the resolved config: a resume and every reader of the run start from it
METRICS_FILE = "metrics.jsonl"  # one JSON object per logged step and per evaluation
EVALS_FILE = "evals.jsonl"  # one JSON object per `forge eval` of one of the run's checkpoints (engine/eval/record.py)
