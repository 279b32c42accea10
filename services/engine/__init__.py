"""Embedded CPU inference engine: OpenAI chat completions in vLLM's format, over any transformers causal LM.

    python -m services.engine --model DIR --port 8000      # without --model: the tiny default model

Gives the gateway what it asks vLLM for (prompt and response token ids, processed logprobs, streaming,
tool calls, weight reloads with versions) on a laptop CPU, so the whole loop runs without a GPU.

Modules, from the wire inwards:
    server       FastAPI app (`create_app`): routes, SSE, error bodies, /reload
    protocol     request/response Structs, validation into SamplingParams
    responses    response bodies from finished choices and deltas
    engine       tokenizer + swappable weights + scheduler; renders prompts, starts jobs, reloads
    scheduler    the generation thread: all requests interleaved token by token
    generation   the token loop over a KV cache (n choices batched)
    sampling     temperature/top-k/top-p sampling and the logprob definition
    output       per-choice detokenization, stop handling, tool-call hold-back
    background   run an app with uvicorn in a thread (tests, embedded stacks)
"""
