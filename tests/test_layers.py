"""The package's layers import one way: ir -> rules -> trace (the front end) -> profile data -> plan ->
search -> codegen -> runtime -> profiler (measurement) -> cli.  A module may import its own layer and
the layers before it, at module level or inside a function alike, and no modules import each other
around a loop (within a layer either).

Each layer past the rules has its own package: ``hidup.frontend``, ``hidup.profiler`` (profile data,
a leaf the cost model reads), ``hidup.plan`` (read by search and codegen alike), ``hidup.search``,
``hidup.codegen``, ``hidup.runtime``, ``hidup.profiler.measure`` (the measuring harness, above the
runtime whose programs it times) and ``hidup.cli``.  The check reads every module's source (``ast``,
nothing is imported) and resolves each import to a module of the package; any import that goes up a
layer fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# source folders of the installed packages (pyproject's package-dir)
PACKAGES = {"hidup": "hidup", "hidup.search": "search", "hidup.codegen": "codegen", "hidup.profiler": "profiler"}
LAYERS = ("ir", "rules", "trace", "profile data", "plan", "search", "codegen", "runtime", "profiler", "cli")
# module (or package prefix) -> layer; the longest matching prefix decides
LAYER_OF = {
    "hidup.ir": "ir",
    "hidup.optionset": "ir",
    "hidup.errors": "ir",
    "hidup.files": "ir",
    "hidup.fxvalues": "ir",
    "hidup._callable": "ir",
    "hidup.losses": "ir",
    "hidup.copies": "ir",
    "hidup.rules": "rules",
    "hidup.precision": "rules",
    "hidup.models": "rules",
    "hidup.frontend": "trace",
    "hidup.profiler": "profile data",
    "hidup.plan": "plan",
    "hidup.search": "search",
    "hidup.codegen": "codegen",
    "hidup.runtime": "runtime",
    "hidup.profiler.measure": "profiler",
    "hidup.cli": "cli",
    "hidup.__main__": "cli",
}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _layer(module: str) -> str | None:
    best = max((k for k in LAYER_OF if module == k or module.startswith(k + ".")), key=len, default=None)
    return LAYER_OF[best] if best else None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``module`` imports, anywhere in its source."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [f"{target}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != module:
                found.add(t)
    return found


def _upward(modules: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, imported) for every import of ``modules`` that goes up a layer."""
    order = {name: i for i, name in enumerate(LAYERS)}
    up = set()
    for module, path in modules.items():
        here = _layer(module)
        for target in _imports(module, path, modules):
            there = _layer(target)
            if here in order and there in order and order[there] > order[here]:
                up.add((module, target))
    return up


def _cycles(modules: dict[str, Path]) -> list[list[str]]:
    """The import cycles among ``modules``: strongly connected components of more than one module
    (Tarjan), each sorted."""
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycle():
    cycles = _cycles(_modules())
    assert not cycles, "modules that import each other (directly or around a loop): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_cycle_check_fails_on_a_cycle(tmp_path):
    """The profiler's device and op timers importing each other (the last cycle there was) is found."""
    files = {
        "hidup.profiler.measure.device": "def f():\n    from hidup.profiler.measure.ops import g\n",
        "hidup.profiler.measure.ops": "from hidup.profiler.measure.device import tf32\n",
        "hidup.profiler.profile": "from hidup.ir import Form\n",
        "hidup.ir": "",
    }
    modules = {}
    for name, src in files.items():
        modules[name] = tmp_path / f"{name}.py"
        modules[name].write_text(src)
    assert _cycles(modules) == [["hidup.profiler.measure.device", "hidup.profiler.measure.ops"]]


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in _modules() if m != "hidup" and _layer(m) is None)
    assert not unplaced, f"modules without a layer (add them to LAYER_OF): {unplaced}"


def test_no_upward_import():
    up = sorted(_upward(_modules()))
    assert not up, (
        "imports that go up a layer ("
        + " -> ".join(LAYERS)
        + "): "
        + ", ".join(f"{a} imports {b} ({_layer(a)} -> {_layer(b)})" for a, b in up)
    )


def test_the_check_fails_on_an_upward_import(tmp_path):
    """The plan importing the search, trace importing codegen and profile data importing the
    measuring harness are found; the same imports pointing down are not."""
    files = {
        "hidup.plan.report": "from hidup.search.api import search\n",
        "hidup.frontend.trace": "def f():\n    from hidup.codegen.duplicate import half\n",
        "hidup.profiler.profile": "from hidup.profiler.measure.device import tf32\n",
        "hidup.search.api": "from hidup.plan.report import summary\n",
        "hidup.codegen.duplicate": "from hidup.frontend.trace import trace_copy\n",
        "hidup.profiler.measure.device": "from hidup.runtime.launch import launch\n",
        "hidup.runtime.launch": "",
    }
    modules = {}
    for name, src in files.items():
        modules[name] = tmp_path / f"{name}.py"
        modules[name].write_text(src)
    assert _upward(modules) == {
        ("hidup.plan.report", "hidup.search.api"),
        ("hidup.frontend.trace", "hidup.codegen.duplicate"),
        ("hidup.profiler.profile", "hidup.profiler.measure.device"),
    }


