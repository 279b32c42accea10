"""An OpenAI Agents SDK agent with its default settings: the Responses API, one function tool.

Nothing is configured in code: the SDK's default provider reads OPENAI_BASE_URL and
OPENAI_API_KEY, which the controller sets to this attempt's proxy and token, and the default
model name is mapped by the proxy to the run's registered model. The controller also sets
OPENAI_AGENTS_DISABLE_TRACING=1 (the SDK otherwise uploads traces to OpenAI with the attempt token).

    RunSpec(run_id="r1", command=["python", "examples/agents/agents_sdk_agent.py"])
"""

from __future__ import annotations

from agents import Agent, Runner, function_tool

from services import agentkit


@function_tool
def look_up(x: int) -> str:
    """Look up the value of x."""
    return f"x is {x}"


def main() -> None:
    """Run the agent on the rollout's question; report 1.0 when it used the tool and answered."""
    task = agentkit.read_input()
    agent = Agent(name="solver", instructions="Use the look_up tool, then answer.", tools=[look_up])
    result = Runner.run_sync(agent, str(task.get("question", "what is x?")))
    answer = str(result.final_output)
    print(f"answer={answer!r}")
    agentkit.emit("answer", {"text": answer})
    agentkit.report_reward(1.0 if answer else 0.0)


if __name__ == "__main__":
    main()
