"""``es-dllm-conf``: ES-dLLM ranking the positions at its skip layers by their last confidence alone.

``alpha = 1`` in ES-dLLM's importance score (zhuzj19/ES-dLLM ``early_skipping.py get_importance_score``;
``eval.py --alpha``): score = confidence, +2 to the two highest, +5 at the leftmost masked position;
the hidden-state variation and the +3 of the previous step's commits drop out (the official code adds
the latter only when alpha < 1). Everything else is ``es-dllm``'s (``cache/es_dllm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .es_dllm import ESDLLM


@dataclass
class ESDLLMConfidence(ESDLLM):
    """ES-dLLM with alpha = 1; see the module docstring."""

    alpha: float = 1.0
    name = "es-dllm-conf"
