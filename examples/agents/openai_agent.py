"""A real agent: one question to the model through the OpenAI client, then a reward.

The controller runs it with OPENAI_BASE_URL and OPENAI_API_KEY pointing at this attempt's proxy,
so the plain `openai` client needs no configuration; the input is {"question": ..., "answer": ...}.

    RunSpec(run_id="r1", command=["python", "examples/agents/openai_agent.py"])
"""

from __future__ import annotations

import os

from openai import OpenAI

from services import agentkit


def main() -> None:
    """Ask the question, record the answer as a custom event, report 1.0 if it contains the answer."""
    task = agentkit.read_input()
    client = OpenAI(max_retries=2, timeout=60)
    reply = client.chat.completions.create(
        model=os.environ.get("ROLLWIRE_MODEL", "default"),
        messages=[
            {"role": "system", "content": "Answer with a number only."},
            {"role": "user", "content": str(task["question"])},
        ],
        max_tokens=16,
    )
    text = reply.choices[0].message.content or ""
    print(f"question={task['question']!r} reply={text!r}")
    agentkit.emit("answer", {"text": text})
    with open("answer.txt", "w", encoding="utf-8") as handle:  # for an evaluator, if the run has one
        handle.write(text)
    if os.environ.get("ROLLWIRE_AGENT_REPORTS", "1") == "1":
        agentkit.report_reward(1.0 if str(task.get("answer", "")) in text else 0.0)


if __name__ == "__main__":
    main()
