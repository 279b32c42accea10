"""The replay report as a table (for people), JSON (the whole report) or CSV (one row per sample)."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterable, Sequence

import msgspec

from services.tools.compare import RolloutShift
from services.tools.replay import ReplayReport
from services.tools.report import ReplaySummary, SchemeReport

FORMATS = ("table", "json", "csv")
CSV_COLUMNS = (
    "scheme",
    "step",
    "rollout_id",
    "group_id",
    "index",
    "prompt_tokens",
    "response_tokens",
    "calls",
    "reward",
    "advantage",
    "token_weight",
)
TABLE_ROWS = 20
"""Groups and rollouts shown in the table (JSON and CSV have them all)."""


def to_json(report: ReplayReport) -> bytes:
    """The whole report as one JSON document (schema: services/tools/README.md)."""
    return msgspec.json.encode(report) + b"\n"


def to_csv(report: ReplayReport) -> str:
    """One row per sample per scheme, with the columns of `CSV_COLUMNS` (floats written exactly)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for scheme in report.schemes:
        for s in scheme.samples:
            writer.writerow(
                [
                    scheme.name,
                    "" if s.step is None else s.step,
                    s.rollout_id,
                    s.group_id or "",
                    s.index,
                    s.prompt_tokens,
                    s.response_tokens,
                    s.calls,
                    repr(s.reward),
                    repr(s.advantage),
                    repr(s.token_weight),
                ]
            )
    return out.getvalue()


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    if value == int(value) and abs(value) < 1e9:
        return str(int(value))
    return f"{value:.4g}"


def _grid(header: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "  ") -> list[str]:
    table = [list(header), *[list(r) for r in rows]]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = []
    for row in table:
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in pairs]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def _distribution(summary: ReplaySummary) -> str:
    return " ".join(f"{k}:{v}" for k, v in summary.samples_per_rollout.items()) or "-"


_SUMMARY: list[tuple[str, Callable[[ReplaySummary], str]]] = [
    ("rollouts", lambda s: str(s.rollouts)),
    ("dropped (no reward)", lambda s: str(s.rollouts_dropped_no_reward)),
    ("groups", lambda s: str(s.groups)),
    ("calls", lambda s: str(s.calls)),
    ("calls deduplicated", lambda s: str(s.calls_deduped)),
    ("calls too long", lambda s: str(s.calls_too_long)),
    ("samples", lambda s: str(s.samples)),
    ("merge ratio (calls/sample)", lambda s: f"{s.merge_ratio:.3g}"),
    ("samples per rollout (mean)", lambda s: f"{s.samples_per_rollout_mean:.3g}"),
    ("samples per rollout (n:rollouts)", _distribution),
    ("single-sample rollouts", lambda s: str(s.single_sample_rollouts)),
    ("tokens", lambda s: str(s.tokens)),
    ("response tokens", lambda s: str(s.response_tokens)),
    ("reward mean", lambda s: f"{s.reward_mean:.4g}"),
]


def _title(report: ReplayReport) -> str:
    first = report.schemes[0].summary
    scope = f"trainer step {report.step}" if report.step is not None else "all trained rollouts"
    if report.step is None and first.steps:
        scope = f"{len(first.steps)} trainer steps"
    elif report.step is None:
        scope = "all rollouts as one batch (no trainer step records)"
    skipped = sum(first.rollouts_skipped.values())
    reasons = ", ".join(f"{reason} {n}" for reason, n in first.rollouts_skipped.items())
    return f"replay of run {report.run_id}: {scope}; {skipped} rollouts skipped" + (f" ({reasons})" if reasons else "")


def _groups(schemes: Sequence[SchemeReport]) -> list[str]:
    lookup = [{(g.step, g.group_id): g for g in s.groups} for s in schemes]
    keys = list(lookup[0])
    if not keys:
        return ["groups: none declared (every rollout is its own group)"]
    header = ["group", "step", "rollouts", *[f"baseline/samples [{s.name}]" for s in schemes]]
    rows = []
    for key in keys[:TABLE_ROWS]:
        first = lookup[0][key]
        cells = [key[1], "-" if key[0] is None else str(key[0]), str(first.rollouts)]
        for table in lookup:
            g = table.get(key)
            cells.append(f"{_num(g.baseline)} / {g.samples}" if g else "-")
        rows.append(cells)
    more = [f"  ... {len(keys) - TABLE_ROWS} more groups (--format json lists all)"] if len(keys) > TABLE_ROWS else []
    return ["groups: the baseline under each scheme, and how many samples share it", *_grid(header, rows), *more]


def _rollouts(scheme: SchemeReport) -> list[str]:
    header = ["rollout", "group", "reward", "advantage", "samples", "response tokens", "loss weight"]
    rows = [
        [
            r.rollout_id,
            r.group_id or "-",
            _num(r.reward),
            _num(r.advantage),
            str(r.samples),
            str(r.response_tokens),
            f"{r.loss_weight:.4g}",
        ]
        for r in scheme.rollouts[:TABLE_ROWS]
    ]
    more = len(scheme.rollouts) - TABLE_ROWS
    tail = [f"  ... {more} more rollouts (--format json or csv for all)"] if more > 0 else []
    return [f"rollouts [{scheme.name}]", *_grid(header, rows), *tail]


def _shift_row(s: RolloutShift, reference: str, name: str) -> list[str]:
    relative = s.relative[name]
    return [
        s.rollout_id,
        s.group_id or "-",
        _num(s.reward),
        str(s.response_tokens),
        f"{s.loss_weight[reference]:.4g}",
        f"{s.loss_weight[name]:.4g}",
        f"{s.change[name]:+.4g}",
        "-" if relative is None else f"{relative:+.1%}",
    ]


def _comparison(report: ReplayReport) -> list[str]:
    comparison = report.comparison
    if comparison is None:
        return []
    ref = comparison.reference
    lines = [f"loss weight by rollout: each scheme against {ref}"]
    for shift in comparison.shifts:
        name = shift.scheme
        lines.append("")
        lines.append(
            f"{name}: {shift.gained} rollouts gain, {shift.lost} lose, {shift.unchanged} unchanged; "
            f"{shift.moved:.1%} of the loss weight moves"
        )
        ranked = sorted(comparison.rollouts, key=lambda s: s.change[name])
        gains = [s for s in reversed(ranked) if s.change[name] > 0][:5]
        losses = [s for s in ranked if s.change[name] < 0][:5]
        header = ["rollout", "group", "reward", "response tokens", ref, name, "change", "relative"]
        rows = [_shift_row(s, ref, name) for s in [*gains, *losses]]
        if rows:
            lines.extend(_grid(header, rows))
    return lines


def to_table(report: ReplayReport) -> str:
    """A readable summary: figures side by side, group baselines, rollouts, and the comparison."""
    schemes = report.schemes
    lines = [_title(report), ""]
    header = ["", *[s.name for s in schemes]]
    lines.extend(_grid(header, [[label, *[get(s.summary) for s in schemes]] for label, get in _SUMMARY], indent=""))
    lines.append("")
    lines.extend(_groups(schemes))
    lines.append("")
    if report.comparison is None:
        lines.extend(_rollouts(schemes[0]))
    else:
        lines.extend(_comparison(report))
    return "\n".join(lines) + "\n"


def render(report: ReplayReport, fmt: str) -> bytes:
    """The report in `fmt` (one of `FORMATS`)."""
    if fmt == "json":
        return to_json(report)
    if fmt == "csv":
        return to_csv(report).encode()
    if fmt == "table":
        return to_table(report).encode()
    raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
