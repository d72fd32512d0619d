# The HTML report of a finished testbed run: one self-contained file (inline CSS, figures as PNG
# data URIs; no script, no link to anything outside it, so it opens offline). Invariants: every
# text that comes from the run's files goes through html.escape; the comparison table shows the
# very cells of the text table (`comparison_rows`), so the two never disagree; a part the
# directory lacks is named in the report, never silently left out.
from __future__ import annotations

import base64
import html
import json
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ._linkcheck import SPEC_TOLERANCE, off_spec
from ._plots import Plot, SystemRun, fault_x, load_systems, report_plots
from ._rundir import RunDir
from ._summary import comparison_notes, comparison_rows, comparison_title, links_off_spec

STYLE = """
body { font-family: sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; margin-top: 2em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #bbb; padding: 0.25em 0.6em; text-align: left; }
th { background: #eef; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f4f4f4; padding: 0.6em; white-space: pre-wrap; word-break: break-all; }
.missing { background: #fff4e0; border: 1px solid #e0a040; padding: 0.5em 1em; }
.off-spec { background: #ffe8e8; border: 1px solid #d04040; padding: 0.5em 1em; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { color: #555; font-size: 0.9em; }
dt { font-weight: bold; float: left; clear: left; width: 12em; } dd { margin-left: 13em; }
"""
NOT_MEASURED = "not measured"
COMPARISON_PLOTS = ("metric", "bytes")  # shown beside the table; the others after the faults


def write_html_report(rundir: RunDir, summary: dict[str, Any], dest: Path) -> Path:
    """Render the report of `rundir` (whose summary is `summary`) into the file `dest`.

    Raises:
        OSError: `dest` cannot be written.
    """
    systems = load_systems(rundir.path, rundir.run)
    plots = report_plots(rundir.run, systems, rundir.peer_labels())
    dest.write_text(render_html(rundir, summary, systems, plots), encoding="utf-8")
    return dest


def render_html(rundir: RunDir, summary: dict[str, Any], systems: Sequence[SystemRun],
                plots: Sequence[Plot]) -> str:  # fmt: skip
    """The whole document."""
    title = f"geotrain testbed report: {summary['scenario']}"
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1>", _missing(rundir.missing),
        _off_spec_warning(links_off_spec(rundir.run["links"])), _overview(rundir, summary),
        _comparison(summary, [p for p in plots if p.name in COMPARISON_PLOTS]),
        _scenario(rundir.scenario), _link_check(rundir.run["links"]), _faults(systems),
        _figures([p for p in plots if p.name not in COMPARISON_PLOTS]),
        f"<footer><p>Written by <code>geotrain testbed report --html</code> from "
        f"<code>{_e(rundir.path)}</code>; everything is embedded in this file.</p></footer>",
        "</body></html>",
    ]  # fmt: skip
    return "\n".join(p for p in parts if p) + "\n"


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _cell(value: object) -> str:
    if value is None:
        return f"<td>{NOT_MEASURED}</td>"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f'<td class="num">{value:g}</td>'
    return f"<td>{_e(value)}</td>"


