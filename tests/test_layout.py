"""The house's layout: every dependency between the project's modules runs one way (no import circles, counting the
imports inside functions too), and the rollout folder keeps each job in its own place."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "sse_model", "kernels", "pipeline", "rewards", "eval")


def module_imports() -> dict[str, set[str]]:
    """Each project module and the project modules it imports anywhere in its body; a submodule's use of its own
    package's ``__init__`` (a helper defined there) is not a dependency back up."""
    files = {}
    for path in (p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                found = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in found:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    targets.add(target)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    graph = module_imports()
    # the graph sees imports inside functions: the kernels' registration and the chunk plan, one way each
    assert "sse_model.ops.dispatch" in graph["kernels.backend"] and "kernels.plan" in graph["kernels.sse_chunk"]
    assert cycles(graph) == []


def test_cycle_finder_finds_a_circle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_rollout_folder_keeps_one_job_per_place():
    """The engine at the top of ``pipeline/rollout``; vLLM integration in its folder."""
    top = {p.stem for p in (ROOT / "pipeline" / "rollout").glob("*.py")}
    assert not {name for name in top if name.startswith(("vllm", "bench", "profile"))}, top
    assert {"engine", "sampling", "actor", "weight_sync"} <= top
    assert (ROOT / "pipeline" / "rollout" / "vllm" / "plugin.py").exists()


# which package may import which (the design's layers): shared helpers and the model at the bottom, kernels
# registering into its dispatch, rewards and evaluation as libraries, the pipeline on top; benchmarks and scripts
# may use them all
LAYERS = {"common": set(), "sse_model": {"common"}, "kernels": {"common", "sse_model"}, "rewards": {"common"},
          "eval": {"common", "sse_model", "rewards"}, "pipeline": {"common", "sse_model", "kernels", "rewards", "eval"}}


def package_imports(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """``(package, package it imports)`` -> the module pairs behind it."""
    found: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = module.split(".")[0], target.split(".")[0]
            if a != b:
                found.setdefault((a, b), []).append((module, target))
    return found


def test_packages_import_only_down_their_layers():
    uphill = {pair: modules for pair, modules in package_imports(module_imports()).items()
              if pair[1] not in LAYERS[pair[0]]}
    assert uphill == {}, uphill
    assert cycles({p: LAYERS[p] for p in LAYERS}) == []


def test_the_package_ships_no_benchmark_or_script():
    """Benchmarks and experiment runners live in ``benchmarks/`` and ``scripts/``, outside the installed packages,
    and no library module imports them."""
    import tomllib

    shipped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not [p for p in shipped if p.startswith(("benchmarks", "scripts"))]
    stray = [str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
             if p.parent.name in ("bench", "benchmarks") or p.stem.startswith(("bench_", "profile_"))]
    assert stray == []
    for module, targets in module_imports().items():
        assert not [t for t in targets if t.startswith(("benchmarks", "scripts"))], module
    assert (ROOT / "benchmarks" / "rollout" / "benchmark.py").exists() and (ROOT / "scripts" / "sweep.py").exists()


def test_the_run_loop_is_short_and_no_engine_class_is_long():
    """Each stage lives in its own module behind one interface, so the run loop is a loop; the rollout engine is split
    as vLLM splits it (scheduler, model runner, cache, engine), no class of it over 300 lines."""
    assert len((ROOT / "pipeline" / "run.py").read_text().splitlines()) <= 200
    for path in (ROOT / "pipeline" / "rollout").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno + 1 <= 300, (path.name, node.name)
    from pipeline.stages import STAGES
    from pipeline.stages.base import Stage

    assert list(STAGES) == ["align", "distill", "grpo", "eval"]
    assert all(type(s).run is not Stage.run and type(s).highlight is not Stage.highlight for s in STAGES.values())


def test_no_installed_distribution_but_this_one_provides_kernels():
    """The project's Triton kernels are the top-level package ``kernels``, the import name of Hugging Face's kernel hub
    too; transformers imports that one when it is installed and fails on ours, deep inside ``import transformers``.
    The pin on transformers keeps it out (5.25 requires it): an install that brings it back fails here, by name."""
    providers = set(importlib.metadata.packages_distributions().get("kernels", ()))
    assert providers <= {"sse-pipeline"}, (
        f"{sorted(providers - {'sse-pipeline'})} also installs a top-level 'kernels' package, which shadows or is "
        "shadowed by this project's kernels/: pip uninstall it (transformers >= 5.25 requires it: keep "
        "transformers < 5.25)")


def test_a_worker_that_reads_a_recipe_or_evaluates_imports_no_trainer():
    """A Ray worker unpickles a recipe (``pipeline.recipe``), and evaluation's generation and scoring workers import
    ``pipeline.stages.evaluate``: neither loads the rollout engine's kernels, nor a trainer, nor the other stages
    (the packages' ``__init__`` imported them all, seconds of every worker's start)."""
    import subprocess
    import sys

    heavy = ("torch", "triton", "trl", "transformers.trainer", "pipeline.rollout.engine", "pipeline.stages.align",
             "pipeline.stages.distill", "pipeline.stages.grpo")
    for module, allowed in (("pipeline.recipe", ()), ("pipeline.stages.evaluate", ("torch", "triton"))):
        probe = f"import sys, {module}; print(' '.join(m for m in {heavy!r} if m in sys.modules))"
        loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
        assert set(loaded.stdout.split()) - set(allowed) == set(), (module, loaded.stdout)
