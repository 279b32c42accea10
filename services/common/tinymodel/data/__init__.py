"""Data files of the tiny model (the tokenizer corpus prose)."""
