"""Interpretability: activations and attention weights of chosen modules over whole data sets, streamed to
disk (`extract.py`, `store.py`), read back memory-mapped (`load_activations`), and representation similarity
between layers and models (`similarity.py`). See docs/interpretability.md."""

from engine.interp.store import Activations, LayerArray, load_activations

__all__ = ["Activations", "LayerArray", "load_activations"]
