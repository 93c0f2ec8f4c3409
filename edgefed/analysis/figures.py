"""The report's figures, drawn with matplotlib (the `plot` extra): learning curves, per-device maps of a run's
participation and measurements, a sweep's overview of its cells and its accuracy against privacy.
Colour maps are perceptually uniform (readable in greyscale) and lines differ by style as well as colour."""

from __future__ import annotations

import io
import math
import warnings

import numpy as np

from edgefed.analysis.logs import Run
from edgefed.analysis.sweeps import Sweep, number, short_key
from edgefed.errors import EdgefedError

STYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
MAX_PARTICIPATION = 12  # runs (or cells) that get their own participation figures


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise EdgefedError("edgefed report draws with matplotlib, which is not installed; "
                           "pip install 'edgefed[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "font.size": 9, "axes.grid": True, "grid.alpha": 0.3,
                         "axes.spines.top": False, "axes.spines.right": False})
    return plt


def _matplotlib_at_least(*version: int) -> bool:
    import matplotlib

    return tuple(int(p) for p in matplotlib.__version__.split(".")[:2] if p.isdigit()) >= version


# -- figures --------------------------------------------------------------------------------------------------
def curves(series: list[tuple[str, list[Run]]], title: str):
    """Test accuracy and train loss against round and against clock: a line per series (mean over its
    runs) with a band from its lowest to its highest run."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.4), sharey="row", layout="constrained")
    for i, (label, runs) in enumerate(series):
        style = dict(linestyle=STYLES[i % len(STYLES)], marker=MARKERS[i % len(MARKERS)], markevery=0.1,
                     markersize=4, linewidth=1.4)
        rounds = min(r.rounds for r in runs) + 1
        labelled = False  # the legend's entry goes on the first panel this series is drawn in
        for row, (metric, name) in enumerate((("test_accuracy", "test accuracy"), ("train_loss", "train loss"))):
            values = np.array([r[f"metrics/{metric}"][:rounds] for r in runs], dtype=float)
            x = np.arange(rounds)
            clocks = np.array([r.clock[:rounds] for r in runs], dtype=float)
            clock = clocks.mean(axis=0)  # NaN where a log kept no clock: that panel stays empty
            evaluated = np.isfinite(values).all(axis=0)
            if not evaluated.any():
                continue
            mean = values[:, evaluated].mean(axis=0)
            lo, hi = values[:, evaluated].min(axis=0), values[:, evaluated].max(axis=0)
            for col, xs in ((0, x[evaluated]), (1, clock[evaluated])):
                ax = axes[row, col]
                if col == 1 and not np.isfinite(xs).all():
                    continue
                line, = ax.plot(xs, mean, label=None if labelled else label, **style)
                labelled = True
                if len(runs) > 1:
                    ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
            axes[row, 0].set_ylabel(name)
    for col in (0, 1):
        if not axes[0, col].lines:
            axes[0, col].text(0.5, 0.5, "no test accuracy: the problem has no held-out data", ha="center",
                              va="center", transform=axes[0, col].transAxes, fontsize=9, alpha=0.7)
    losses = np.concatenate([r["metrics/train_loss"] for _, runs in series for r in runs])
    losses = losses[np.isfinite(losses)]
    if losses.size and losses.min() > 0 and losses.max() / losses.min() > 20:  # an early spike flattens the rest
        axes[1, 0].set_yscale("log")
        axes[1, 0].set_ylabel("train loss (log scale)")
    axes[1, 0].set_xlabel("round")
    axes[1, 1].set_xlabel("federation clock (s)")
    axes[0, 0].set_title("against rounds")
    axes[0, 1].set_title("against the clock")
    if any(len(runs) > 1 for _, runs in series):
        axes[0, 0].text(0.99, 0.02, "line: mean over seeds; band: lowest to highest", transform=axes[0, 0].transAxes,
                        ha="right", va="bottom", fontsize=7, alpha=0.7)
    if len(series) > 1:
        fig.legend(loc="outside right upper", fontsize=8, frameon=False)
    fig.suptitle(title)
    return fig


def energy(series: list[tuple[str, list[Run]]], title: str):
    """Test accuracy against the energy spent (J) and against the clock, a line per series (mean over its
    runs): the energy a run takes to a target accuracy, and how that ranking differs from the one by time.
    None when no run has energy (no board with [power])."""
    drawn = [(label, runs) for label, runs in series if all(r.spent_j() is not None for r in runs)]
    if not drawn:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True, layout="constrained")
    for i, (label, runs) in enumerate(drawn):
        style = dict(linestyle=STYLES[i % len(STYLES)], marker=MARKERS[i % len(MARKERS)], markevery=0.1,
                     markersize=4, linewidth=1.4)
        rounds = min(r.rounds for r in runs) + 1
        acc = np.array([r["metrics/test_accuracy"][:rounds] for r in runs], dtype=float)
        evaluated = np.isfinite(acc).all(axis=0)
        if not evaluated.any():
            continue
        spent = np.mean([r.spent_j()[:rounds] for r in runs], axis=0)
        clock = np.mean([r.clock[:rounds] for r in runs], axis=0)
        axes[0].plot(spent[evaluated], acc[:, evaluated].mean(axis=0), label=label, **style)
        if np.isfinite(clock[evaluated]).all():
            axes[1].plot(clock[evaluated], acc[:, evaluated].mean(axis=0), **style)
    if not axes[0].lines:  # no test accuracy to reach (a quadratic, or a problem without held-out data)
        plt.close(fig)
        return None
    axes[0].set_xlabel("energy spent (J, modelled from the boards' [power])")
    axes[1].set_xlabel("federation clock (s)")
    axes[0].set_ylabel("test accuracy")
    axes[0].set_title("against energy")
    axes[1].set_title("against the clock")
    if len(drawn) > 1:
        fig.legend(loc="outside right upper", fontsize=8, frameon=False)
    fig.suptitle(title)
    return fig


def _heatmap_axes(ax) -> None:
    """Whole rounds and devices on the axes, no grid across the cells."""
    from matplotlib.ticker import MaxNLocator

    ax.grid(False)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


FIGURE_DEVICES = 200  # a per-device figure's rows at most (a row a device)


def _shown_devices(run: Run) -> tuple[np.ndarray, int]:
    """(the devices a per-device figure draws, of how many)."""
    return run.most_selected(FIGURE_DEVICES), int(run.attrs["n_devices"])


def _device_axis(ids: np.ndarray, of: int) -> str:
    return "device" if ids.size == of else f"the {ids.size} devices selected most, of {of:,}"


def participation(run: Run, title: str):
    """Completed fraction per device and round (late and inactive marked), its spread per device, the
    coefficients applied, and a submodel run's widths."""
    plt = pyplot()
    ids, of = _shown_devices(run)
    frac = run.fractions()[:, ids].T  # devices x rounds
    n, rounds = frac.shape
    width = run.data.get("participation/width")
    panels = 2 if width is None else 3
    fig = plt.figure(figsize=(11, (3.2 + 0.06 * n) * panels / 2), layout="constrained")
    grid = fig.add_gridspec(panels, 2, width_ratios=(3, 1), height_ratios=(1,) * panels)
    ax = fig.add_subplot(grid[0, 0])
    cmap = plt.get_cmap("viridis").with_extremes(bad="#f2f2f2")  # bad: not selected
    extent = (0.5, rounds + 0.5, n - 0.5, -0.5)
    im = ax.imshow(np.ma.masked_invalid(frac), aspect="auto", cmap=cmap, vmin=0, vmax=1, extent=extent,
                   interpolation="nearest")
    inactive = ~run["participation/active"][:, ids].T
    if inactive.any():
        ax.imshow(np.ma.masked_where(~inactive, np.ones_like(frac)), aspect="auto", cmap="Greys", vmin=0, vmax=1.5,
                  extent=extent, interpolation="nearest")
    late = run.data.get("participation/late")
    late = None if late is None else late[:, ids]
    if late is not None and late.any():
        k, r = np.nonzero(late.T)
        ax.scatter(r + 1, k, marker="x", s=14, color="white", linewidths=1.0, label="late (dropped)")
        ax.scatter(r + 1, k, marker="x", s=6, color="black", linewidths=0.5)
        ax.legend(loc="upper right", fontsize=7, framealpha=0.8)
    _heatmap_axes(ax)
    ax.set_xlabel("round")
    ax.set_ylabel(_device_axis(ids, of))
    ax.set_title("completed fraction $s_k/K_k$ (grey: not selected; dark: outside the federation)")
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01)
    box = fig.add_subplot(grid[:, 1])
    spread = [row[np.isfinite(row)] for row in frac]
    sideways = {"orientation": "horizontal"} if _matplotlib_at_least(3, 10) else {"vert": False}
    box.boxplot([s if s.size else [np.nan] for s in spread], widths=0.6, showfliers=False, **sideways)
    box.set_yticks(range(1, n + 1), [str(k) for k in ids] if n <= 40 else [""] * n)
    box.invert_yaxis()
    box.set_xlim(-0.02, 1.02)
    box.set_xlabel("completed fraction")
    box.set_title("per device, over its rounds")
    coef = fig.add_subplot(grid[1, 0])
    coeff = run["participation/coeff"][:, ids].T
    cim = coef.imshow(np.ma.masked_where(coeff == 0, coeff), aspect="auto", cmap="cividis", extent=extent,
                      interpolation="nearest")
    _heatmap_axes(coef)
    coef.set_xlabel("round")
    coef.set_ylabel(_device_axis(ids, of))
    coef.set_title("coefficient applied to $\\Delta_k$ (blank: nothing applied)")
    fig.colorbar(cim, ax=coef, fraction=0.03, pad=0.01)
    if width is not None:
        wax = fig.add_subplot(grid[2, 0])
        wim = wax.imshow(np.ma.masked_invalid(width[:, ids].T), aspect="auto", cmap=cmap, vmin=0, vmax=1,
                         extent=extent, interpolation="nearest")
        _heatmap_axes(wax)
        wax.set_xlabel("round")
        wax.set_ylabel(_device_axis(ids, of))
        wax.set_title("submodel width trained (grey: not selected)")
        fig.colorbar(wim, ax=wax, fraction=0.03, pad=0.01)
    fig.suptitle(title)
    return fig


