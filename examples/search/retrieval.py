"""BM25 retrieval over the example's corpus with `bm25s`, and the bounded `search` tool.

The index is built once by the data builder (`build.py`) and saved with the corpus next to it;
the agent loads it at start (milliseconds for this corpus). The tool is bounded where the model's
input enters it: the query's length, the results per search, the characters per result and the
searches per episode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import bm25s

MAX_QUERY_CHARS = 200
TOP_K = 3
RESULT_CHARS = 300
MAX_SEARCHES = 4

TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the encyclopedia; returns the best matching articles.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


def build_index(docs: list[dict[str, str]], out: Path) -> None:
    """Index `docs` (`id`, `title`, `text`) with BM25 and save the index and the corpus under `out`."""
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([f"{d['title']}. {d['text']}" for d in docs], stopwords="en", show_progress=False),
                    show_progress=False)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    retriever.save(str(out))
    (out / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")


class Searcher:
    """The saved index and corpus, and the episode's search budget."""

    def __init__(self, index_dir: Path, max_searches: int = MAX_SEARCHES) -> None:
        self.retriever = bm25s.BM25.load(str(index_dir))
        self.docs = [json.loads(line) for line in (Path(index_dir) / "docs.jsonl").open(encoding="utf-8")]
        self.left = max_searches

    def search(self, query: str, k: int = TOP_K) -> list[dict[str, str]]:
        """The `k` best articles for `query` (fewer if the corpus is small)."""
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.vocab:
            return []
        found, _ = self.retriever.retrieve(tokens, k=min(k, len(self.docs)), show_progress=False)
        return [self.docs[int(i)] for i in found[0]]

    def run_tool(self, name: str, arguments: str) -> str:
        """The tool's reply to the model: numbered results, or `error: ...` (the budget is spent per call)."""
        query = json.loads(arguments)["query"]  # checked by `invalid_action` first
        if self.left <= 0:
            return "error: no searches left; answer now"
        self.left -= 1
        hits = self.search(query)
        if not hits:
            return "no results"
        return "\n".join(f"({i}) {d['title']}: {d['text'][:RESULT_CHARS]}" for i, d in enumerate(hits, 1))


def invalid_action(name: str, arguments: str) -> str | None:
    """What makes a tool call invalid (an unknown tool, arguments that are not `{"query": str}`), or None."""
    if name != "search":
        return f"unknown tool {name[:40]!r}"
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return "arguments are not JSON"
    if not isinstance(parsed, dict) or not isinstance(parsed.get("query"), str) or not parsed["query"].strip():
        return 'arguments must be {"query": "..."}'
    if len(parsed["query"]) > MAX_QUERY_CHARS:
        return f"query longer than {MAX_QUERY_CHARS} characters"
    return None
