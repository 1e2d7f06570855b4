"""The OpenAI-compatible server (`dsv41 serve`) and the main job (`dsv41 demo`).

    app.py                 the FastAPI app (routes, error handlers, models, health, metrics) and an in-thread launcher
    serving.py             POST /v1/chat/completions and /v1/completions: request -> choices -> one job -> JSON
                           body or stream (server-sent events); a job: the engine requests of one HTTP request,
                           and the client watched while they run
    runner.py              the engine loop thread (the only code that touches the engine)
    validation.py          body, model name, prompt and context-length checks
    logprobs.py            log-probabilities in OpenAI's chat and legacy formats
    protocol.py            request models, OpenAI error shape, usage (prefix-cache aware)
    chat.py                chat templates: the official DeepSeek-V4.1 encoding and our simple one; reasoning effort
    state.py               settings and what the handlers of one app share
    metrics.py             Prometheus metrics
    cli.py                 `dsv41 serve`, `dsv41 demo`
    demo.py                the demo itself
"""
