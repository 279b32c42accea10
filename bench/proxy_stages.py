"""The proxy's CPU per call, stage by stage, from the profiles `bench_proxy.py --profile DIR` writes.

    python bench/bench_proxy.py --sections main --no-agl --profile prof --json prof/figures.json
    python bench/proxy_stages.py prof prof/figures.json [--scale-to unprofiled.json]

Each `<case>.prof` is a CPU-time cProfile of the gateway process during one measured case. A
function's own time goes to the stage of its nearest caller that starts a stage (`ROOTS`), split
over its callers by the time spent in it from each (so `msgspec.json.Decoder.decode` is parse
when `json_body` calls it and token-id decode when the answer is read). Printed: microseconds
per call per stage, the profiler's own overhead included, and with `--scale-to` the same shares
applied to the CPU per call an unprofiled run measured (cProfile roughly doubles Python's cost,
so the shares are the finding and the scaled column the estimate).
"""

from __future__ import annotations

import argparse
import json
import pstats
from pathlib import Path

Func = tuple[str, int, str]

STAGES = (
    "parse",
    "admission",
    "budget",
    "marker",
    "upstream",
    "token-id decode",
    "compaction",
    "packing",
    "event encode",
    "publish",
    "metrics",
    "access log",
    "answer",
    "pipeline glue",
    "ASGI stack",
    "NATS socket I/O",
    "event loop",
)

