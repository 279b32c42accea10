"""The search example: 2-hop data, BM25 retrieval, a user's own corpus, the EM rule, one real training step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from example_run import example_config, run_one_step

from examples.search.build import DataError, build
from examples.search.retrieval import MAX_SEARCHES, Searcher, invalid_action
from examples.search.reward import normalize, score
from trainer.clients import ServiceUrls


def test_generated_questions_need_two_articles_and_bm25_finds_both(tmp_path: Path) -> None:
    report = build(tmp_path, people=60, seed=1)
    assert report["tasks"] == 60 and report["docs"] > 60
    searcher = Searcher(tmp_path / "index", max_searches=10_000)
    for line in (tmp_path / "transcripts.jsonl").read_text().splitlines()[:20]:
        messages = json.loads(line)["messages"]
        results = [m["content"] for m in messages if m["role"] == "tool"]
        answer = messages[-1]["content"].removeprefix("<answer>").removesuffix("</answer>")
        assert len(results) == 2  # two hops
        assert answer not in results[0].split("(2)")[0]  # the first article alone does not hold it
        assert answer in results[1]  # the second search finds the article that does
    assert searcher.search("zzzz qqqq") == [] or len(searcher.search("zzzz qqqq")) <= 3


def test_search_budget_and_invalid_actions(tmp_path: Path) -> None:
    build(tmp_path, people=12, seed=0)
    searcher = Searcher(tmp_path / "index")
    for _ in range(MAX_SEARCHES):
        assert not searcher.run_tool("search", '{"query": "river"}').startswith("error")
    assert searcher.run_tool("search", '{"query": "river"}').startswith("error: no searches left")
    assert invalid_action("search", '{"query": "ok"}') is None
    assert invalid_action("lookup", '{"query": "ok"}') is not None
    assert invalid_action("search", "not json") is not None
    assert invalid_action("search", '{"q": "x"}') is not None
    assert invalid_action("search", json.dumps({"query": "x" * 500})) is not None


def test_a_users_jsonl_corpus_and_questions(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        json.dumps({"id": "1", "contents": '"Mount Kilimanjaro"\nKilimanjaro is in Tanzania.'}) + "\n"
        + json.dumps({"id": "2", "title": "Tanzania", "text": "The capital of Tanzania is Dodoma."}) + "\n"
    )  # fmt: skip
    questions = tmp_path / "q.jsonl"
    question = {"question": "Capital of the country of Kilimanjaro?", "golden_answers": ["Dodoma"]}
    questions.write_text(json.dumps(question))
    report = build(tmp_path / "out", corpus=corpus, questions_file=questions)
    assert report == {"tasks": 1, "docs": 2, "seconds": report["seconds"]}
    assert Searcher(tmp_path / "out" / "index").search("capital Tanzania")[0]["title"] == "Tanzania"
    (tmp_path / "bad.jsonl").write_text('{"question": "no answer"}\n')
    with pytest.raises(DataError, match="golden_answers"):
        build(tmp_path / "bad", corpus=corpus, questions_file=tmp_path / "bad.jsonl")


def test_exact_match_rule_by_hand() -> None:
    assert normalize("  The Vel-Ora  River! ") == "velora river"
    assert score("<answer>the Velora river</answer>", ["Velora River"]) == 1.0
    assert score("I think <answer>x</answer> no, <answer>Velora River.</answer>", ["Velora River"]) == 1.0
    assert score("<answer>Velora</answer>", ["Velora River"]) == 0.0  # exact, not contained
    assert score("Velora River", ["Velora River"]) == 0.0  # no <answer> tags: invalid
    assert score("<answer>Velora River</answer>", ["Velora River"], invalid="unknown tool") == 0.0
    assert score(None, ["Velora River"]) == 0.0


@pytest.mark.slow
def test_one_training_step_scores_every_rollout_by_the_rule(
    tmp_path: Path, example_model: Path, example_stack: ServiceUrls
) -> None:
    build(tmp_path / "data", people=16, seed=0)
    tasks = {json.loads(line)["question"]: json.loads(line) for line in (tmp_path / "data/tasks.jsonl").open()}
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "SEARCH_INDEX": str(tmp_path / "data/index")}
    config = example_config("search", tmp_path, tmp_path / "data/tasks.jsonl", example_model, agent={"env": env})
    record = run_one_step(config, example_stack)

    assert record.rows[0]["rollouts"] == 4 and record.rows[0]["rollouts_failed"] == 0
    evaluations = record.payloads("evaluation")
    rewards = record.rewards_by_rollout()
    assert len(rewards) == 4 and all(r.source == "evaluator" for r in record.rewards)
    for call in record.calls:
        assert [t["function"]["name"] for t in call.request["tools"]] == ["search"]
    for rollout_id, reward in rewards.items():
        first = next(c for c in record.calls if c.rollout_id == rollout_id)
        task = tasks[first.request["messages"][1]["content"]]
        result = evaluations[rollout_id]["result"]
        assert reward == score(result.get("answer"), task["golden_answers"], result.get("invalid"))
