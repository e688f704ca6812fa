"""``sao serve``: an OpenAI-compatible chat-completions server that samples from the current adapter with sao's
own sampler, returns each drawn token's log-probability, appends every completion to a trace log with the
adapter version that wrote it, and swaps in each adapter the trainer publishes.

    tracelog   the JSONL trace log (whole lines, fsynced) and its bounded index of ids (no third-party imports)
    served     the policy at one adapter version, sampling, and the watcher of RUN/published/LATEST.json
    app        the FastAPI endpoints (needs ``pip install 'sao[serve]'``)
    server     uvicorn around the app, in the foreground or a thread
    client     a bounded client that sends tiny tasks with their answers (standard library only)

Nothing here imports fastapi or uvicorn at package import time.
"""
