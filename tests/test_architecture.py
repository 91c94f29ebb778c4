"""The package's floors (docs/architecture.md): every import of a trireme module goes to the same
floor or one below, no two files import each other (directly or around a loop), and no import of
a trireme module hides inside a function. Imports under `if TYPE_CHECKING:` are annotations only
and do not count. Parsed from the source (nothing is imported), so a failure names the file."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trireme"

# Floors, lowest first. A module's floor is that of its longest listed prefix.
FLOORS = [
    ("trireme", "trireme.errors", "trireme.words"),
    ("trireme.config",),
    ("trireme.data",),
    ("trireme.ops",),
    ("trireme.parallel",),
    ("trireme.models",),
    ("trireme.parallel.layout",),  # asks the models' stage split and vision encoder
    ("trireme.optim",),
    ("trireme.step",),
    ("trireme.checkpoint",),
    ("trireme.convert",),
    ("trireme.metrics", "trireme.oom", "trireme.cpu_threads"),
    ("trireme.plan",),
    ("trireme.serving",),
    ("trireme.training",),
    ("trireme.cli", "trireme.commands", "trireme.__main__"),
]

# Third-party or platform modules that may be missing, so they are imported where used (the
# trireme.ops.*_triton modules import Triton at their top).
OPTIONAL = ("torchao", "triton", "torch.utils.tensorboard", "tensorboard", "tiktoken",
            "sentencepiece", "zstandard", "pyarrow", "resource", "fcntl", "megatron",
            "trireme.ops.swiglu_triton", "trireme.ops.moe_permute_triton",
            "trireme.ops.accumulate_triton", "wandb", "trireme.ops.paged_attention_triton",
            "uvicorn", "fastapi", "jinja2", "trireme.serving.server", "mamba_ssm",
            "causal_conv1d", "trireme.ops.ssd_triton", "PIL", "flash_attn",
            "liger_kernel", "trireme.ops.cross_entropy_triton",
            "trireme.ops.argmax_triton", "trireme.ops.skinny_gemm_triton")


def module_files() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def floor(module: str) -> int:
    best, level = -1, None
    for i, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    assert level is not None, f"{module} is on no floor: add it to FLOORS"
    return level


def _targets(module: str, node: ast.Import | ast.ImportFrom, files: dict[str, Path]) -> list[str]:
    """The modules an import statement reads (a `from package import module` names the module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        if files[module].name != "__init__.py":
            parts = parts[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]


def _owner(target: str, files: dict[str, Path]) -> str:
    while target not in files and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def scan() -> tuple[dict[str, set[str]], list[str], list[str]]:
    """(module -> trireme modules it imports, function-level imports, optional-dependency ones)."""
    files = module_files()
    edges: dict[str, set[str]] = {m: set() for m in files}
    hidden, optional = [], []

    def visit(module: str, node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = _targets(module, child, files)
                where = f"{files[module].relative_to(PACKAGE.parent)}:{child.lineno}"
                for target in targets:
                    if in_function and target.startswith(OPTIONAL):
                        optional.append(f"{where}: {ast.unparse(child)}")
                    elif target.split(".")[0] == "trireme":
                        edges[module].add(_owner(target, files))
                        if in_function:
                            hidden.append(f"{where}: {ast.unparse(child)}")
                    elif in_function:
                        hidden.append(f"{where}: {ast.unparse(child)}")
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            visit(module, child, inner)

    for module, path in files.items():
        visit(module, ast.parse(path.read_text(), str(path)), False)
    for module in edges:
        edges[module].discard(module)
    return edges, hidden, optional


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each as a loop path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return groups


def test_no_import_cycles():
    edges, _, _ = scan()
    cycles = find_cycles(edges)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_imports_go_down():
    edges, _, _ = scan()
    upward = [f"{m} -> {t}" for m, targets in sorted(edges.items()) for t in sorted(targets)
              if floor(t) > floor(m)]
    assert not upward, "imports from a lower floor up: " + "; ".join(upward)


def test_no_hidden_imports():
    _, hidden, _ = scan()
    assert not hidden, "imports inside functions (not optional dependencies): " + "; ".join(hidden)


CONFIG_NAMES = ("cfg", "config")  # the names a Config goes by


def config_writes(source: str, where: str) -> list[str]:
    """Assignments (plain, augmented, annotated, or setattr) to a field of a config section,
    `cfg.<section>.<field> = ...`: a loaded Config is never written again (a resolved copy is made
    with dataclasses.replace instead)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "setattr" and node.args):
            targets = [ast.Attribute(node.args[0], "?", ast.Store())]
        else:
            continue
        flat = []
        for target in targets:
            flat += target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
        for target in flat:
            chain, depth = target, 0
            while isinstance(chain, ast.Attribute):
                chain, depth = chain.value, depth + 1
            if isinstance(chain, ast.Name) and chain.id in CONFIG_NAMES and depth >= 2:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return found


def test_no_module_writes_a_config_field():
    writes = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent)
        if relative.parts[1] != "config":  # the config package builds configs
            writes += config_writes(path.read_text(), str(relative))
    assert not writes, "writes to a loaded config: " + "; ".join(writes)


def test_the_config_check_catches_each_kind_of_write():
    source = ("cfg.train.micro_batch_size = 4\ncfg.model.vocab_size += 1\n"
              "config.data.path, x = 'a', 1\nsetattr(cfg.train, 'steps', 2)\n"
              "cfg.model = other\nm.vocab_size = 3\nnew = replace(cfg.train, steps=2)\n")
    assert [w.split(": ", 1)[0] for w in config_writes(source, "x.py")] == [
        "x.py:1", "x.py:2", "x.py:3", "x.py:4"]


def test_the_checks_catch_a_cycle_and_an_upward_import():
    edges = {"trireme.models.a": {"trireme.step.b"}, "trireme.step.b": {"trireme.models.a"}}
    assert find_cycles(edges) == [["trireme.models.a", "trireme.step.b"]]
    assert floor("trireme.step.b") > floor("trireme.models.a")


# --------------------------------------------------------------------------------------------
# Environment variables: every one the package reads or sets is listed in trireme/environment.py
# (and printed by `trireme config-doc`); its own settings are config keys and flags.

ENVIRON_METHODS = {"get": "read", "setdefault": "set", "pop": "set"}


def _names(key: ast.expr, parents: dict[ast.AST, ast.AST]) -> list[str] | None:
    """The variable names a key expression stands for: a string, or the loop variable of an
    enclosing comprehension over a literal tuple / list of strings; None when computed."""
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return [key.value]
    node = key
    while isinstance(key, ast.Name) and node in parents:
        node = parents[node]
        for gen in getattr(node, "generators", []):
            if (isinstance(gen.target, ast.Name) and gen.target.id == key.id
                    and isinstance(gen.iter, (ast.Tuple, ast.List))
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                            for e in gen.iter.elts)):
                return [e.value for e in gen.iter.elts]
    return None


def _environ_use(node: ast.AST, parents: dict[ast.AST, ast.AST]
                 ) -> tuple[str, ast.expr | None] | None:
    """("read" / "set", the key expression) of one use of os.environ / os.getenv / os.putenv,
    ("other", None) for any other use of them, None for a node that is none of them."""
    if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "os" and node.attr in ("environ", "getenv", "putenv")):
        return None
    up = parents.get(node)
    call = parents.get(up) if isinstance(up, ast.Attribute) else up
    if node.attr != "environ":  # os.getenv(key) / os.putenv(key, value)
        if isinstance(up, ast.Call) and up.func is node and up.args:
            return ("read" if node.attr == "getenv" else "set"), up.args[0]
    elif isinstance(up, ast.Attribute) and up.attr in ENVIRON_METHODS:
        if isinstance(call, ast.Call) and call.func is up and call.args:
            return ENVIRON_METHODS[up.attr], call.args[0]
    elif isinstance(up, ast.Subscript) and up.value is node:
        return ("read" if isinstance(up.ctx, ast.Load) else "set"), up.slice
    elif (isinstance(up, ast.Compare) and len(up.ops) == 1 and up.comparators[0] is node
          and isinstance(up.ops[0], (ast.In, ast.NotIn))):
        return "read", up.left
    return "other", None


def environment_uses(sources: dict[str, str]) -> tuple[dict[str, set[str]], list[str]]:
    """({"read": names, "set": names}, the uses no name can be read from: a computed key, the
    environment handed on whole, `from os import environ`) of the sources (where -> text)."""
    found: dict[str, set[str]] = {"read": set(), "set": set()}
    unclear = []
    for where, text in sources.items():
        tree = ast.parse(text, where)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                    a.name in ("environ", "getenv", "putenv") for a in node.names):
                unclear.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            use = _environ_use(node, parents)
            if use is None:
                continue
            kind, key = use
            names = _names(key, parents) if key is not None else None
            if kind == "other" or names is None:
                unclear.append(f"{where}:{node.lineno}: {ast.unparse(parents.get(node, node))}")
            else:
                found[kind].update(names)
    return found, unclear


def package_environment_uses() -> tuple[dict[str, set[str]], list[str]]:
    return environment_uses({str(path.relative_to(PACKAGE.parent)): path.read_text()
                             for path in sorted(PACKAGE.rglob("*.py"))})


def test_the_package_reads_only_the_listed_environment_variables():
    """No setting of trireme's own hides in an environment variable (issue 41): every variable
    read is one of trireme.environment.READ (the launcher's and the system's, and
    TRIREME_API_KEY), every one set is in SET, and each listed one is used (the list, printed
    in docs/config.md, stays true)."""
    from trireme import environment

    found, unclear = package_environment_uses()
    assert not unclear, "environment uses that name no variable: " + "; ".join(unclear)
    assert found["read"] <= set(environment.READ), found["read"] - set(environment.READ)
    assert found["set"] <= set(environment.SET), found["set"] - set(environment.SET)
    assert found["read"] == set(environment.READ) and found["set"] == set(environment.SET)
    assert [v for v in found["read"] if v.startswith("TRIREME_")] == ["TRIREME_API_KEY"]


def test_the_environment_scan_catches_every_kind_of_read():
    source = """
import os, subprocess
a = os.environ.get("A", "1")
b = os.getenv("B")
c = "C" in os.environ and os.environ["D"]
missing = [v for v in ("E", "F") if v not in os.environ]
os.environ.setdefault("S", "1")
os.environ["T"] = "2"
name = "G"
g = os.environ.get(name)
subprocess.run(["true"], env=os.environ)
"""
    found, unclear = environment_uses({"x.py": source})
    assert found == {"read": {"A", "B", "C", "D", "E", "F"}, "set": {"S", "T"}}
    assert [u.split(":")[1] for u in unclear] == ["10", "11"]
    _, unclear = environment_uses({"y.py": "from os import environ\nx = environ['A']\n"})
    assert unclear == ["y.py:1: from os import environ"]


if __name__ == "__main__":  # the figures for a note: cycles, upward, hidden imports, longest
    edges, hidden, optional = scan()
    up = sum(floor(t) > floor(m) for m, ts in edges.items() for t in ts)
    print(f"cycles {len(find_cycles(edges))}, upward {up}, hidden {len(hidden)}, "
          f"optional-dependency {len(optional)}")
    longest = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                longest.append((node.end_lineno - node.lineno + 1, f"{path.name}:{node.name}"))
    print("longest functions:", sorted(longest, reverse=True)[:5])
