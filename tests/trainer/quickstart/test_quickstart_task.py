"""The quickstart task, its warm-start data, and the chat-template round trip that lets calls merge."""

from __future__ import annotations

import json
import random

from transformers import PreTrainedTokenizerFast

from services.common.toolcalls import parse_tool_calls
from trainer.quickstart.task import (
    KEYS,
    TOOLS,
    UNKNOWN_KEY,
    VALUES,
    Task,
    first_messages,
    make_tasks,
    question,
    reward,
    run_tool,
    transcript,
    write_tasks_jsonl,
)
from trainer.quickstart.warmstart import WarmStartConfig, encode_conversation, warm_transcripts


def render_ids(tokenizer: PreTrainedTokenizerFast, messages: list[dict], generation: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages,
        tools=TOOLS,  # type: ignore[arg-type]
        tokenize=False,
        add_generation_prompt=generation,
    )
    assert isinstance(text, str)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_tasks_tools_and_rewards() -> None:
    tasks = make_tasks(50, seed=7)
    assert tasks == make_tasks(50, seed=7) and tasks != make_tasks(50, seed=8)
    assert all(t.key in KEYS and t.value in VALUES for t in tasks)
    task = Task(task_id="t", key="river", value="garden")
    assert run_tool(task, "lookup", json.dumps({"key": "river"})) == "garden"
    assert run_tool(task, "lookup", json.dumps({"key": "road"})) == UNKNOWN_KEY
    assert run_tool(task, "search", "{}").startswith("error: no tool")
    assert run_tool(task, "lookup", "{not json").startswith("error")
    assert reward(task, " garden\n") == 1.0 and reward(task, "road") == 0.0 and reward(task, None) == 0.0
    assert "garden" not in json.dumps(first_messages(task))
    assert question(task) == 'What is the value of {"key": "river"}?'  # the value is only reachable through the tool
    lines = write_tasks_jsonl(tasks[:2]).decode().splitlines()
    assert json.loads(lines[0]) == {"task_id": tasks[0].task_id, "key": tasks[0].key, "value": tasks[0].value}


def test_keys_and_values_are_single_tokens_in_both_places(tokenizer: PreTrainedTokenizerFast) -> None:
    for word in KEYS + VALUES:
        assert len(tokenizer(f"\n{word}\n", add_special_tokens=False)["input_ids"]) == 3, word
        quoted = tokenizer(f'"{word}"', add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(quoted[1:2]) == word, word


def test_encoding_masks_exactly_the_assistant_turns(tokenizer: PreTrainedTokenizerFast) -> None:
    task = Task(task_id="t", key="lamp", value="report")
    messages = transcript(task, use_tool=True, guess="")
    ids, mask = encode_conversation(tokenizer, messages, TOOLS)
    assert ids == render_ids(tokenizer, messages, generation=False)  # piecewise encoding == whole encoding
    trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "lamp"}}\n</tool_call>'
    assert trained == f"{call}<|im_end|>report<|im_end|>"


def test_a_sampled_tool_call_round_trips_so_the_two_calls_merge(tokenizer: PreTrainedTokenizerFast) -> None:
    """What the engine parses from the sampled text, sent back by the harness, renders to the same tokens."""
    task = Task(task_id="t", key="ticket", value="weather")
    prompt1 = render_ids(tokenizer, first_messages(task), generation=True)
    full, mask = encode_conversation(tokenizer, transcript(task, use_tool=True, guess=""), TOOLS)
    first_turn_end = mask.index(0, len(prompt1))  # the sampled tool call, up to and with <|im_end|>
    response1 = full[len(prompt1) : first_turn_end]
    parsed = parse_tool_calls(str(tokenizer.decode(response1, skip_special_tokens=True)))
    (call,) = parsed.tool_calls
    harness_messages = [
        *first_messages(task),
        {
            "role": "assistant",
            "content": parsed.content,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": run_tool(task, call.function.name, call.function.arguments),
        },
    ]
    prompt2 = render_ids(tokenizer, harness_messages, generation=True)
    assert prompt2[: len(prompt1) + len(response1)] == prompt1 + response1


def test_warm_start_data_keeps_the_decision_at_the_tool_rate(tokenizer: PreTrainedTokenizerFast) -> None:
    config = WarmStartConfig(transcripts=200, skill_transcripts=50, tool_rate=0.2)
    data = warm_transcripts(tokenizer, config)
    assert data == warm_transcripts(tokenizer, config)  # seeded
    tool_call = tokenizer.convert_tokens_to_ids("<tool_call>")
    decisions = data[: config.transcripts]
    firsts = [ids[mask.index(1)] for ids, mask in decisions]
    rate = sum(t == tool_call for t in firsts) / len(firsts)
    assert abs(rate - 0.2) < 0.08
    for ids, mask in data[config.transcripts :]:  # skill data: tool transcripts, decision token not trained
        start = len(render_ids(tokenizer, first_messages(Task(task_id="x", key="book", value="note")), True))
        assert ids[start] == tool_call and mask[start] == 0 and sum(mask) > 20
    random.Random(0).shuffle(decisions)  # the data is plain lists, safe to shuffle by the trainer
