"""Continuous prompt mode: samples per rollout exact vs continuous, and the proxy's rendering cost per call.

    python bench/bench_continuity.py                 # 16 rollouts of the 6-turn harness, cost at 5/20/60 turns
    python bench/bench_continuity.py --rollouts 32 --turns 5 20 60 120

Part 1 runs the 6-turn Qwen3-style tool harness of `tests/services/gateway/test_continuity.py` (a real
gateway on an embedded nats-server, the official `openai` client, and the template-rendering fake
vLLM of `tests/services/gateway/template_vllm.py`, whose template drops earlier turns' reasoning and
re-serialises tool-call JSON) through one run per prompt mode, then merges each rollout's
recorded calls with the trainer's exact merge. Printed per mode: samples per rollout, the share
of rollouts that are one sample, and training tokens per rollout (the tokens of its samples: a
split rollout trains its shared prefix again in every sample).

Part 2 measures what continuous mode adds to a call on the gateway's CPU, in this process: the
chain lookup and the rendering of the new turns (`continuity.plan`), writing the token-in body,
and parsing the answer back (`tokenin.chat_answer`), for a conversation of N turns of ~500 tokens
each (the tiny model's tokenizer and chat template), for an extended call and for a fresh one.
Exact mode does none of this (the engine renders), so this is the added cost per call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "services" / "gateway"))
sys.path.insert(0, str(ROOT / "tests"))

from continuity_rig import recorded, scripted_engine, start, tool_loop  # noqa: E402
from gw_harness import GatewayHandle, Served, gateway_settings  # noqa: E402
from template_vllm import qwen3_style_dir  # noqa: E402

from services.common.tinymodel.build import build_tiny_model  # noqa: E402
from services.devstack.embedded import NatsServer  # noqa: E402
from services.gateway import create_app  # noqa: E402
from services.gateway.proxy.continuity import plan  # noqa: E402
from services.gateway.proxy.recording import RecordedCall  # noqa: E402
from services.gateway.proxy.render import ChatRenderer  # noqa: E402
from services.gateway.proxy.tokenin import chat_answer, completion_body  # noqa: E402
from trainer.core.merge import merge_calls  # noqa: E402
from trainer.core.recorded import call_from_event  # noqa: E402

_encode = msgspec.json.Encoder().encode


class _Factory:
    """`tmp_path_factory` for the rig's model builder outside pytest."""

    def __init__(self, root: Path) -> None:
        self.root, self.count = root, 0

    def mktemp(self, name: str) -> Path:
        self.count += 1
        path = self.root / f"{name}{self.count}"
        path.mkdir()
        return path


def harness_figures(root: Path, rollouts: int) -> None:
    """Part 1: the 6-turn harness in each prompt mode."""
    model_dir = qwen3_style_dir(build_tiny_model(root / "tiny", seed=0), root / "qwen3-style")
    nats = NatsServer(root / "nats").start()
    try:
        app = scripted_engine(model_dir)
        with Served(app) as engine:
            app.url = engine.url
            settings = gateway_settings(nats.url)
            with Served(create_app(settings), settings.port) as served:
                gateway = GatewayHandle(served, settings)
                header = f"{'mode':<11} {'rollouts':>8} {'samples/rollout':>16} {'one sample':>11}"
                print(f"{header} {'train tokens/rollout':>21}")
                for mode in ("exact", "continuous"):
                    counts, tokens = [], []
                    for i in range(rollouts):
                        rollout_id, client = start(gateway, f"bench-{mode}-{i}", mode, app, model_dir)
                        tool_loop(client)
                        calls = [call_from_event(c) for c in recorded(gateway, rollout_id)]
                        samples = merge_calls(calls, rollout_id=rollout_id, group_id=None).samples
                        counts.append(len(samples))
                        tokens.append(sum(len(s.tokens) for s in samples))
                    single = sum(c == 1 for c in counts) / len(counts)
                    print(f"{mode:<11} {rollouts:>8} {statistics.fmean(counts):>16.2f} {single:>10.0%} "
                          f"{statistics.fmean(tokens):>21.0f}")  # fmt: skip
                gateway.admin.close()
    finally:
        nats.stop()


def _conversation(turns: int, renderer: ChatRenderer) -> tuple[list[Any], list[RecordedCall]]:
    """A tool loop of `turns` turns (~500 tokens each) and the recorded call of its last-but-one turn."""
    words = " ".join(f"w{i % 97}" for i in range(700))
    messages: list[Any] = [{"role": "system", "content": "You add."}, {"role": "user", "content": "Go."}]
    for turn in range(turns - 1):
        call = {"id": f"c{turn}", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{turn}", "content": words}]  # fmt: skip
    earlier_messages = messages[:-2]
    reply = messages[-2]
    prompt = renderer.prompt_ids(earlier_messages, None, {})
    sampled = [*renderer.encode('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'), 2]
    tokens = np.asarray(prompt + sampled, dtype=np.int32)
    request = {"messages": earlier_messages}
    earlier = RecordedCall("e", 1, tokens, request, tokens.nbytes, len(prompt), reply)
    return messages, [earlier]


def render_cost(root: Path, turn_counts: list[int], repeat: int = 20) -> None:
    """Part 2: the gateway CPU continuous mode adds to one call."""
    renderer = ChatRenderer.from_dir(build_tiny_model(root / "tiny-cost", seed=0))
    answer = {"id": "cmpl-x", "choices": [{"index": 0, "text": "It is 2.", "token_ids": [5, 6, 7, 2],
              "prompt_token_ids": [], "finish_reason": "stop", "logprobs": {"tokens": ["a"] * 4,
              "token_logprobs": [-0.1] * 4}}]}  # fmt: skip
    print(f"\n{'turns':>5} {'prompt tokens':>14} {'extended, ms/call':>18} {'fresh, ms/call':>15}")
    for turns in turn_counts:
        messages, earlier = _conversation(turns, renderer)
        request = {"model": "m", "messages": messages, "max_tokens": 64}
        timings = {}
        for kind, calls in (("extended", earlier), ("fresh", [])):
            best = float("inf")
            for _ in range(repeat):
                began = time.process_time()
                planned = plan(renderer, request, calls)
                _encode(completion_body(request, msgspec.Raw(planned.prompt), "m"))
                chat_answer(answer, tools=True, reasoning=False)
                best = min(best, time.process_time() - began)
            timings[kind] = (best * 1000, planned.size, planned.continuity)
        assert timings["extended"][2] == "extended", timings
        print(f"{turns:>5} {timings['extended'][1]:>14,} {timings['extended'][0]:>18.2f} {timings['fresh'][0]:>15.2f}")


def main() -> None:
    """Run both parts."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--turns", type=int, nargs="+", default=[5, 20, 60])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-continuity-", dir="/tmp") as tmp:
        harness_figures(Path(tmp), args.rollouts)
        render_cost(Path(tmp), args.turns)


if __name__ == "__main__":
    main()