def partition(run: Run, title: str):
    """Each device's training labels (devices x labels, as shares of the device's samples) and its samples,
    for logs with /devices/label_counts."""
    part = run.partition()
    if part is None:
        return None
    plt = pyplot()
    counts = part["counts"]
    n, c = counts.shape
    totals = counts.sum(axis=1)
    fig = plt.figure(figsize=(11, 2.4 + min(0.06 * n, 9)), layout="constrained")
    grid = fig.add_gridspec(1, 2, width_ratios=(3, 1))
    ax = fig.add_subplot(grid[0, 0])
    shares = counts / np.maximum(totals[:, None], 1)
    im = ax.imshow(shares, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest",
                   extent=(-0.5, c - 0.5, n - 0.5, -0.5))
    _heatmap_axes(ax)
    ax.set_xlabel("label")
    ax.set_ylabel("device")
    ax.set_title(f"share of each device's training samples per label (label skew {part['skew']:.2f}: "
                 "0 IID, 1 disjoint)")
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01)
    bars = fig.add_subplot(grid[0, 1])
    bars.barh(np.arange(n), totals, color="#4c72b0", height=0.8)
    bars.set_ylim(n - 0.5, -0.5)
    bars.set_xlabel("training samples")
    bars.set_title("per device")
    fig.suptitle(title)
    return fig


