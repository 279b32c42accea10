"""The tiny default model: a ~1M-parameter Qwen2 causal LM with its byte-level BPE tokenizer, built offline.

    python -m services.common.tinymodel --out DIR [--seed 0]     # build it into DIR

Shared by whatever needs a model without a download: the devstack (`rollwire up` serves it with vLLM),
the trainer (the quickstart's warm start), tests, benchmarks and examples.

Modules:
    build          the model and its tokenizer (`build_tiny_model`, `ensure_tiny_model`, the cache)
    tokenizer      faithful tokenizer loading (`load_tokenizer`)
    corpus         the text the tokenizer is trained on (`data/prose.txt` plus templates)
    chat_template  the model's ChatML chat template with Hermes-style tools
"""
