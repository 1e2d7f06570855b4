"""The OpenAI-compatible server (`dsv41 serve`) and the main job (`dsv41 demo`).

    app.py                 the FastAPI app (routes, error handlers, API key, models, health, metrics) and an
                           in-thread launcher
    serving.py             what the generation endpoints share: request -> choices -> one job -> JSON body or
                           stream (server-sent events); a job: the engine requests of one HTTP request, and the
                           client watched while they run
    serving_chat.py        POST /v1/chat/completions: modes, tools, images, reasoning / tool-call output
    serving_completion.py  POST /v1/completions: batches, echo, legacy and prompt log-probabilities
    chat.py                chat templates: the official DeepSeek-V4.1 encoding and our simple one; effort, modes
    parsing.py             the answer split into reasoning, content and tool calls, chunk by chunk
    tools.py               tool definitions, DSML call blocks, tool results, the forced-call grammar
    grammar.py             grammar-constrained decoding (llguidance): response_format, forced calls
    images.py              image_url data URLs -> the prompt's image spans
    tokenize.py            vLLM's /tokenize, /detokenize, /tokenizer_info
    runner.py              the engine loop thread (the only code that touches the engine)
    validation.py          body, model name, prompt and context-length checks
    logprobs.py            log-probabilities in OpenAI's chat and legacy formats and vLLM's prompt_logprobs
    protocol.py            request models, OpenAI error shape, usage (prefix-cache aware)
    state.py               settings and what the handlers of one app share
    metrics.py             Prometheus metrics
    cli.py                 `dsv41 serve`, `dsv41 demo`
    demo.py                the demo itself
"""
