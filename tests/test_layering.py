"""The import graph follows the layers (emapg/__init__.py): data flows one way, the CLI is the top floor.

Every module's imports are read with ``ast`` -- module-level ones, function-local ones and
``importlib.import_module("literal")`` calls -- and checked against these rules:

* no module under ``trainer/`` imports ``eval`` (the trainer scores with ``tasks``);
* no library module imports an application module (the ``app`` package and every ``*.cli``);
* ``agent`` and ``retriever`` import neither ``trainer`` nor ``eval``;
* ``tasks`` imports none of ``trainer``, ``eval``, ``provision``;
* ``provision`` imports neither ``trainer`` nor ``eval``;
* the ``emapg`` core imports none of the packages above it.

The checker is tested on a planted tree too, so a rule that silently stopped matching would show.
"""

from __future__ import annotations

import ast
from pathlib import Path

from emapg import APP_PACKAGE

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("emapg", "tasks", "retriever", "agent", "provision", "trainer", "eval", APP_PACKAGE)

# (who, must not import, why)
RULES: list[tuple[str, tuple[str, ...], str]] = [
    ("trainer", ("eval",), "the trainer scores with tasks, not with the evaluator"),
    ("agent", ("trainer", "eval"), "the agent loop is below training and evaluation"),
    ("retriever", ("trainer", "eval"), "the retriever is below training and evaluation"),
    ("tasks", ("trainer", "eval", "provision"), "tasks is under both trainer and eval"),
    ("provision", ("trainer", "eval"), "provisioning serves trainer and eval"),
    ("emapg", ("tasks", "retriever", "agent", "provision", "trainer", "eval"), "the core is the ground floor"),
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
    return found


def test_the_repository_follows_the_layers():
    assert violations(REPO) == []


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
        "agent/loop.py": "import trainer.grpo as g\n",
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
        "eval/report.py": "from tasks.qa import qa_scores\nfrom provision.indexes import y\n",
    })
    found = violations(tmp_path)
    expected = [
        "trainer.step imports eval.runner",
        "trainer.sub.deep imports eval",
        "agent.loop imports trainer.grpo",
        "retriever.x imports eval.protocols",
        "tasks.qa imports provision",
        "provision.eng imports trainer",
        "emapg.paths imports tasks",
        "eval.runner imports app.cli",
        "tasks.math imports app.demo",
        "agent.engines.server imports retriever.cli",
    ]
    for line in expected:
        assert any(f.startswith(line + ":") for f in found), (line, found)
    # the allowed imports are not reported: exactly the planted offenders are
    assert {f.split(" imports ")[0] for f in found} == {line.split(" imports ")[0] for line in expected}, found
