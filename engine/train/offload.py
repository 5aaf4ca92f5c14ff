"""Activation offload (`train.activation_offload`): what autograd saves for backward waits in host memory.

torch.autograd.graph.save_on_cpu is a pair of saved-tensor hooks: each tensor autograd saves in forward is
copied to the host as it is saved, and copied back to its device when backward needs it. The values come
back bit for bit, so the gradients are those of a run without it. With activation checkpointing the
checkpoints (each block's inputs) move too; the recomputation in backward saves through the checkpoint's own
hooks and stays on the device, one block at a time. On CUDA the host copies are pinned, so they overlap compute.
"""

from __future__ import annotations

import contextlib

import torch

from engine.config.job import JobConfig
from engine.errors import ConfigIssue


def activation_offload(cfg: JobConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """Around a micro-batch's forward and loss: the offload hooks when the config asks for them."""
    if not cfg.train.activation_offload:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


def offload_device_warnings(cfg: JobConfig, device: torch.device) -> list[ConfigIssue]:
    """On a CPU the activations are in host memory already: offloading runs (the tests check it there) and
    only costs a copy of each saved tensor, which the user should hear before waiting on it. So for
    `distributed.cpu_offload`: the weights are there already too."""
    if device.type != "cpu":
        return []
    warnings = []
    if cfg.distributed.cpu_offload:
        warnings.append(
            ConfigIssue(
                "distributed.cpu_offload",
                "on a CPU device the weights and optimizer state are in host memory already: it only wraps the "
                "model in FSDP2 on one process",
                "leave it off on a CPU; it saves device memory on a GPU",
            )
        )
    if cfg.train.activation_offload:
        warnings.append(
            ConfigIssue(
                "train.activation_offload",
                "on a CPU device the activations are in host memory already: offloading only adds a copy of each",
                "leave it off on a CPU; it saves device memory on a GPU",
            )
        )
    return warnings
