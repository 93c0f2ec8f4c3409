"""`edgefed report`: run logs and sweep folders as one self-contained HTML page of figures (or PNG files).

Figures: test accuracy and train loss against rounds and against the federation's clock (a sweep: one line
per cell, its mean over seeds, a band from its lowest to its highest seed); per run, a devices x rounds map
of the completed fraction s_k/K_k with late reports and inactive devices marked, each device's spread of
completed fractions, the coefficients applied, and, where the log measured them, CPU share, frequency,
temperature and deadlines (figures.py draws them; sweeps.py reads a sweep folder). matplotlib is an optional
extra: `pip install 'edgefed[plot]'`.
"""

from __future__ import annotations

import base64
import datetime
import html
import math
from pathlib import Path

from edgefed import __version__
from edgefed.analysis.figures import MAX_PARTICIPATION, figures, pyplot
from edgefed.analysis.logs import Run
from edgefed.analysis.sweeps import Sweep, load_targets, number, short_key
from edgefed.errors import EdgefedError
from edgefed.outputs import check_folder, check_output


def _num(value, spec=".4f") -> str:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return html.escape(str(value))
    return "–" if math.isnan(value) else format(value, spec)


def _privacy_cell(run: Run) -> str:
    p = run.privacy()
    if p is None:
        return "<td>–</td>"
    clipped = "" if math.isnan(p["clipped"]) else f", {p['clipped']:.0%} clipped"
    return (f"<td>ε {_num(p['epsilon'], '.3g')} at δ {p['delta']:.2g} ({p['mechanism']}, z {p['z']:.3g}, "
            f"C {p['clip']:.3g}{clipped})</td>")


def _headline(runs: list[Run]) -> str:
    private = any(r.privacy() is not None for r in runs)
    rows = "".join(
        f"<tr><td>{html.escape(r.path.name)}</td><td>{r.status}</td><td>{r.rounds}</td>"
        f"<td>{_num(r.final('test_accuracy'))}</td><td>{_num(r.best('test_accuracy'))}</td>"
        f"<td>{_num(r.final('train_loss'), '.5g')}</td><td>{_num(r.clock[-1], '.3f')}</td>"
        f"<td>{html.escape(str(r.attrs.get('clock', 'measured')))}</td><td>{r.wall_s():.2f}</td>"
        f"{_privacy_cell(r) if private else ''}</tr>" for r in runs)
    return ("<table><tr><th>log</th><th>status</th><th>rounds</th><th>final test accuracy</th><th>best</th>"
            "<th>final train loss</th><th>clock (s)</th><th>clock kept</th><th>wall (s)</th>"
            f"{'<th>differential privacy</th>' if private else ''}</tr>" + rows + "</table>")


CELL_FIGURES = {"final_test_accuracy": ("final test accuracy", ".4f"), "best_test_accuracy": ("best", ".4f"),
                "final_train_loss": ("final train loss", ".4g"), "clock_s": ("clock (s)", ".3f"),
                "epsilon": ("ε", ".4g"), "energy_j": ("energy (J)", ".4g"),
                "rounds_to_target": ("rounds to target", ".1f"), "clock_to_target_s": ("clock to target (s)", ".3f"),
                "energy_to_target_j": ("energy to target (J)", ".4g")}