def test_the_check_sees_imports_inside_functions_and_relative_ones(tmp_path):
    """The resolver finds a function-level absolute import and a relative one."""
    modules = {
        "hidup.search.api": tmp_path / "api.py",
        "hidup.plan": tmp_path / "plan.py",
        "hidup.search.cost": tmp_path / "cost.py",
    }
    src = "def f():\n    from hidup.plan import Plan\n    from .cost import CostModel\n"
    modules["hidup.search.api"].write_text(src)
    assert _imports("hidup.search.api", modules["hidup.search.api"], modules) == {"hidup.plan", "hidup.search.cost"}


def test_exp_is_not_installed():
    """exp/ (the experiment drivers) is imported from the checkout only: outside it, with the library
    installed, no top-level package named ``exp`` exists to shadow another; the library never imports it."""
    import os
    import subprocess
    import sys
    import tempfile

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory() as elsewhere:
        out = subprocess.run(
            [sys.executable, "-c", "import hidup.cli\ntry:\n import exp\nexcept ImportError:\n print('absent')"],
            cwd=elsewhere,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0 and out.stdout.strip() == "absent", out.stdout + out.stderr[-2000:]


# ----------------------------------------------------------------------------- function shape
MAX_LINES = 100  # a function longer than this is split, or says why on the line above its def
MAX_PARAMS = 8  # a public function with more parameters takes an options object, or says why
WHY = "# why:"  # the comment line right above a def (or its decorators) that explains an exception


def _function_shapes(path: Path) -> list[str]:
    """The functions of ``path`` over :data:`MAX_LINES` lines, and its public functions (name without a
    leading underscore; ``self``/``cls`` not counted, keyword-only counted) over :data:`MAX_PARAMS`
    parameters, unless the line above the def (or its first decorator) starts with :data:`WHY`."""
    lines = path.read_text().splitlines()
    found = []
    for node in ast.walk(ast.parse("\n".join(lines), str(path))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        top = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        if top >= 2 and lines[top - 2].strip().startswith(WHY):
            continue
        a = node.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
        if params and params[0].arg in ("self", "cls"):
            params = params[1:]
        length = node.end_lineno - node.lineno + 1
        where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        if length > MAX_LINES:
            found.append(f"{where} has {length} lines")
        if not node.name.startswith("_") and len(params) > MAX_PARAMS:
            found.append(f"{where} takes {len(params)} parameters")
    return found


def test_functions_are_short_and_take_few_parameters():
    """Library functions (exp/ aside) stay under MAX_LINES lines and public ones under MAX_PARAMS
    parameters, or the line above the def says why (``# why: ...``)."""
    found = [f for path in _modules().values() for f in _function_shapes(path)]
    assert not found, (
        f"split these, give them an options object, or say why on the line above the def ({WHY} ...): {found}"
    )


def test_the_shape_check_fails_on_a_long_function_and_respects_why(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    params = ", ".join(f"p{i}" for i in range(MAX_PARAMS + 1))
    src = (
        f"def long():\n{body}\n\n\ndef wide({params}):\n    pass\n\n\n"
        f"{WHY} a spec of nine parts\ndef fine({params}):\n    pass\n"
    )
    path = ROOT / "tests" / "_shape_probe.py"
    try:
        path.write_text(src)
        found = _function_shapes(path)
    finally:
        path.unlink()
    assert [f.split(" ", 1)[1] for f in found] == [
        f"long has {MAX_LINES + 1} lines",
        f"wide takes {MAX_PARAMS + 1} parameters",
    ]


def test_no_command_line_flags_outside_the_cli():
    """Only hidup.cli builds argument parsers: the library takes typed options."""
    found = sorted(
        module
        for module, path in _modules().items()
        if not module.startswith("hidup.cli")
        and any(
            isinstance(n, ast.Attribute)
            and n.attr in ("add_argument", "ArgumentParser", "add_parser")
            or isinstance(n, (ast.Import, ast.ImportFrom))
            and "argparse" in ast.dump(n)
            for n in ast.walk(ast.parse(path.read_text()))
        )
    )
    assert not found, f"modules outside hidup.cli that define command-line flags (move them to hidup/cli/): {found}"


def test_every_error_the_cli_reports_alone_is_a_user_error():
    """One base for the errors the command line turns into one message (hidup.errors.UserError)."""
    from hidup.codegen.graphs import GraphCaptureError
    from hidup.codegen.program import CompileError
    from hidup.errors import UserError
    from hidup.frontend.export import ExportFailure
    from hidup.frontend.trace import TraceFailure
    from hidup.models.source import ModelSourceError
    from hidup.plan import PlanError
    from hidup.profiler import ProfileError
    from hidup.runtime.launch import LaunchError, user_error
    from hidup.runtime.options import CommandError
    from hidup.runtime.peak import PeakError
    from hidup.search import SearchError

    kinds = [GraphCaptureError, CompileError, ExportFailure, TraceFailure, ModelSourceError, PlanError]
    kinds += [ProfileError, LaunchError, CommandError, PeakError, SearchError]
    assert all(issubclass(k, UserError) for k in kinds)
    assert user_error(PlanError("the plan is for another model. Fix: search again")) == (
        "the plan is for another model. Fix: search again"
    )
    assert user_error(RuntimeError("a bug")) is None
