"""The OpenAI-compatible server (`dsv41 serve`) and the main job (`dsv41 demo`).

    protocol.py  request models, OpenAI error shape, usage (prefix-cache aware) and logprobs formats
    chat.py      chat templates: the official DeepSeek-V4.1 encoding and our simple one; reasoning effort
    runner.py    the engine loop thread (the only code that touches the engine)
    metrics.py   Prometheus metrics
    app.py       the FastAPI app and an in-thread uvicorn launcher
    cli.py       `dsv41 serve`, `dsv41 demo`
    demo.py      the demo itself
"""
