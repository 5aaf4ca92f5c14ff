"""What the training loop reports: metric sinks (JSONL, TensorBoard, W&B), MFU, and memory use.

Import the submodules directly (`engine.metrics.trackers`, `.mfu`, `.memory`); this package imports nothing
so that `trackers` stays usable without torch.
"""
