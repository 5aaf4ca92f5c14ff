"""The training loop's one extension point: `Callback` (base.py), and the callbacks the loop is built from,
one per module. Callbacks owned by another room live there (the metric sinks' in engine/metrics/callback.py,
the config hooks' in engine/train/hooks.py, the CLI's dashboard in forgecli/dashboard.py)."""

from engine.train.callbacks.base import Callback, CallbackFailed

__all__ = ["Callback", "CallbackFailed"]
