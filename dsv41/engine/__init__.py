"""The inference engine: requests in, tokens out.

    engine.py       continuous batching: requests, prefill then batched decode steps, stops, streaming, prefix caching
    prefill.py      prefill modes full / ced-exact / ced-bounded, chunking, continuation, replay
    speculative/    speculative decoding with the DSpark drafter (propose, schedule, verify, roll back; T(n) profile)
    sampling.py     SamplingParams, greedy / temperature / top-k / top-p, per-request seeds
    store.py        the sequence pools the engine binds into the model (packed or dense) and their protocols
    tokenizer.py    the tokenizer protocol, a byte-level fallback and tokenizer.json tokenizers
    cli.py          the engine's command-line flags and the Engine they build (`generate`, `serve`, `demo`);
                    `dsv41 generate`, `dsv41 profile-step`, `dsv41 bench`
    bench.py        `dsv41 bench prefill|decode`
"""
