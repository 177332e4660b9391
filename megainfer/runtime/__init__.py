"""The distributed runtime (docs/architecture.md, "Runtime rooms"). Its entry is
``megainfer.runtime.startup`` (``build_rank`` / ``run_rank``); the rooms are ``pipeline``,
``replicas``, ``tp``, ``eplb`` (the base path) and the features ``pd`` and ``replan``, which
plug in at ``startup.FEATURES``. Nothing is imported here: importing one room never imports
the others."""
