"""How vLLM hands a message's content to a chat template: one string, or a list of parts.

vLLM decides per template (`vllm/renderers/hf.py`, `_detect_content_format`, with
`--chat-template-content-format auto`, its default): a template that loops over a message's
content (`{% for part in message.content %}`, a loop over a variable named `content`, or a loop in a
macro that is called with `message.content`) gets "openai" content, a list of
`{"type": "text", "text": ...}` parts, a string content wrapped as one part; any other template
gets "string" content, the text parts joined with "\n" (`vllm/renderers/chat_utils.py`,
`_parse_chat_message_content_parts`). Tool messages whose parts are all text are joined with "\n"
in both formats. This module repeats that detection on the template's Jinja AST, so the gateway
renders a prompt with the ids vLLM's chat endpoint would.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import jinja2
import jinja2.nodes

ContentFormat = Literal["string", "openai"]


def _is_name(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_key(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_name(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    return isinstance(node, jinja2.nodes.Getattr) and _is_name(node.node, name) and node.attr == key


def _access(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """`name` (or `name.key`), through filters, tests and slices (vLLM's `_is_var_or_elems_access`)."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node is not None and _access(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _access(node.node, name, key)
    return _is_key(node, name, key) if key else _is_name(node, name)


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """`name` and every variable assigned from it (`{% set msgs = messages[1:] %}`), transitively."""
    found, queue = [name], [name]
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if _access(assign.node, current) and isinstance(target, jinja2.nodes.Name) and target.name not in found:
                found.append(target.name)
                queue.append(target.name)
    return found


def _message_names(root: jinja2.nodes.Template) -> list[str]:
    """The loop variables of `{% for message in messages %}` loops."""
    names = _aliases(root, "messages")
    return [
        loop.target.name
        for loop in root.find_all(jinja2.nodes.For)
        if isinstance(loop.target, jinja2.nodes.Name) and any(_access(loop.iter, n) for n in names)
    ]


def _macro_params(root: jinja2.nodes.Template, macro: jinja2.nodes.Macro, messages: list[str]) -> set[str]:
    """The parameters of `macro` that some call passes a message's content to."""
    params: set[str] = set()
    names = [arg.name for arg in macro.args]
    for call in root.find_all(jinja2.nodes.Call):
        if not _is_name(call.node, macro.name):
            continue
        for index, arg in enumerate(call.args):
            if index < len(names) and any(_access(arg, m, "content") for m in messages):
                params.add(names[index])
        for keyword in call.kwargs:
            if keyword.key in names and any(_access(keyword.value, m, "content") for m in messages):
                params.add(keyword.key)
    return params


def _content_loops(root: jinja2.nodes.Template) -> Iterator[jinja2.nodes.For]:
    messages = _message_names(root)
    in_macros: dict[int, set[str]] = {}
    for macro in root.find_all(jinja2.nodes.Macro):
        bound = _macro_params(root, macro, messages)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros[id(loop)] = bound
    for loop in root.find_all(jinja2.nodes.For):
        if any(_access(loop.iter, m, "content") for m in messages):
            yield loop
        elif isinstance(loop.iter, jinja2.nodes.Name):
            params = in_macros.get(id(loop))
            if (params and loop.iter.name in params) or (params is None and loop.iter.name == "content"):
                yield loop


def detect_content_format(template: str) -> ContentFormat:
    """ "openai" when the template iterates over a message's content, else "string" (as vLLM's `auto`)."""
    try:
        root = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return "string"
    return "openai" if next(_content_loops(root), None) is not None else "string"


def text_parts(content: Any) -> list[str] | None:
    """The texts of a content: a string, None (no parts) or a list of text parts; None for anything else."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return [str(p.get("text") or "") for p in content]
    return None


def template_content(role: str, texts: list[str], content_format: ContentFormat) -> str | list[dict[str, str]]:
    """A message's content as vLLM hands it to the template in `content_format`."""
    if content_format == "string" or role == "tool":
        return "\n".join(texts)
    return [{"type": "text", "text": text} for text in texts]
