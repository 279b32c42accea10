"""The text the tiny model's tokenizer is trained on: shipped prose plus deterministic templates.

The corpus is what a small agent model mostly sees: English sentences, chat turns in the ChatML
layout, Hermes-style tool calls and tool results as JSON, Python code, shell commands and numbers.
`corpus_lines()` always returns the same lines (a fixed-seed `random.Random`, sorted word lists),
so the tokenizer trained on it is the same on every machine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from importlib import resources

CORPUS_SEED = 20240601
PROSE_FILE = "prose.txt"

_NAMES = [
    "Ada",
    "Ben",
    "Chloe",
    "Dmitri",
    "Elena",
    "Farah",
    "George",
    "Hana",
    "Ivan",
    "Julia",
    "Kofi",
    "Lena",
    "Marco",
    "Nora",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sam",
    "Tariq",
    "Uma",
    "Victor",
    "Wen",
    "Yusuf",
]
_NOUNS = [
    "book",
    "table",
    "garden",
    "river",
    "window",
    "letter",
    "bridge",
    "kitchen",
    "server",
    "file",
    "report",
    "bicycle",
    "map",
    "lamp",
    "market",
    "train",
    "ticket",
    "computer",
    "door",
    "project",
    "test",
    "function",
    "record",
    "message",
    "question",
    "answer",
    "picture",
    "song",
    "road",
    "tree",
    "cup",
    "key",
    "box",
]
_ADJECTIVES = [
    "small",
    "large",
    "old",
    "new",
    "quiet",
    "bright",
    "broken",
    "careful",
    "empty",
    "full",
    "green",
    "heavy",
    "light",
    "long",
    "short",
    "simple",
    "strange",
    "warm",
    "cold",
    "clean",
    "busy",
    "slow",
]
_VERBS = [
    "opened",
    "closed",
    "found",
    "moved",
    "fixed",
    "read",
    "wrote",
    "carried",
    "checked",
    "painted",
    "cleaned",
    "counted",
    "measured",
    "lost",
    "built",
    "tested",
    "sent",
    "saved",
    "changed",
    "described",
]
_PLACES = [
    "in the morning",
    "after lunch",
    "before the meeting",
    "near the station",
    "at home",
    "in the office",
    "on the train",
    "by the river",
    "in the evening",
    "at the weekend",
    "during the storm",
    "last night",
]
_CITIES = [
    "Paris",
    "Lagos",
    "Tokyo",
    "Lima",
    "Oslo",
    "Cairo",
    "Delhi",
    "Austin",
    "Madrid",
    "Seoul",
    "Nairobi",
    "Toronto",
    "Berlin",
    "Sydney",
    "Hanoi",
    "Dublin",
    "Quito",
    "Warsaw",
    "Athens",
    "Manila",
]
_FILES = [
    "main.py",
    "utils.py",
    "README.md",
    "setup.cfg",
    "tests/test_api.py",
    "src/app.py",
    "src/models.py",
    "config.yaml",
    "Makefile",
    "docs/index.md",
    "scripts/run.sh",
    "data/input.csv",
    "pyproject.toml",
]
_COMMANDS = [
    "ls -la",
    "pwd",
    "git status",
    "git diff",
    "git log --oneline -5",
    "pytest -q",
    "python main.py",
    "cat {file}",
    "head -n 20 {file}",
    "grep -n TODO {file}",
    "wc -l {file}",
    "sed -n 1,40p {file}",
    "find . -name '*.py'",
    "pip install -e .",
    "python -m pytest tests -x",
    "echo done",
]
_TOOLS = [
    ("get_weather", "Get the current weather for a city.", {"city": "string", "unit": "string"}),
    ("search_web", "Search the web and return the top results.", {"query": "string", "limit": "integer"}),
    ("read_file", "Read a file from the workspace.", {"path": "string"}),
    ("run_command", "Run a shell command and return its output.", {"command": "string", "timeout": "integer"}),
    ("add_numbers", "Add two numbers.", {"a": "number", "b": "number"}),
    ("send_email", "Send an email.", {"to": "string", "subject": "string", "body": "string"}),
]


def _sentence(rng: random.Random) -> str:
    name, other = rng.sample(_NAMES, 2)
    adj, noun, verb, place = rng.choice(_ADJECTIVES), rng.choice(_NOUNS), rng.choice(_VERBS), rng.choice(_PLACES)
    forms = [
        f"{name} {verb} the {adj} {noun} {place}.",
        f"{place.capitalize()}, {name} and {other} {verb} a {adj} {noun}.",
        f"Why did {name} leave the {noun} {adj}? Because {other} {verb} it {place}.",
        f"The {noun} was {adj}, so {name} {verb} it again.",
        f"{name} asked {other} where the {adj} {noun} was, and {other} said it was {place}.",
    ]
    return rng.choice(forms)


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(1, 999)
    op, word, value = rng.choice([("+", "plus", a + b), ("-", "minus", a - b), ("*", "times", a * b)])
    if rng.random() < 0.5:
        return f"What is {a} {word} {b}? {a} {op} {b} = {value}. The answer is {value}."
    return f"Compute {a} {op} {b}.\nStep 1: {a} {op} {b} = {value}.\nFinal answer: {value}"


def _tool_schema(name: str, description: str, params: dict[str, str]) -> dict[str, object]:
    properties = {key: {"type": kind} for key, kind in params.items()}
    parameters = {"type": "object", "properties": properties, "required": sorted(params)[:1]}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _tool_arguments(rng: random.Random, params: dict[str, str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for key, kind in params.items():
        if kind == "integer":
            values[key] = rng.randint(1, 60)
        elif kind == "number":
            values[key] = rng.randint(-500, 500)
        elif key == "city":
            values[key] = rng.choice(_CITIES)
        elif key == "path":
            values[key] = rng.choice(_FILES)
        elif key == "command":
            values[key] = rng.choice(_COMMANDS).format(file=rng.choice(_FILES))
        elif key == "unit":
            values[key] = rng.choice(["celsius", "fahrenheit"])
        else:
            values[key] = _sentence(rng)
    return values


def _tool_dialogue(rng: random.Random) -> str:
    name, description, params = rng.choice(_TOOLS)
    call = {"name": name, "arguments": _tool_arguments(rng, params)}
    result = {"ok": True, "value": rng.randint(0, 10_000), "note": _sentence(rng)}
    return (
        f"<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n<tools>\n"
        f"{json.dumps(_tool_schema(name, description, params))}\n</tools><|im_end|>\n"
        f"<|im_start|>user\n{_sentence(rng)} Can you help?<|im_end|>\n"
        f"<|im_start|>assistant\n<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>\n"
        f"<|im_start|>tool\n<tool_response>\n{json.dumps(result)}\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\nDone. {_sentence(rng)}<|im_end|>\n"
    )


def _chat(rng: random.Random) -> str:
    return (
        f"<|im_start|>user\n{_arithmetic(rng).split('?')[0]}?<|im_end|>\n"
        f"<|im_start|>assistant\n{_arithmetic(rng)}<|im_end|>\n"
    )


def _python(rng: random.Random) -> str:
    noun, other = rng.sample(_NOUNS, 2)
    k = rng.randint(2, 9)
    forms = [
        f'def count_{noun}s(items):\n    """Return how many {noun}s are in items."""\n'
        f'    return sum(1 for item in items if item == "{noun}")\n',
        f"class {noun.capitalize()}:\n    def __init__(self, size: int = {k}) -> None:\n        self.size = size\n\n"
        f"    def grow(self) -> int:\n        self.size += 1\n        return self.size\n",
        f'for i in range({k}):\n    if i % 2 == 0:\n        print(i, "{other}")\n    else:\n        continue\n',
        f'import json\n\nwith open("{rng.choice(_FILES)}") as f:\n    data = json.load(f)\nprint(len(data))\n',
        f'def test_{noun}():\n    assert {k} + {k} == {2 * k}\n    assert "{noun}".upper() == "{noun.upper()}"\n',
    ]
    return rng.choice(forms)


def _shell(rng: random.Random) -> str:
    command = rng.choice(_COMMANDS).format(file=rng.choice(_FILES))
    lines = [f"$ {command}"]
    if command.startswith("pytest") or "pytest" in command:
        passed = rng.randint(1, 40)
        lines.append(f"{passed} passed in {rng.randint(1, 99) / 10:.1f}s")
    elif command.startswith("ls"):
        lines.extend(sorted(rng.sample(_FILES, 4)))
    else:
        lines.append(_sentence(rng))
    return "\n".join(lines) + "\n"


_GENERATORS: list[Callable[[random.Random], str]] = [
    _sentence,
    _sentence,
    _arithmetic,
    _tool_dialogue,
    _chat,
    _python,
    _shell,
]


def corpus_lines(n_generated: int = 1500) -> Iterator[str]:
    """The shipped prose paragraphs, then `n_generated` templated documents, always the same ones."""
    prose = resources.files("services.common.tinymodel.data").joinpath(PROSE_FILE).read_text(encoding="utf-8")
    yield from (paragraph for paragraph in prose.split("\n\n") if paragraph.strip())
    rng = random.Random(CORPUS_SEED)
    for _ in range(n_generated):
        yield rng.choice(_GENERATORS)(rng)
