"""Running Forge under SLURM: rendering the sbatch script (`render`) and submitting, following and stopping
jobs with SLURM's client tools (`jobs`). docs/slurm.md describes the whole path."""
