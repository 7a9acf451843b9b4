"""The model families, one module each (``models/registry.py`` finds them; docs/MODELS.md describes each)."""
