"""The CPU stand-ins: tiny models, tasks and warm starts that let every part of sao run on a 2-core machine
with no GPU and no network.

    arithmetic   the ``tiny`` preset's task ("What is 7+5?") and its warm-started 0.14M-parameter Qwen2
    calculator   the calculator agent's task ("What is 1234+5678?", a ``<calc>`` tool) and its own tiny model

Each model's weights ship beside its module, so every machine builds the same bytes. What these stand-ins can
and cannot say about a 1.5B model is said in docs/, not implied here.
"""
