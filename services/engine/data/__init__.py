"""Data files shipped with the engine (the tokenizer corpus prose)."""
