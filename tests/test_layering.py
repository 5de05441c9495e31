"""The import graph follows the layers (emapg/__init__.py): data flows one way, the CLI is the top floor.

Every module's imports are read with ``ast`` -- module-level ones, function-local ones and
``importlib.import_module("literal")`` calls -- and checked against these rules:

* no module under ``trainer/`` imports ``eval`` (the trainer scores with ``tasks``);
* no library module imports an application module (the ``app`` package and every ``*.cli``);
* ``agent`` and ``retriever`` import neither ``trainer`` nor ``eval``;
* ``tasks`` imports none of ``trainer``, ``eval``, ``provision``;
* ``trainer.algo`` (the math) imports nothing of the run: no other ``trainer`` module, nor any package above the core;
* ``provision`` imports neither ``trainer`` nor ``eval``;
* the ``emapg`` core imports none of the packages above it;
* no import circles: the graph of every import between the project's modules (module-level, function-local,
  ``if TYPE_CHECKING:``; a name imported from a module counts as that module) has no cycle;
* the config modules (:data:`CONFIG_MODULES`) import no torch when imported (the closure of their import-time
  imports, following the project's modules and their parent packages), so ``emapg config`` and ``--help``
  stay light.

The checker is tested on a planted tree too, so a rule that silently stopped matching would show.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from emapg import APP_PACKAGE

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("emapg", "tasks", "retriever", "agent", "provision", "trainer", "eval", APP_PACKAGE)

#: Schemas that commands read without training: importing them must not import torch.
CONFIG_MODULES = ("emapg.config", "trainer.config", "trainer.sft.config", "eval.protocols",
                  # the run planner answers before anything heavy loads (`emapg plan`, the check of `emapg train`)
                  "trainer.plan.catalogue", "trainer.plan.memory", "trainer.plan.timing", "trainer.plan.planner",
                  "trainer.plan.compare")
HEAVY = ("torch",)

# (who, must not import, why)
RULES: list[tuple[str, tuple[str, ...], str]] = [
    ("trainer", ("eval",), "the trainer scores with tasks, not with the evaluator"),
    ("agent", ("trainer", "eval"), "the agent loop is below training and evaluation"),
    ("retriever", ("trainer", "eval"), "the retriever is below training and evaluation"),
    ("tasks", ("trainer", "eval", "provision"), "tasks is under both trainer and eval"),
    ("provision", ("trainer", "eval"), "provisioning serves trainer and eval"),
    ("emapg", ("tasks", "retriever", "agent", "provision", "trainer", "eval"), "the core is the ground floor"),
    ("trainer.algo", ("tasks", "retriever", "agent", "provision", "eval"), "the math imports nothing of the run"),
]
#: (package, the only part of its own top-level package it may import, why)
CONFINED: list[tuple[str, str, str]] = [
    ("trainer.algo", "trainer.algo", "the math imports nothing of the run (pure torch)"),
]


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def imports_of(root: Path, path: Path) -> set[str]:
    """Every module name ``path`` imports, wherever the import statement is (module level or a function)."""
    module = _module_name(root, path)
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names if a.name != "*")  # `from emapg import cli`
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__"):
                names.add(node.args[0].value)
    return names


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def is_app_module(name: str) -> bool:
    return _within(name, APP_PACKAGE) or name.rsplit(".", 1)[-1] == "cli"


def violations(root: Path) -> list[str]:
    """Every import of the tree at ``root`` that breaks a rule, as readable lines."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            module = _module_name(root, path)
            imported = imports_of(root, path)
            if not is_app_module(module):
                for name in sorted(imported):
                    if is_app_module(name) and name.split(".")[0] in PACKAGES:
                        found.append(f"{module} imports {name}: library modules never import the application layer")
                for who, banned, why in RULES:
                    if _within(module, who):
                        found += [f"{module} imports {name}: {why}" for name in sorted(imported)
                                  if any(_within(name, b) for b in banned)]
                for who, allowed, why in CONFINED:
                    top = who.split(".")[0]
                    if _within(module, who):
                        found += [f"{module} imports {name}: {why}" for name in sorted(imported)
                                  if _within(name, top) and name != top and not _within(name, allowed)]
    return found