# (file suffix, function name) -> stage; a name of "*" matches every function of the file.
ROOTS: dict[tuple[str, str], str] = {
    ("uvicorn/protocols/http/httptools_impl.py", "data_received"): "parse",
    ("uvicorn/protocols/http/httptools_impl.py", "on_url"): "parse",
    ("uvicorn/protocols/http/httptools_impl.py", "on_header"): "parse",
    ("uvicorn/protocols/http/httptools_impl.py", "on_headers_complete"): "parse",
    ("uvicorn/protocols/http/httptools_impl.py", "on_body"): "parse",
    ("uvicorn/protocols/http/httptools_impl.py", "on_message_complete"): "parse",
    ("services/gateway/proxy/handler.py", "parse_route"): "parse",
    ("services/gateway/proxy/agents.py", "agent_name"): "parse",
    ("services/gateway/proxy/handler.py", "json_body"): "parse",
    ("services/gateway/proxy/frontends/chat.py", "prepare"): "parse",
    ("services/gateway/proxy/frontends/responses.py", "conversation"): "parse",
    ("services/gateway/proxy/frontends/messages.py", "conversation"): "parse",
    ("services/gateway/proxy/frontends/canonical.py", "chat_body"): "parse",
    ("services/gateway/proxy/openai_format.py", "prepare_request"): "parse",
    ("services/gateway/proxy/handler.py", "admit"): "admission",
    ("services/gateway/proxy/handler.py", "choose"): "admission",
    ("services/gateway/proxy/limits.py", "check_call"): "admission",
    ("services/gateway/proxy/limits.py", "clamp_max_tokens"): "admission",
    ("services/gateway/proxy/payload.py", "refusal"): "admission",
    ("services/gateway/proxy/limits.py", "of"): "admission",
    ("services/gateway/phase.py", "*"): "admission",
    ("services/gateway/proxy/pipeline.py", "_reserve"): "budget",
    ("services/gateway/proxy/budgets.py", "*"): "budget",
    ("services/gateway/proxy/ledger.py", "*"): "budget",
    ("services/gateway/proxy/reaper.py", "started"): "marker",
    ("services/gateway/proxy/reaper.py", "_put"): "marker",
    ("services/gateway/proxy/reaper.py", "claim"): "marker",
    ("services/gateway/proxy/reaper.py", "send_claim"): "marker",
    ("services/gateway/proxy/reaper.py", "_verdict"): "marker",
    ("services/gateway/proxy/reaper.py", "_won"): "marker",
    ("services/gateway/proxy/reaper.py", "ended"): "marker",
    ("services/gateway/proxy/reaper.py", "_publish"): "marker",
    ("services/gateway/proxy/reaper.py", "<lambda>"): "marker",
    ("services/gateway/proxy/reaper.py", "_follow"): "marker",
    ("services/gateway/proxy/pipeline.py", "_post"): "upstream",
    ("services/gateway/proxy/upstream.py", "*"): "upstream",
    ("services/gateway/proxy/openai_format.py", "decode_completion"): "token-id decode",
    ("services/gateway/proxy/tokenin.py", "decode_completion"): "token-id decode",
    ("services/gateway/proxy/promptids.py", "*"): "token-id decode",
    ("services/gateway/proxy/openai_format.py", "read_completion"): "token-id decode",
    ("services/gateway/proxy/tokenin.py", "chat_answer"): "token-id decode",
    ("services/gateway/proxy/recording.py", "compact"): "compaction",
    ("services/gateway/proxy/recording.py", "remember"): "compaction",
    ("services/gateway/proxy/recording.py", "new_request_bytes"): "compaction",
    ("services/gateway/proxy/recording.py", "_packed"): "packing",
    ("schemas/refs.py", "*"): "packing",
    ("services/gateway/proxy/pipeline.py", "events"): "event encode",
    ("services/gateway/proxy/pipeline.py", "_bounded"): "event encode",
    ("schemas/codec.py", "*"): "event encode",
    ("services/common/kvwrites.py", "*"): "",  # "": the caller's stage (budget, marker)
    ("services/common/jspublish.py", "kv_send"): "",
    ("services/common/jspublish.py", "_kv_ack"): "",
    ("services/common/jspublish.py", "request"): "",
    ("services/common/jspublish.py", "send"): "",
    ("services/common/jspublish.py", "forget"): "",
    ("services/common/jspublish.py", "_answer"): "NATS socket I/O",
    ("services/common/jspublish.py", "_deliver"): "NATS socket I/O",
    ("services/common/natswire.py", "publish"): "",  # the caller's stage, as nats-py's publish below
    ("services/common/natswire.py", "_write"): "",
    ("services/common/natswire.py", "*"): "NATS socket I/O",
    ("nats/aio/subscription.py", "*"): "NATS socket I/O",
    ("services/common/eventstore.py", "*"): "publish",
    ("services/gateway/proxy/pipeline.py", "_append"): "publish",
    ("services/gateway/metrics.py", "*"): "metrics",
    ("services/common/metrics.py", "*"): "metrics",
    ("prometheus_client/", "*"): "metrics",
    ("services/common/accesslog.py", "*"): "access log",
    ("services/gateway/asgi.py", "send_json"): "answer",
    ("uvicorn/protocols/http/httptools_impl.py", "send"): "answer",
    ("services/common/headheld.py", "*"): "answer",
    ("services/gateway/proxy/frontends/base.py", "*"): "answer",
    ("services/gateway/proxy/frontends/chat.py", "complete"): "answer",
    ("services/gateway/proxy/frontends/responses.py", "complete"): "answer",
    ("services/gateway/proxy/frontends/messages.py", "complete"): "answer",
    ("services/gateway/proxy/pipeline.py", "*"): "pipeline glue",
    ("services/gateway/proxy/relay.py", "*"): "pipeline glue",
    ("services/gateway/proxy/call.py", "*"): "pipeline glue",
    ("services/gateway/proxy/handler.py", "*"): "pipeline glue",
    ("services/gateway/proxy/continuity.py", "*"): "parse",
    ("services/gateway/proxy/render.py", "*"): "parse",
    ("services/gateway/proxy/tokenin.py", "*"): "parse",
    ("uvicorn/", "*"): "ASGI stack",
    ("starlette/", "*"): "ASGI stack",
    ("fastapi/", "*"): "ASGI stack",
    ("services/gateway/app.py", "*"): "ASGI stack",
    ("services/gateway/api/reads.py", "*"): "ASGI stack",
    ("nats/aio/client.py", "_read_loop"): "NATS socket I/O",
    ("nats/aio/client.py", "_flusher"): "NATS socket I/O",
    ("nats/protocol/", "*"): "NATS socket I/O",
}

