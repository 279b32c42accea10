"""Embedded CPU inference engine (OpenAI-compatible, vLLM response format) and the tiny default model."""