# ---------------------------------------------------------------------------------------- the import graph
def project_modules(root: Path) -> dict[str, Path]:
    """Every module of the project's packages: dotted name -> file."""
    return {_module_name(root, path): path for package in PACKAGES if (root / package).is_dir()
            for path in sorted((root / package).rglob("*.py"))}


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an imported name lives in (``trainer.sampled_batch.SampledBatch`` -> ``trainer.sampled_batch``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the project modules it imports, wherever the import is written."""
    modules = project_modules(root)
    graph = {}
    for module, path in modules.items():
        owners = {_owner(name, modules) for name in imports_of(root, path)}
        graph[module] = {o for o in owners if o is not None and o != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_time_imports(root: Path, path: Path) -> set[str]:
    """What importing ``path`` imports: module-level imports (also in classes, ``try``, ``if``), not those in
    functions or under ``if TYPE_CHECKING:``."""
    module = _module_name(root, path)
    is_package = path.name == "__init__.py"
    names: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                names.add(base)
                names.update(f"{base}.{a.name}" for a in node.names if a.name != "*")
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit([c for c in getattr(node, field, []) if isinstance(c, (ast.stmt, ast.ExceptHandler))])
                if isinstance(node, ast.ExceptHandler):
                    visit(node.body)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)).body)
    return names


def heavy_import_chain(root: Path, start: str, heavy: tuple[str, ...] = HEAVY) -> list[str] | None:
    """The chain of import-time imports from ``start`` to a ``heavy`` package, or None when there is none.
    Importing a module runs its parent packages' ``__init__`` too; third-party modules are not followed."""
    modules = project_modules(root)
    parents: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        module = queue.pop(0)
        path = modules[module]
        package = module.rpartition(".")[0]
        targets = set(import_time_imports(root, path)) | ({package} if package else set())
        for name in sorted(targets):
            owner = _owner(name, modules)
            if owner is None:
                if name.split(".")[0] in heavy:
                    chain, node = [name], module
                    while node is not None:
                        chain.append(node)
                        node = parents[node]
                    return chain[::-1]
                continue
            for step in [owner, *_packages_of(owner)]:
                if step not in parents and step in modules:
                    parents[step] = module
                    queue.append(step)
    return None


def _packages_of(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_the_repository_follows_the_layers():
    assert violations(REPO) == []


def test_the_repository_has_no_import_circles():
    assert circles(import_graph(REPO)) == []


def test_config_modules_import_no_torch():
    for module in CONFIG_MODULES:
        assert heavy_import_chain(REPO, module) is None, " -> ".join(heavy_import_chain(REPO, module))


def test_importing_the_train_config_loads_no_torch():
    """The contract as a user meets it: ``python -c "import trainer.config"`` in a fresh interpreter."""
    code = "import sys, trainer.config, trainer.sft.config; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "[]"


def test_every_package_is_checked():
    for package in PACKAGES:
        assert (REPO / package / "__init__.py").is_file(), package
    listed = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "benchmarks", "scripts", "data"}
    assert listed <= set(PACKAGES), f"a new top-level package needs a place in the layers: {listed - set(PACKAGES)}"


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in PACKAGES:
        (root / package).mkdir(exist_ok=True)
        (root / package / "__init__.py").touch()


def test_the_checker_finds_planted_violations(tmp_path):
    _write(tmp_path, {
        "trainer/step.py": "def f():\n    from eval.runner import run_eval\n",  # function-local
        "trainer/sub/__init__.py": "",
        "trainer/sub/deep.py": "from ...eval import report\n",  # relative, two levels up
        "agent/loop.py": "import trainer.algo.grpo as g\n",
        "retriever/x.py": "import importlib\nm = importlib.import_module('eval.protocols')\n",
        "tasks/qa.py": "from provision import retrievers\n",
        "provision/eng.py": "from trainer import loop\n",
        "emapg/paths.py": "from tasks import datasets\n",
        "eval/runner.py": "from app import cli\n",  # an application module through `from package import`
        "tasks/math.py": "def g():\n    from app.demo import run_demo\n",
        "agent/engines/server.py": "from retriever.cli import serve_main\n",  # another package's CLI
        # allowed: application modules import anything, libraries import what is below them
        "app/cli.py": "import importlib\nimportlib.import_module('eval.cli')\nfrom trainer import loop\n",
        "eval/cli.py": "from eval.runner import run_eval\nfrom app.demo import x\n",
        "trainer/data.py": "from tasks.datasets import load_dataset\nfrom .batch import x\n",
        "trainer/algo/__init__.py": "",
        "trainer/algo/kinds.py": "from trainer.algo.kl import x\nfrom trainer import algo\n",  # allowed: the math itself
        "trainer/algo/grpo.py": "from trainer.distributed import all_reduce_sum\n",
        "trainer/algo/kl.py": "from ..config import KLConfig\n",
        "eval/report.py": "from tasks.qa import qa_scores\nfrom provision.indexes import y\n",
    })
    found = violations(tmp_path)
    expected = [
        "trainer.step imports eval.runner",
        "trainer.sub.deep imports eval",
        "agent.loop imports trainer.algo.grpo",
        "retriever.x imports eval.protocols",
        "tasks.qa imports provision",
        "provision.eng imports trainer",
        "emapg.paths imports tasks",
        "eval.runner imports app.cli",
        "tasks.math imports app.demo",
        "agent.engines.server imports retriever.cli",
        "trainer.algo.grpo imports trainer.distributed",
        "trainer.algo.kl imports trainer.config",
    ]
    for line in expected:
        assert any(f.startswith(line + ":") for f in found), (line, found)
    # the allowed imports are not reported: exactly the planted offenders are
    assert {f.split(" imports ")[0] for f in found} == {line.split(" imports ")[0] for line in expected}, found


def test_the_checker_finds_planted_circles_and_heavy_configs(tmp_path):
    _write(tmp_path, {
        "trainer/loop.py": "from trainer.pipeline import RolloutPipeline\n",
        "trainer/pipeline.py": "def f():\n    from trainer.loop import step_seed\n",  # function-local closes it
        "trainer/config.py": "from typing import TYPE_CHECKING\nfrom trainer import kinds\nif TYPE_CHECKING:\n    import torch\n",
        "trainer/kinds.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainer.config import KLConfig\n",
        "trainer/sft/config.py": "class C:\n    from trainer.math import x\n",  # a class body runs at import
        "trainer/math.py": "try:\n    import torch.nn as nn\nexcept ImportError:\n    nn = None\n",
        "emapg/config.py": "def lazy():\n    import torch\n",  # only when called: allowed
        "eval/protocols.py": "import json\n",
        "eval/__init__.py": "from eval.heavy import x\n",  # a parent package's __init__ runs too
        "eval/heavy.py": "import torch\n",
        "retriever/a.py": "import retriever.b\n",
        "retriever/b.py": "from retriever import c\n",
        "retriever/c.py": "from .a import f\n",
    })
    assert circles(import_graph(tmp_path)) == [
        ["retriever.a", "retriever.b", "retriever.c"],
        ["trainer.config", "trainer.kinds"],
        ["trainer.loop", "trainer.pipeline"],
    ]
    assert heavy_import_chain(tmp_path, "trainer.config") is None  # TYPE_CHECKING only
    assert heavy_import_chain(tmp_path, "trainer.sft.config") == ["trainer.sft.config", "trainer.math", "torch.nn"]
    assert heavy_import_chain(tmp_path, "emapg.config") is None
    assert heavy_import_chain(tmp_path, "eval.protocols") == ["eval.protocols", "eval", "eval.heavy", "torch"]