def _table(table_id: str, header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>\n" for row in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody></table>'


def _missing(missing: Sequence[str]) -> str:
    if not missing:
        return ""
    items = "".join(f"<li>{_e(m)}</li>" for m in missing)
    return (f'<section id="missing" class="missing"><h2>Missing from this run directory</h2>'
            f"<p>The report was made without:</p><ul>{items}</ul></section>")  # fmt: skip


def _off_spec_warning(off: Sequence[dict[str, Any]]) -> str:
    """A warning box naming each link the check found more than 10% off its spec."""
    if not off:
        return ""
    items = "".join(f"<li>{_e(x['src'])} -> {_e(x['dst'])}: {_e('; '.join(x['misses']))}</li>"
                    for x in off)  # fmt: skip
    return ('<section id="off-spec" class="off-spec"><h2>Links off their spec</h2><p>The link '
            f"check measured these links more than {SPEC_TOLERANCE:.0%} away from what the "
            "scenario says (the emulator could not hold them on this machine, busy as it was): "
            "the results are of the links as measured, not of the scenario's.</p>"
            f"<ul>{items}</ul></section>")  # fmt: skip


def _overview(rundir: RunDir, summary: dict[str, Any]) -> str:
    run, scenario = rundir.run, rundir.scenario or {}
    target = summary["target"]
    facts = [
        ("scenario", run["scenario"]),
        ("description", scenario.get("description", "unknown (no scenario.json)")),
        ("peers", run["peers"]), ("task", f"{run['task']} {_params(run.get('params'))}".strip()),
        ("algorithm", run["algorithm"]),
        ("target", f"{target['metric']} {target['value']:g}"),
        ("duration", f"at most {run.get('duration_s', '?')} s of training per system"),
        ("emulation", f"{run['emulation']} ({run['emulation_reason']})"),
        ("link rates", f"{run['rate_scale']:g} x the scenario's figures"),
        ("node overrides", " ".join(run.get("node_overrides") or []) or "none"),
        ("consensus distance", _consensus(run["consensus_distance_final"])),
    ]  # fmt: skip
    items = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in facts)
    return f'<section id="run"><h2>Run</h2><dl>{items}</dl>{_command(run)}</section>'


def _consensus(value: object) -> str:
    if value is None:
        return "unknown (fewer than two final checkpoints)"
    return f"{value:.3g} at the end (geotrain's final checkpoints; DDP: 0 by construction)"


def _command(run: dict[str, Any]) -> str:
    command = run.get("command")
    if not command:
        return "<p>Command line: not recorded.</p>"
    where = f" (in <code>{_e(run['cwd'])}</code>)" if run.get("cwd") else ""
    line = shlex.join(str(w) for w in command)
    return f'<p>Command line{where}:</p><pre id="command">{_e(line)}</pre>'


def _comparison(summary: dict[str, Any], plots: Sequence[Plot]) -> str:
    header, *rows = comparison_rows(summary)
    notes = "".join(f"<li>{_e(n)}</li>" for n in comparison_notes(summary))
    return (f'<section id="comparison-section"><h2>Comparison</h2>'
            f"<p>{_e(comparison_title(summary))}; times count from each system's first "
            f"step.</p>{_table('comparison', header, rows)}<ul>{notes}</ul>"
            f"{''.join(_figure(p) for p in plots)}</section>")  # fmt: skip


def _scenario(scenario: dict[str, Any] | None) -> str:
    if scenario is None:
        return '<section id="scenario"><h2>Scenario</h2><p>scenario.json is missing.</p></section>'
    first, regions = 0, []
    for r in scenario.get("regions", []):
        n = r.get("peers", 0) if isinstance(r.get("peers"), int) else 0
        regions.append((r.get("name"), n, f"{first}..{first + n - 1}" if n > 1 else str(first)))
        first += n
    links = scenario.get("links", {})
    specs = [(f"inside {name}", *_spec(s)) for name, s in links.get("inside", {}).items()]
    specs += [(" <-> ".join(map(str, b.get("regions", []))), *_spec(b))
              for b in links.get("between", [])]  # fmt: skip
    plan = [(f.get("at_s"), f.get("action"), _fault_target(f)) for f in scenario.get("faults", [])]
    slow = [(s.get("peer"), s.get("slowdown")) for s in scenario.get("stragglers", [])]
    return "\n".join([
        '<section id="scenario"><h2>Scenario</h2>',
        _table("regions", ("region", "peers", "peer numbers"), regions),
        "<h3>Link specs (one way)</h3>",
        _table("link-specs", ("link", "delay ms", "jitter ms", "loss", "rate Mbit/s"), specs),
        "<h3>Stragglers</h3>",
        _table("stragglers", ("peer", "compute slowdown"), slow) if slow else "<p>none</p>",
        "<h3>Fault plan</h3>",
        _table("fault-plan", ("at s", "action", "on"), plan) if plan else "<p>none</p>",
        *_availability_and_data(scenario),
        "</section>",
    ])  # fmt: skip