def measured(run: Run, title: str):
    """CPU share, frequency and temperature per device and round, and each round's deadlines, where the log
    has them."""
    panels = [(name, label) for name, label in (("participation/cpu_percent", "CPU share the work got (%)"),
                                                ("participation/cpu_freq_mhz", "CPU frequency (MHz)"),
                                                ("participation/temperature_c", "board temperature (°C)"))
              if name in run.data and np.isfinite(run[name]).any()]
    deadlines = run.data.get("participation/deadline_s")
    timed = int(deadlines is not None and bool(np.isfinite(deadlines).any()))
    if not panels and not timed:
        return None
    plt = pyplot()
    ids, of = _shown_devices(run)
    n = ids.size
    rows = len(panels) + timed
    fig, axes = plt.subplots(rows, 1, figsize=(11, sum(1.4 + 0.05 * n for _ in panels) + 2.2 * timed),
                             squeeze=False, layout="constrained",
                             height_ratios=[1.4 + 0.05 * n] * len(panels) + [2.2] * timed)
    for ax, (name, label) in zip(axes[:, 0], panels):
        values = run[name][:, ids].T.astype(float)
        cmap = plt.get_cmap("magma").with_extremes(bad="#f2f2f2")
        scale = {"vmin": 0, "vmax": max(100.0, float(np.nanmax(values)))} if name.endswith("cpu_percent") else {}
        im = ax.imshow(np.ma.masked_invalid(values), aspect="auto", cmap=cmap, interpolation="nearest",
                       extent=(0.5, values.shape[1] + 0.5, n - 0.5, -0.5), **scale)
        _heatmap_axes(ax)
        ax.set_ylabel(_device_axis(ids, of))
        ax.set_title(label)
        fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01)
    if timed:
        ax = axes[-1, 0]
        ms = deadlines * 1e3
        rounds = np.arange(1, ms.shape[0] + 1)
        with warnings.catch_warnings():  # a round without deadlines is an empty slice: NaN, as it should
            warnings.simplefilter("ignore", RuntimeWarning)
            mid, lo, hi = np.nanmedian(ms, axis=1), np.nanmin(ms, axis=1), np.nanmax(ms, axis=1)
        ax.plot(rounds, mid, color="black", linewidth=1.4, label="median over the selected devices")
        ax.fill_between(rounds, lo, hi, color="grey", alpha=0.3, linewidth=0, label="lowest to highest")
        ax.set_ylabel("deadline (ms)")
        ax.set_title("deadlines per round")
        ax.set_xlim(0.5, ms.shape[0] + 0.5)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("round")
    fig.suptitle(title)
    return fig