EDGE_FILE = "services/gateway/proxy/pipeline.py"
EDGES = {("_answer", "<method 'decode' of 'msgspec.json.Decoder' objects>"): "token-id decode"}
"""Builtins whose stage is the pipeline step that calls them (the answer's JSON decode)."""


def root(func: Func) -> str | None:
    """The stage a function starts, if any (its own entry first, then its file's)."""
    file, _, name = func
    for (suffix, fname), stage in ROOTS.items():
        if fname == name and file.endswith(suffix):
            return stage
    for (suffix, fname), stage in ROOTS.items():
        if fname == "*" and (file.endswith(suffix) or (suffix.endswith("/") and suffix in file)):
            return stage
    return None


def stage_times(stats: pstats.Stats) -> dict[str, float]:
    """Seconds of CPU per stage (see the module docstring)."""
    raw = stats.stats  # type: ignore[attr-defined]  # pstats keeps its table here
    memo: dict[Func, dict[str, float]] = {}

    def share(func: Func, depth: int = 0) -> dict[str, float]:
        if func in memo:
            return memo[func]
        found = root(func)
        if found:
            memo[func] = {found: 1.0}
            return memo[func]
        callers = raw[func][4] if func in raw else {}
        weights = {caller: edge[3] for caller, edge in callers.items() if caller != func}
        total = sum(weights.values())
        if depth > 60 or not total:
            memo[func] = {"event loop": 1.0}
            return memo[func]
        memo[func] = {"event loop": 1.0}  # a cycle back here counts as the loop's
        mix: dict[str, float] = {}
        for caller, weight in weights.items():
            edge = EDGES.get((caller[2], func[2])) if caller[0].endswith(EDGE_FILE) else None
            for stage, part in ({edge: 1.0} if edge else share(caller, depth + 1)).items():
                mix[stage] = mix.get(stage, 0.0) + part * weight / total
        memo[func] = mix
        return mix

    out = dict.fromkeys(STAGES, 0.0)
    for func, (_, _, tottime, _, _) in raw.items():
        for stage, part in share(func).items():
            out[stage] = out.get(stage, 0.0) + tottime * part
    return out


def table(folder: Path, figures: dict[str, object], scale_to: dict[str, object] | None) -> str:
    """The per-stage table of every profiled case in `folder` (markdown)."""
    cases = figures["cases"]
    assert isinstance(cases, dict)
    columns: list[tuple[str, dict[str, float], float]] = []
    counts: list[float] = []
    for prof in sorted(folder.glob("*.prof")):
        case = prof.stem
        calls = cases.get(case, {}).get("calls") or 0
        if not calls:
            continue
        stats = pstats.Stats(str(prof))
        counts.append(stats.total_calls / calls)  # type: ignore[attr-defined]  # deterministic, unlike time
        times = stage_times(stats)
        total = sum(times.values())
        target = None
        if scale_to is not None:
            other = scale_to["cases"]
            assert isinstance(other, dict)
            target = (other.get(case) or {}).get("cpu_us_per_call")
        factor = (target / (total / calls * 1e6)) if target else 1.0
        columns.append((case, {s: t / calls * 1e6 * factor for s, t in times.items()}, total / calls * 1e6 * factor))
    head = "| stage | " + " | ".join(c for c, _, _ in columns) + " |"
    lines = [head, "|---" * (len(columns) + 1) + "|"]
    for stage in STAGES:
        lines.append(f"| {stage} | " + " | ".join(f"{col[stage]:.0f}" for _, col, _ in columns) + " |")
    lines.append("| **total** | " + " | ".join(f"**{total:.0f}**" for _, _, total in columns) + " |")
    lines.append("| Python calls per call | " + " | ".join(f"{n:.0f}" for n in counts) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the --profile folder")
    parser.add_argument("figures", type=Path, help="the --json file of the same run")
    parser.add_argument("--scale-to", type=Path, help="the --json file of an unprofiled run: scale to its CPU/call")
    args = parser.parse_args()
    scale = json.loads(args.scale_to.read_text()) if args.scale_to else None
    print(table(args.folder, json.loads(args.figures.read_text()), scale))


if __name__ == "__main__":
    main()