def _availability_and_data(scenario: dict[str, Any]) -> list[str]:
    """The availability windows (geotrain only) and how the data was split over the peers."""
    windows = [(w.get("peer"), w.get("online_s"), w.get("offline_s"), w.get("offset_s"))
               for w in scenario.get("availability", [])]  # fmt: skip
    kind = scenario.get("partition", "iid")
    split = (f"{kind} label skew, alpha {scenario.get('alpha')}, the same split in every system"
             if kind == "dirichlet" else "IID shards")  # fmt: skip
    return [
        "<h3>Availability windows (geotrain only)</h3>",
        _table("availability", ("peer", "online s", "away s", "first window delayed s"), windows)
        if windows else "<p>none: every peer online throughout</p>",
        f"<h3>Data</h3><p>{_e(split)}</p>",
    ]


def _spec(spec: dict[str, Any]) -> tuple[object, ...]:
    return tuple(spec.get(k) for k in ("delay_ms", "jitter_ms", "loss", "rate_mbit"))


def _fault_target(fault: dict[str, Any]) -> str:
    if "peer" in fault:
        return f"peer {fault['peer']}"
    link = {k: v for k, v in fault.items() if k not in ("at_s", "action", "regions")}
    return " | ".join(map(str, fault.get("regions", []))) + (f" {link}" if link else "")


def _link_check(links: list[Any]) -> str:
    rows = [(
        f"{link.get('src')} -> {link.get('dst')}",
        f"{link['src_peer']} -> {link['dst_peer']}" if "src_peer" in link else "-",
        link.get("spec_rtt_ms"), link.get("measured_rtt_ms"),
        link.get("spec_mbit"), link.get("measured_mbit"),
        f"{link['check_bytes'] >> 20} MiB" if isinstance(link.get("check_bytes"), int) else "-",
        "; ".join(off_spec(link)) or ("ok" if link.get("measured_mbit") is not None else "-"),
    ) for link in links if isinstance(link, dict)]  # fmt: skip
    measured = any(r[3] is not None for r in rows)
    note = ("<p>Measured before training, one peer pair per region pair (a region with one "
            "peer has no link inside it to measure).</p>" if measured else
            "<p>The links were not measured (--no-link-check, or no emulation): "
            "spec figures only.</p>")  # fmt: skip
    header = ("link", "peers", "spec RTT ms", "measured RTT ms", "spec Mbit/s",
              "measured Mbit/s", "transfer", f"within {SPEC_TOLERANCE:.0%} of spec")  # fmt: skip
    return (f'<section id="link-check"><h2>Link check</h2>{note}'
            f"{_table('links', header, rows)}</section>")  # fmt: skip


def _faults(systems: Sequence[SystemRun]) -> str:
    rows = sorted(
        (number, s.name, f.get("fault"), round(fault_x(f, s.t0), 2), f.get("applied_at_s"),
         "yes" if f.get("applied") else "no", f.get("note") or "")
        for s in systems for number, f in s.faults
    )  # fmt: skip
    header = ("#", "system", "fault", "at s on the plots", "handled at s (testbed clock)",
              "applied", "note")  # fmt: skip
    body = (_table("faults", header, rows) + "<p>The plots mark each fault at its number; their "
            "time axes count from the system's first step, the testbed's clock from when it saw "
            "that step.</p>" if rows else "<p>No fault events.</p>")  # fmt: skip
    return f'<section id="fault-events"><h2>Fault events</h2>{body}</section>'


def _figures(plots: Sequence[Plot]) -> str:
    figures = "\n".join(_figure(p) for p in plots)
    return f'<section id="plots"><h2>Per peer</h2>{figures}</section>'


def _figure(plot: Plot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    return (f'<figure id="plot-{_e(plot.name)}"><img alt="{_e(plot.caption)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{_e(plot.caption)}; vertical '
            "lines: faults, numbered as in the fault events (solid: applied, dotted: skipped)"
            "</figcaption></figure>")  # fmt: skip


def _params(params: dict | None) -> str:
    """A task's params as the scenario and --param write them: `size = "10m", batch = 2`."""
    return ", ".join(f"{k} = {json.dumps(v)}" for k, v in (params or {}).items())