# -- the page ---------------------------------------------------------------------------------------------------
def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    pyplot().close(fig)
    return buf.getvalue()


def overview(sweep: Sweep):
    """Final test accuracy of every cell, mean and std over seeds: the next-to-last dimension along x, a line
    per value of the last, a panel per combination of the others (the shape of a paper's table)."""
    dims = sweep.dimensions()
    if len(dims) < 2 or not any(math.isfinite(number(row.get("final_test_accuracy_mean"))) for row in sweep.table):
        return None  # no cell has an accuracy (a quadratic)
    plt = pyplot()

    def along(row: dict, dim) -> str:
        return ", ".join(row[k] for k in dim)

    x_dim, line_dim, rest = dims[-2], dims[-1], dims[:-2]
    panels = list(dict.fromkeys(tuple(along(row, d) for d in rest) for row in sweep.table))
    xs = list(dict.fromkeys(along(row, x_dim) for row in sweep.table))
    lines = list(dict.fromkeys(along(row, line_dim) for row in sweep.table))
    fig, axes = plt.subplots(1, len(panels), figsize=(min(max(5.5 * len(panels), 9), 16), 4.2), squeeze=False,
                             sharey=True, layout="constrained")
    slanted = max(len(x) for x in xs) > 6
    for ax, panel in zip(axes[0], panels):
        for i, value in enumerate(lines):
            rows = {along(row, x_dim): row for row in sweep.table
                    if along(row, line_dim) == value and tuple(along(row, d) for d in rest) == panel}
            mean = np.array([number(rows[x]["final_test_accuracy_mean"]) if x in rows else np.nan for x in xs])
            std = np.array([number(rows[x]["final_test_accuracy_std"]) if x in rows else np.nan for x in xs])
            ax.errorbar(np.arange(len(xs)) + (i - (len(lines) - 1) / 2) * 0.06, mean, yerr=std, capsize=2,
                        linestyle=STYLES[i % len(STYLES)], marker=MARKERS[i % len(MARKERS)], markersize=4,
                        linewidth=1.3, label=value if panel == panels[0] else None)
        ax.set_xticks(range(len(xs)), xs, rotation=30 if slanted else 0, ha="right" if slanted else "center")
        ax.set_xlabel(", ".join(x_dim))
        one = next(row for row in sweep.table if tuple(along(row, d) for d in rest) == panel)
        ax.set_title(", ".join(f"{short_key(k)}={one[k]}" for d in rest for k in d))
    axes[0, 0].set_ylabel("final test accuracy (mean ± std)")
    fig.legend(loc="outside right upper", fontsize=8, frameon=False, title=", ".join(line_dim), title_fontsize=8)
    fig.suptitle(f"sweep {sweep.name}: final test accuracy per cell")
    return fig


