"""Distributed checkpoints (torch.distributed.checkpoint) in the run directory."""
