"""`forge scale`: isoFLOP plans, their runs, scaling-law fits and predictions (docs/scaling.md)."""
