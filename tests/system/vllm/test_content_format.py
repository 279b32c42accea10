"""Continuous prompt mode renders a message's text parts as vLLM's chat endpoint does.

vLLM hands a template that loops over a message's content the list of parts, and any other
template one string, the parts joined with "\\n" (`services.gateway.proxy.content_format` repeats its
detection). Both kinds of template are checked: the tiny model's own (it loops over parts) and a
Qwen3-style one (it writes `message.content` as a string), sent to vLLM as the request's
`chat_template`. Before, the gateway always joined the parts with "", which is what vLLM renders
for the first kind only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from gw_harness import GatewayHandle
from template_vllm import QWEN3_STYLE, qwen3_style_dir
from vllm_rig import SERVED, recorded, start_run
from vllm_server import VllmServer

from services.gateway.proxy.render import ChatRenderer

# No digits: transformers (and so vLLM) loads the tiny model's tokenizer as `Qwen2Tokenizer`, which
# splits digits one by one, while its tokenizer.json (what the gateway reads) does not.
MESSAGES: Any = [
    {"role": "system", "content": "You add."},
    {"role": "user", "content": [{"type": "text", "text": "Add one"}, {"type": "text", "text": "and two."}]},
]


@pytest.fixture(scope="module")
def qwen3_dir(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served model's tokenizer with a Qwen3-style template (content written as a string)."""
    return qwen3_style_dir(vllm_model_dir, tmp_path_factory.mktemp("qwen3-style"))


def _vllm_prompt_ids(server: VllmServer, template: str | None) -> list[int]:
    body: dict[str, Any] = {"model": SERVED, "messages": MESSAGES, "max_tokens": 1, "return_token_ids": True}
    if template is not None:
        body["chat_template"] = template
    answer = server.post("/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["prompt_token_ids"])


@pytest.mark.parametrize("kind", ["parts", "string"])
def test_two_text_parts_render_as_vllm_renders_them(
    vllm_server: VllmServer, vllm_model_dir: Path, qwen3_dir: Path, kind: str
) -> None:
    model_dir, template = (vllm_model_dir, None) if kind == "parts" else (qwen3_dir, QWEN3_STYLE)
    renderer = ChatRenderer.from_dir(model_dir)
    assert renderer.content_format == ("openai" if kind == "parts" else "string")
    ours = renderer.prompt_ids(MESSAGES, None, {})
    assert ours == _vllm_prompt_ids(vllm_server, template)


def test_the_continuous_prompt_of_a_two_part_message_is_vllms(
    gateway: GatewayHandle, vllm_server: VllmServer, qwen3_dir: Path, run_id: str
) -> None:
    """Through the proxy in continuous mode (token-in to vLLM): the recorded prompt is vLLM's chat rendering."""
    attempt = start_run(gateway, run_id, vllm_server, mode="continuous", tokenizer=str(qwen3_dir))
    agent = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0)
    agent.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=4, temperature=0.0)
    (event,) = recorded(gateway, attempt["rollout_id"])
    assert event.continuity == "fresh: first call of the attempt"
    assert event.prompt_ids == _vllm_prompt_ids(vllm_server, QWEN3_STYLE)
