"""The training loop's micro-batches on the training device, fetched one ahead of their use.

`prefetch()`, which the step calls just before the host waits for the device (engine/train/step.py; not on
the run's last step, so that no window is read past the run's end), takes the next micro-batch from the loader
and starts its copy to the device: the loader's work and, on a GPU, the
host-to-device copy then run while the device still computes the step, not after it. Within a step the next
micro-batch is taken when the current one is handed out, after the previous one's work was queued.

On a CUDA device the batch is pinned (unless the loader pinned it already, data.pin_memory) and copied with
non_blocking on a side stream; before the compute stream uses it, it waits for that stream (a device-side
wait, not the host), and `record_stream` keeps the caching allocator from handing the copy's memory to the
side stream again while compute may still read it. Elsewhere the batch is used where it is (the CPU's batches
are already in place): only the fetch moves ahead, and the order of the batches is the loader's either way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

Batch = Sequence[torch.Tensor]


class DeviceBatches:
    """An iterator over `batches` (tuples of tensors: inputs, labels, and a mixture's sources) on `device`."""

    def __init__(self, batches: Iterator[Batch], device: torch.device) -> None:
        self.batches, self.device = batches, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ahead: tuple[torch.Tensor, ...] | None = None

    def __iter__(self) -> DeviceBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, ...]:
        batch = self.ahead if self.ahead is not None else self.moved(next(self.batches))
        self.ahead = None
        if self.stream is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.stream)
            for tensor in batch:
                tensor.record_stream(compute)
        return batch

    def prefetch(self) -> None:
        """Take the next micro-batch now and start moving it (nothing when one is already ahead or the loader
        is done: the next `next()` then raises StopIteration as the loader would)."""
        if self.ahead is None:
            try:
                self.ahead = self.moved(next(self.batches))
            except StopIteration:
                self.ahead = None

    def moved(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if self.stream is None:
            return tuple(batch)
        with torch.cuda.stream(self.stream):
            pinned = (t if t.is_pinned() else t.pin_memory() for t in batch)
            return tuple(t.to(self.device, non_blocking=True) for t in pinned)
