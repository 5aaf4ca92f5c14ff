"""The GPT-2 family's config (torch-free): it reads the shared `[model]` fields only (its norms are always
LayerNorm, its MLP is GELU and not gated, its heads all have their own keys and values, its positions are learned:
no RoPE, no QK-norm, no experts, no μP), so a field another family declares is refused with gpt2
(engine/model/rules.py: family_issues) and by the export. Registered with the family's spec in `__init__.py`."""

from __future__ import annotations

from engine.config.model import ModelFields


class GPT2Config(ModelFields):
    """GPT-2's MLP is 4 · dim wide when ffn_hidden_dim is unset (`ModelFields.default_ffn_dim`)."""
