"""The report's page: one self-contained HTML string (inline CSS and SVG, no scripts, nothing
fetched from a network) from a ``RunData``."""

from __future__ import annotations

import datetime as _dt
import json

from dflash_core.config import recipe_text
from dflash_core import acceptance
from dflash_core.models.dspark.calibration import Calibration
from dflash_core.observe.sinks.textlog import LOSS_TERMS
from dflash_core.observe import events as ev
from dflash_core.observe.device_hours import Figure, figure_text
from dflash_core.units import GiB as GIB

from . import plots as P
from .cells import esc, table
from .data import MAX_SERIES, RunData
from .context import context_evals, context_html
from .sets import sets_html, summary_text
from .hours import hours_html


def _utc(ts: float | None) -> str:
    if ts is None:
        return "-"
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    d, rem = divmod(seconds, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    if d:
        return f"{d}d {h}h {m:02d}m"
    if h:
        return f"{h}h {m:02d}m {s:02d}s"
    return f"{m}m {s:02d}s"


def _loss_terms(step) -> str:
    """A family's loss terms of a step (DSpark's "ce 2.1250, tv 0.7500, conf 0.5000"; DFlash2's
    ce, sel, hit); "" for DFlash."""
    if step is None:
        return ""
    got = [(name, getattr(step, key, -1.0)) for name, key in LOSS_TERMS]
    return ", ".join(f"{name} {v:.4f}" for name, v in got if v >= 0)


def _fmt(x, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def _plan_html(plan: ev.MemoryPlan) -> str:
    """The preflight memory plan, per device. A row without a free-memory figure (a CPU device:
    no card to read it from) was not checked: it says so rather than "free 0, fits"."""
    rows, unchecked = [], []
    for r in plan.rows:
        device, free = str(r.get("device", "?")), r.get("free")
        if free is None:
            unchecked.append(device)
        rows.append([device, r.get("role", ""), _fmt((r.get("total") or 0) / GIB, ".1f"),
                     "-" if free is None else _fmt(free / GIB, ".1f"),
                     "not checked" if free is None else ("yes" if r.get("fits") else "no")])
    out = ("<p>Memory plan (preflight)" + ("" if plan.fits else " — <strong>does not fit</strong>")
           + ":</p>" + table(["device", "role", "planned GiB", "free GiB", "fits"], rows))
    if unchecked:
        on_cpu = all(d.partition(":")[0] == "cpu" for d in unchecked)
        out += ('<p class="muted">' + esc(
            "On the CPU the plan is not checked against a card: there is no free memory to "
            "compare it with, so the planned GiB is an estimate of what the run holds."
            if on_cpu else f"Not checked on {', '.join(unchecked)}: no free memory was measured "
            "there.") + "</p>")
    return out


def _config_text(config: dict) -> str:
    try:
        import yaml

        return yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=100)
    except Exception:  # noqa: BLE001 - a value yaml cannot write: JSON shows it all the same
        return json.dumps(config, indent=2, default=str)


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1100px;
padding:1rem 1.5rem;color:#1d2330;background:#fff}
h1{font-size:1.5rem;margin:.2rem 0}h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #ddd}
nav a{margin-right:.8rem}.muted{color:#667}
svg{width:100%;height:auto;display:block}
.small svg{max-width:620px}
table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0}
td,th{border:1px solid #ddd;padding:.2rem .5rem;text-align:left;vertical-align:top}
th{background:#f3f4f7}td.msg{max-width:600px;white-space:pre-wrap;word-break:break-word}
pre{background:#f6f7f9;border:1px solid #e1e3e8;padding:.7rem;overflow:auto;font-size:.8rem}
.status{display:inline-block;padding:.1rem .6rem;border-radius:.8rem;font-weight:600}
.finished{background:#d9f2de}.failed{background:#f8d7d7}.aborted{background:#fbe9c8}
.running{background:#dde8fb}
details{margin:.3rem 0}
"""



def ending(data: RunData) -> str:
    """How the run ended, in one sentence ("" when it has not): its RunEnded, else the state
    change into a terminal state, with the reason given."""
    if not data.over:
        return ""
    e, last = data.ended, data.last_step
    step = e.step if e else (last.step if last else None)
    seconds = e.seconds if e else (data.last_ts or 0.0) - (data.t0 or 0.0)
    reason = (e.reason if e else "") or data.end_reason
    total = data.total_steps
    at = "" if step is None else f" at step {step}" + (f" of {total}" if total else "")
    return (f"{data.state.capitalize()}{at} after {_duration(seconds)}"
            + (f": {reason}" if reason else "") + ".")


def render_html(data: RunData, source: str = "") -> str:
    """The report page for ``data`` (a ``read_run`` result): one self-contained HTML string."""
    plots = P.Plots()
    t0 = data.t0 or 0.0
    clock = P.Clock(t0, data.last_ts or t0)
    s = data.started
    status = data.status()
    css_status = data.state if data.state in ev.TERMINAL_STATES else "running"
    title = f"dflash run report: {data.run_name}"
    parts: list[str] = []
    add = parts.append

    add(f"<h1>{esc(title)}</h1>")
    add(f'<p><span class="status {css_status}">{esc(status)}</span> '
        f'<span class="muted">made {esc(_utc(_dt.datetime.now(_dt.timezone.utc).timestamp()))}'
        f"{' from ' + esc(source) if source else ''}</span></p>")
    if data.over:
        add(f'<p class="ending">{esc(ending(data))}</p>')
    add('<nav><a href="#summary">summary</a><a href="#loss">loss</a><a href="#tau">tau</a>'
        '<a href="#cost">cost</a>'
        '<a href="#throughput">samples/s</a><a href="#queues">queues</a>'
        '<a href="#memory">GPU memory</a><a href="#errors">errors and stalls</a>'
        '<a href="#acceptance">acceptance</a><a href="#config">config</a></nav>')

    # -- summary
    last = data.last_step
    total = data.total_steps
    rows = [
        ["run", data.run_name],
        ["run folder", s.run_dir if s else "-"],
        ["status", status],
        ["started", _utc(s.ts if s else data.t0)],
        ["last event", _utc(data.last_ts)],
        ["span", _duration((data.last_ts or t0) - t0)],
        ["step", f"{last.step}" + (f" of {total}" if total else "") if last else "-"],
        ["epoch", last.epoch if last else "-"],
        ["latest loss", _fmt(last.loss if last else None)],
        *([["latest loss terms", terms]] if (terms := _loss_terms(last)) else []),
        ["latest teacher-forced tau", _fmt(last.tau_tf if last else None)],
        ["latest exact tau", f"{data.last_eval.tau:.4f} at step {data.last_eval.step}"
         if data.last_eval else "-"],
        *([["latest exact tau on the sets", summary_text(data.sets)]] if data.sets else []),
        ["training recipe", (recipe_text(s.config) if s and s.config else "") or "-"],
        ["targets", ", ".join(map(str, s.targets)) if s else "-"],
        ["drafters", ", ".join(map(str, s.drafters)) if s else "-"],
    ]
    if s and s.resumed_from_step:
        rows.append(["resumed from step", s.resumed_from_step])
    if s and s.allocator:
        rows.append(["CUDA allocator", s.allocator])
    if data.ended:
        rows.append(["end", f"{data.ended.status} at step {data.ended.step} after "
                     f"{_duration(data.ended.seconds)}" + (f": {data.ended.reason}"
                                                          if data.ended.reason else "")])
    cks = data.checkpoints.items()
    if cks:
        rows.append(["checkpoints", f"{data.checkpoints.count}; last: step {cks[-1].step} "
                     f"({cks[-1].reason}) {cks[-1].path}"])
    if data.hours.last is not None:
        h = data.hours.last
        rows.append(["device time", figure_text(Figure.of_event(h), h.lost_gpu, h.lost_host)])
    rows.append(["errors / stalls", f"{data.errors.count} / {data.stalls.count}"])
    notes = []
    if data.loss.nonfinite:
        notes.append(f"{data.loss.nonfinite} steps had a non-finite loss (not plotted)")
    if data.unreadable:
        notes.append(f"{data.unreadable} unreadable lines skipped (a torn last line is normal "
                     f"for a running or killed run)")
    if data.extra_names:
        notes.append(f"{data.extra_names} samples of queues or GPUs past the first "
                     f"{MAX_SERIES} not plotted")
    if data.loss.stride > 1:
        notes.append(f"long series are thinned to at most {data.cap} points each (means of "
                     f"neighbouring samples; evaluations are exact)")
    rows.append(["events read", f"{data.events} of this run"
                 + ("; " + "; ".join(notes) if notes else "")])
    add('<h2 id="summary">Summary</h2>')
    add("<table><tbody>" + "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>"
                                   for k, v in rows) + "</tbody></table>")
    states = data.states.items()
    if states:
        add("<details><summary>state changes</summary>" + table(
            ["time", "elapsed", "state", "from", "reason"],
            [[_utc(x.ts), _duration(x.ts - t0), x.state, x.previous, x.reason] for x in states])
            + "</details>")

    def none(what: str) -> str:
        # "yet" only while the run may still make some
        return f'<p class="muted">No {what} in this run{"" if data.over else " yet"}.</p>'

    # -- loss, tau, samples/s
    add('<h2 id="loss">Loss</h2>')
    add(P.line_plot(plots, data, clock, data.loss, "loss", "training loss per step",
                    "tab:blue", log=True) if len(data.loss) else none("steps"))
    add('<h2 id="tau">Tau</h2>')
    if len(data.tau_tf) or len(data.evals) or data.sets:
        add(P.tau_plot(plots, data, clock))
    else:
        add(none("steps or evaluations"))
    evals = data.evals.items()
    if evals:
        more = (f" ({data.evals.dropped} in the middle of the run not listed)"
                if data.evals.dropped else "")
        add(f"<details open><summary>exact tau at each evaluation{esc(more)}</summary>"
            + table(["step", "exact tau", "prompts", "time", "elapsed"],
                     [[st, f"{tau:.4f}", n, _utc(ts), _duration(ts - t0)]
                      for ts, st, tau, n in reversed(evals)]) + "</details>")
    if data.sets:
        add(sets_html(data.sets))
    by_context = context_evals(data)  # those with rounds in more than one bucket
    if by_context:
        add('<h3 id="context">Tau by context length</h3>')
        add(context_html(by_context, P.context_plot(plots, by_context, data.sets.names())))
    add('<h2 id="cost">Cost</h2>')
    add(hours_html(plots, data.hours, data.over))
    add('<h2 id="throughput">Samples per second</h2>')
    add(P.line_plot(plots, data, clock, data.samples_per_s, "samples/s", "training throughput",
                    "tab:green") if len(data.samples_per_s) else none("steps"))

    # -- queues, memory
    add('<h2 id="queues">Queue depths</h2>')
    add(P.queue_plot(plots, data, clock) if data.queues else none("queue samples"))
    add('<h2 id="memory">GPU memory</h2>')
    add(P.memory_plot(plots, data, clock) if data.gpus else
        '<p class="muted">No GPU samples in this run (a run on the CPU has none).</p>')
    if data.plan:
        add(_plan_html(data.plan))
    if data.gpus:
        add(table(["GPU", "name", "role", "last used GiB", "last torch allocated GiB",
                    "card GiB", "limit GiB", "allocator retries", "OOMs"],
                   [[i, g.get("name", ""), g.get("role", ""), _fmt(g["used"].last(), ".1f"),
                     _fmt(g["alloc"].last(), ".1f"), _fmt(g.get("total"), ".1f"),
                     _fmt(g.get("limit"), ".1f") if g.get("limit") else "-", g.get("retries", 0),
                     g.get("ooms", 0)] for i, g in sorted(data.gpus.items())]))

    # -- errors and stalls
    add('<h2 id="errors">Errors and stalls</h2>')
    errors, stalls = data.errors.items(), data.stalls.items()
    if errors or stalls:
        add(P.timeline_plot(plots, data, clock))
    elif data.state in ("failed", "aborted"):
        add(f'<p class="muted">No errors or stalls were recorded. {esc(ending(data))}</p>')
    else:
        add(none("errors or stalls"))
    if errors:
        more = f" ({data.errors.dropped} in the middle not listed)" if data.errors.dropped else ""
        rows_html = "".join(
            "<tr>" + "".join(f"<td>{esc(c)}</td>" for c in (
                _utc(e.ts), _duration(e.ts - t0), e.source, e.error_kind,
                "fatal" if e.fatal else "no", e.device or "-", e.phase or "-"))
            + f'<td class="msg">{esc(e.message)}'
            + (f"<br><em>hint: {esc(e.hint)}</em>" if e.hint else "")
            + (f"<details><summary>traceback</summary><pre>{esc(e.traceback)}</pre></details>"
               if e.traceback else "") + "</td></tr>" for e in errors)
        add(f"<p>Errors: {data.errors.count}{esc(more)}</p><table><thead><tr>"
            + "".join(f"<th>{h}</th>" for h in ("time", "elapsed", "source", "kind", "fatal",
                                                  "device", "phase", "message"))
            + f"</tr></thead><tbody>{rows_html}</tbody></table>")
    if stalls:
        more = f" ({data.stalls.dropped} in the middle not listed)" if data.stalls.dropped else ""
        open_now = sum(1 for _, c in stalls if c is None)
        add(f"<p>Stalls: {data.stalls.count}, {open_now} never cleared{esc(more)}</p>")
        add(table(["time", "elapsed", "worker", "phase", "silent s", "where", "cleared"],
                   [[_utc(st.ts), _duration(st.ts - t0), st.worker, st.phase,
                     f"{st.seconds:.0f}", st.where,
                     f"after {_duration(c - st.ts)}" if c else "NOT CLEARED"]
                    for st, c in stalls]))

    # -- acceptance
    add('<h2 id="acceptance">Acceptance (latest evaluation)</h2>')
    if data.last_eval:
        cal = Calibration.from_dict(getattr(data.last_eval, "calibration", None))
        add(table(["measure", f"step {data.last_eval.step}", "what it is"],
                   acceptance.report_rows(data.last_eval)
                   + (acceptance.calibration_rows(cal) if cal is not None else [])))
    if data.last_eval and data.last_eval.acceptance:
        add(f'<div class="small">{P.acceptance_plot(plots, data.last_eval)}</div>')
        add(table(["accepted tokens"] + [str(k) for k in range(len(data.last_eval.acceptance))],
                   [["rounds"] + list(data.last_eval.acceptance)]))
    else:
        add(none("evaluations"))

    # -- config
    add('<h2 id="config">Resolved config</h2>')
    if s:
        add(f"<pre>{esc(_config_text(s.config))}</pre>" if s.config else
            '<p class="muted">The run recorded an empty config.</p>')
    else:
        add(none("RunStarted event"))

    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title>"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")
