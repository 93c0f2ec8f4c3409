"""The layering rule of DEVELOPERS.md, read from the code's own imports (function-level ones included):
every import points to the same layer or one below, the engine and the transports never import each other,
reading logs imports no runtime, and no two modules import each other round a circle."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "edgefed"

# bottom to top; a top-level part is a subpackage (algorithms) or a top-level module (rng)
LAYERS = [
    {"__init__", "errors", "holds", "ids", "kernels", "memory", "outputs"},  # the version, the error hierarchy, the kernels;
    # what a process may hold and where a command may write
    {"rng"},  # random streams (their kernel lives in kernels/)
    {"algorithms", "participation", "compression", "secagg"},  # the math: pure, no I/O, no transport
    {"problems", "layers", "model_contract", "models", "width_models", "torchmodel", "hwprofile", "tracefiles"},  # problems,
    # layer lists, models, the models of submodel widths
    {"config"},  # the schema, checked against the registries below it
    {"transport", "runlog"},  # the engine-transport interface; the run log's format
    {"engine", "runtime", "analysis"},  # the round loop beside the transports; reading logs for answers
    {"orchestration"},  # what a run is: prepare, drive, rank roles, recording, profiling
    {"cli", "__main__"},  # argparse, printing, exit codes
]
APART = [("engine", "runtime"), ("runtime", "engine"), ("runlog", "runtime"), ("runlog", "engine"),
         ("analysis", "runtime"), ("analysis", "engine")]


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def part(module: str) -> str:
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "__init__"


def layer_of(module: str) -> int:
    return next(i for i, parts in enumerate(LAYERS) if part(module) in parts)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_part_has_a_layer():
    assert sorted({part(m) for m in modules()} - set().union(*LAYERS)) == []


def test_no_import_runs_upward_or_between_parts_kept_apart():
    upward, between = [], []
    for name, targets in graph().items():
        for target in targets:
            if target == "edgefed":  # the package face: only its version
                continue
            if layer_of(target) > layer_of(name):
                upward.append(f"{name} -> {target}")
            if (part(name), part(target)) in APART:
                between.append(f"{name} -> {target}")
    assert upward == [] and between == []


def test_no_module_circles():
    g = graph()
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                circles.append(sorted(scc))

    for v in g:
        if v not in index:
            visit(v)
    assert circles == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule's reader is not blind: a function-level import of the CLI from the math is upward."""
    fake = tmp_path / "m.py"
    fake.write_text("def f():\n    from edgefed.cli import main\n    from ..config import Config\n")
    found = imports("edgefed.algorithms.m", fake, {"edgefed.cli", "edgefed.config", "edgefed.algorithms"})
    assert found == {"edgefed.cli", "edgefed.config"}
    assert layer_of("edgefed.cli") > layer_of("edgefed.algorithms.m")


def test_only_the_algorithms_and_the_config_know_which_algorithm_runs():
    """Outside algorithms/ and config/ no code names an algorithm (a string "scaffold", an attribute
    `.scaffold`): everything else reads the algorithm's declarations. Docstrings and comments may."""
    names = {"fedavg", "scaffold"}
    found = []
    for name, path in modules().items():
        if part(name) in ("algorithms", "config"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if any(n in node.value.lower().replace("-", " ").split() or node.value.lower() == n for n in names):
                    found.append(f"{name}:{node.lineno} {node.value!r}")
            elif isinstance(node, ast.Attribute) and node.attr in names:
                found.append(f"{name}:{node.lineno} .{node.attr}")
    assert found == []
