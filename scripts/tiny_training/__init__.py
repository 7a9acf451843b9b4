"""Training of the embedded default model (``ecache_cli/data/tiny``), split by concern.

- :mod:`.config`: ``TrainConfig`` (every setting of a run) and loading a saved run's settings;
- :mod:`.data`: tokenizer helpers, arithmetic drills, the deterministic stream of batches and the
  masking of one batch (``make_batch``);
- :mod:`.evaluate`: held-out greedy accuracy, arithmetic-fact accuracy and the curriculum's domain
  weights;
- :mod:`.loop`: model, learning-rate schedule, loss, the training loop and the one-file training state;
- :mod:`.export`: writing a model directory in the official LLaDA format.

``scripts/train_tiny.py`` is the command line. The objective is LLaDA's SFT loss (Nie et al. 2025,
"Large Language Diffusion Models", eq. 5); the model card (``ecache_cli/data/tiny/README.md``) gives
the recipe of the shipped model, what a run costs and how it was arrived at.
"""
