"""The decoding core: canvas and deltas, the step loop, the shared sampler, selection rules, the strategy
and cache base classes, the model--cache protocol and the registries. It imports no concrete strategy,
cache, model family or application code (``tests/test_boundaries.py`` checks it)."""
