"""SAO inside other RL frameworks: ``verl`` (a ``verl.plugins`` entry point), ``trl`` (``SAOConfig`` /
``SAOTrainer``) and ``skyrl`` (experimental), each a thin adapter over ``sao.algorithm`` (``shared`` holds what
they have in common). Importing this package imports no framework; each module imports its own on import.
Recipes and what each test proves: docs/integrations.md."""