def privacy_tradeoff(sweep: Sweep):
    """Final test accuracy against the epsilon each cell spent (log scale), a line per combination of the
    axes that are not [privacy] keys; the cells without privacy as dashed lines of the same colour. None
    unless the sweep has cells with two or more epsilons."""
    eps = [number(row.get("epsilon_mean")) for row in sweep.table]
    if len({e for e in eps if math.isfinite(e)}) < 2:
        return None
    plt = pyplot()
    others = [k for k in sweep.axes if not k.startswith("privacy.")]
    groups: dict[str, list[tuple[float, float, float]]] = {}
    for row, e in zip(sweep.table, eps):
        label = ", ".join(f"{short_key(k)}={row[k]}" for k in others) or "all cells"
        groups.setdefault(label, []).append((e, number(row["final_test_accuracy_mean"]),
                                             number(row["final_test_accuracy_std"])))
    fig, ax = plt.subplots(figsize=(8.5, 4.6), layout="constrained")
    for i, (label, points) in enumerate(groups.items()):
        private = sorted(p for p in points if math.isfinite(p[0]))
        line = ax.errorbar([p[0] for p in private], [p[1] for p in private], yerr=[p[2] for p in private],
                           capsize=2, linestyle=STYLES[i % len(STYLES)], marker=MARKERS[i % len(MARKERS)],
                           markersize=4, linewidth=1.3, label=label)
        for _, mean, _ in (p for p in points if not math.isfinite(p[0])):
            ax.axhline(mean, color=line.lines[0].get_color(), linestyle="--", linewidth=0.9, alpha=0.7)
    ax.set_xscale("log")
    ax.set_xlabel("ε spent by the last round (log scale; δ as each log says)")
    ax.set_ylabel("final test accuracy (mean ± std)")
    if any(not math.isfinite(e) for e in eps):
        ax.text(0.99, 0.02, "dashed: the same cell without privacy", transform=ax.transAxes, ha="right",
                va="bottom", fontsize=7, alpha=0.7)
    fig.legend(loc="outside right upper", fontsize=8, frameon=False)
    fig.suptitle(f"sweep {sweep.name}: accuracy against privacy")
    return fig


def _stem(text: str) -> str:
    """A file name part: the words of the text joined by '-'."""
    return "-".join("".join(ch if ch.isalnum() or ch in "._" else " " for ch in text).split())[:80]


def figures(sweeps: list[Sweep], runs: list[Run]) -> list[tuple[str, str, bytes]]:
    """(section, file stem, PNG) of everything the report shows, in page order; each figure is drawn,
    encoded and closed before the next (a sweep has many)."""
    out = []

    def add(section: str, stem: str, fig) -> None:
        if fig is not None:
            out.append((section, stem, _png(fig)))

    for s in sweeps:
        sec = f"sweep {s.name}"
        add(sec, f"{s.name}-overview", overview(s))
        add(sec, f"{s.name}-privacy", privacy_tradeoff(s))
        for group, series in list(s.groups().items())[:MAX_PARTICIPATION]:
            add(sec, f"{s.name}-{_stem(group)}-curves", curves(series, f"{s.name}: {group}"))
            add(sec, f"{s.name}-{_stem(group)}-energy", energy(series, f"{s.name}: {group}, energy to accuracy"))
        first = next(iter(s.cells.values()), [None])[0]
        if first is not None:
            add(sec, f"{s.name}-partition", partition(first, f"{s.name}: the partition (of {first.path.name})"))
        for cell, cell_runs in list(s.cells.items())[:MAX_PARTICIPATION]:
            add(sec, f"{s.name}-{_stem(cell)}-participation",
                participation(cell_runs[0], f"{cell} (seed of {cell_runs[0].path.name})"))
    if runs:
        add("runs", "runs-curves", curves([(r.path.name, [r]) for r in runs],
                                          "runs" if len(runs) > 1 else runs[0].path.name))
        add("runs", "runs-energy", energy([(r.path.name, [r]) for r in runs], "energy to accuracy"))
        for r in runs[:MAX_PARTICIPATION]:
            add(f"run {r.path.name}", f"{r.path.stem}-partition", partition(r, f"{r.path.name}: the partition"))
            add(f"run {r.path.name}", f"{r.path.stem}-participation", participation(r, r.path.name))
            add(f"run {r.path.name}", f"{r.path.stem}-measured", measured(r, f"{r.path.name}: measured"))
    return out