def _cells_table(sweep: Sweep) -> str:
    """cells.csv as a person reads it: the axes, the seeds, and mean ± std of each figure."""
    if not sweep.table:
        return ""
    shown = [k for k in CELL_FIGURES if any(row.get(f"{k}_mean") for row in sweep.table)]  # (a column with values)
    head = "".join(f"<th>{html.escape(short_key(k))}</th>" for k in sweep.axes) + "<th>seeds</th>" + "".join(
        f"<th>{CELL_FIGURES[k][0]}</th>" for k in shown)
    body = []
    for row in sweep.table:
        cells = "".join(f"<td>{html.escape(row[k])}</td>" for k in sweep.axes) + f"<td>{html.escape(row['seeds'])}</td>"
        for k in shown:
            spec = CELL_FIGURES[k][1]
            mean, std = number(row[f"{k}_mean"]), number(row[f"{k}_std"])
            reached = f" ({row[f'{k}_reached']}/{row['seeds']})" if f"{k}_reached" in row else ""
            cells += f"<td>{'–' if math.isnan(mean) else f'{mean:{spec}} ± {std:{spec}}'}{reached}</td>"
        body.append(f"<tr>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _img(alt: str, png: bytes) -> str:
    return f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"


CSS = """body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:1180px;margin:24px auto;padding:0 16px;
color:#1d1d1f;line-height:1.45}h1{font-size:1.6em;margin-bottom:0}h2{border-bottom:1px solid #ddd;padding-bottom:4px;
margin-top:2em}.meta{color:#666}table{border-collapse:collapse;margin:12px 0;font-size:.88em}th,td{border:1px solid #ddd;
padding:3px 8px;text-align:right;white-space:nowrap}th{background:#f5f5f7}td:first-child,th:first-child{text-align:left}
img{max-width:100%;border:1px solid #eee;margin:8px 0}pre{background:#f7f7f7;padding:10px;overflow:auto;font-size:.82em}
details{margin:8px 0}"""


def html_page(sweeps: list[Sweep], runs: list[Run]) -> str:
    figs = figures(sweeps, runs)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>edgefed report</title><style>{CSS}</style>"
             "</head><body>", "<h1>edgefed report</h1>",
             f"<p class='meta'>edgefed {__version__}, "
             f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; "
             f"{len(sweeps)} sweep folder(s), {len(runs)} run log(s)</p>"]
    for s in sweeps:
        name = s.name
        parts.append(f"<h2>sweep {html.escape(name)}</h2>")
        failed = sum(row["status"] == "failed" for row in s.summary)
        parts.append(f"<p>{sum(len(v) for v in s.cells.values())} runs in {len(s.cells)} cells"
                     f"{f', {failed} failed (see summary.csv)' if failed else ''}; axes: "
                     f"{html.escape(', '.join(s.axes) or 'none')}.</p>")
        table = _cells_table(s)
        if len(s.table) <= 24:
            parts.append(table)
        parts += [_img(stem, png) for sec, stem, png in figs if sec == f"sweep {name}"]
        if len(s.table) > 24:
            parts.append(f"<details><summary>the {len(s.table)} cells (cells.csv)</summary>{table}</details>")
        groups, cells = len(s.groups()), len(s.cells)
        if groups > MAX_PARTICIPATION or cells > MAX_PARTICIPATION:
            parts.append(f"<p class='meta'>Shown: learning curves of the first {min(groups, MAX_PARTICIPATION)} of "
                         f"{groups} groups and participation of the first {min(cells, MAX_PARTICIPATION)} of {cells} "
                         "cells; report a smaller sweep folder, or single logs, for the others.</p>")
        first = next(iter(s.cells.values()))[0]
        parts.append(f"<details><summary>config of {html.escape(first.path.name)} (the axes vary)</summary>"
                     f"<pre>{html.escape(first.config_toml)}</pre></details>")
    if runs:
        parts.append("<h2>runs</h2>")
        parts.append(_headline(runs))
        parts += [_img(stem, png) for sec, stem, png in figs if sec == "runs"]
        for r in runs[:MAX_PARTICIPATION]:
            sec = f"run {r.path.name}"
            parts.append(f"<h2>{html.escape(sec)}</h2>")
            parts.append(_headline([r]))
            parts += [_img(stem, png) for section, stem, png in figs if section == sec]
            parts.append(f"<details><summary>config</summary><pre>{html.escape(r.config_toml)}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(targets, out: Path, fmt: str = "html", force: bool = False) -> list[Path]:
    """The report of these run logs and sweep folders: one HTML page, or (fmt "png") a PNG per figure in
    the folder `out`; existing files replaced only with force, never a file the report reads. Returns what
    was written."""
    sweeps, runs = load_targets(targets)
    reads = [("a run log", r.path) for r in runs] + [
        ("a file of the sweep", path) for s in sweeps for path in s.files()]
    if fmt == "html":
        out = check_output(out, force=force, inputs=reads, example="report.html")
    else:
        out = Path(out)
        check_folder(out, (), force=force, inputs=reads, flag="--out")
    pyplot()  # (matplotlib missing: said before anything is read further)
    try:
        if fmt == "png":
            drawn = figures(sweeps, runs)
            check_folder(out, [f"{stem}.png" for _, stem, _ in drawn], force=force, inputs=reads, flag="--out")
            out.mkdir(parents=True, exist_ok=True)
            written = []
            for _, stem, png in drawn:
                path = out / f"{stem}.png"
                path.write_bytes(png)
                written.append(path)
            return written
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(html_page(sweeps, runs), encoding="utf-8")
        tmp.replace(out)
        return [out]
    except OSError as exc:
        raise EdgefedError(f"cannot write the report to {out} ({exc}); choose another --out") from None
