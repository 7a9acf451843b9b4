"""ecache: fast approximate KV caching for diffusion language models (LLaDA, Dream).

The engine core is split one way: models compute (``ecache_cli.models``), the KV store stores
(``ecache_cli.kvstore``), cache policies decide (``ecache_cli.cache``) and the engine loops
(``ecache_cli.engine``); what they share is in ``ecache_cli.contract``. See ``docs/ARCHITECTURE.md``.
"""

__version__ = "0.2.0"
