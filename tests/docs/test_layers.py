"""The package's floor plan, read from its imports: no module imports itself back through
others (no import circle), and every import between folders runs down the layers below.
Function-level imports count as much as module-level ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "prepos"

# top to bottom: a folder may import its own modules and those of the folders below it
LAYERS = (
    ("face",),  # prepos/__init__.py (the public names) and cli.py (the command table)
    ("server",),
    ("lab", "sim"),  # tools apart: neither imports the other
    ("engine",),
    ("gate",),
    ("decode",),
    ("worker",),
    ("chat", "backends"),
    ("leaf",),  # plain data and helpers at the package root: config, core, errors, ...
)
RANK = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def modules(root: Path = SRC) -> dict[str, Path]:
    out = {}
    for f in root.rglob("*.py"):
        parts = ("prepos", *f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports (`from pkg import mod` counts as `pkg.mod`)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(name, path, known) for name, path in mods.items()}


def room(module: str) -> str:
    parts = module.split(".")
    if module in ("prepos", "prepos.cli"):
        return "face"
    if len(parts) > 2 or (SRC / parts[1]).is_dir():
        return parts[1]
    return "leaf"


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
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
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def upward(g: dict[str, set[str]], rank_of=room) -> list[str]:
    """Imports that run up the layers, or across between two rooms of one layer."""
    bad = []
    for a, targets in g.items():
        for b in targets:
            ra, rb = rank_of(a), rank_of(b)
            if ra != rb and RANK[ra] >= RANK[rb]:
                bad.append(f"{a} ({ra}) -> {b} ({rb})")
    return sorted(bad)


def test_every_module_is_in_a_room_of_the_plan():
    assert {room(m) for m in graph()} <= set(RANK)


def test_no_import_circles():
    assert circles(graph()) == []


def test_every_import_between_folders_runs_down():
    assert upward(graph()) == []


@pytest.mark.parametrize("g, circle, up", [
    ({"prepos.engine.a": {"prepos.worker.b"}, "prepos.worker.b": set()}, False, False),
    ({"prepos.worker.b": {"prepos.engine.a"}, "prepos.engine.a": set()}, False, True),
    ({"prepos.chat.x": {"prepos.chat.y"}, "prepos.chat.y": {"prepos.chat.x"}}, True, False),
    ({"prepos.lab.x": {"prepos.sim.y"}, "prepos.sim.y": set()}, False, True),
])
def test_the_checks_see_what_they_look_for(g, circle, up):
    """The two checks above on made-up graphs: a circle and an upward arrow are found."""
    def rank_of(m: str) -> str:
        return m.split(".")[1]

    assert bool(circles(g)) is circle
    assert bool(upward(g, rank_of)) is up


def test_the_architecture_doc_names_every_module_within_300_lines():
    doc = (SRC.parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    assert len(doc.splitlines()) <= 300
    missing = [f"{m}" for m, f in modules().items()
               if f.name != "__init__.py" and f"`{f.name}`" not in doc
               and f"{f.parent.name}/{f.name}" not in doc]
    assert missing == []


def test_no_source_file_over_450_lines():
    assert [m for m, f in modules().items() if len(f.read_text().splitlines()) > 450] == []


def test_the_server_reaches_the_engine_not_what_runs_under_it():
    """server/ uses the engine, the streams it returns, the chat formats and the leaf; never
    the worker, the gate or a back end directly."""
    below = {m for rooms in LAYERS[LAYERS.index(("engine",)) + 1:] for m in rooms} - {"leaf"}
    allowed = {"prepos.decode.stream"} | {m for m in graph() if room(m) == "chat"}
    reached = {b for a, targets in graph().items() if room(a) == "server" for b in targets
               if room(b) in below and b not in allowed}
    assert reached == set()


def engine_reads(root: Path = SRC / "server") -> dict[str, list[str]]:
    """Every attribute server/ reads off an engine (`eng.x`, `engine.x`, `<...>.engine.x`),
    with where."""
    found: dict[str, list[str]] = {}
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            v = node.value
            if (isinstance(v, ast.Name) and v.id in ("eng", "engine")) or \
                    (isinstance(v, ast.Attribute) and v.attr == "engine"):
                found.setdefault(node.attr, []).append(f"{f.relative_to(SRC)}:{node.lineno}")
    return found


def test_the_server_reads_the_engine_through_its_public_api_only():
    """The engine's methods and properties (`Engine`, its read-only `EngineView`) and the
    plain fields `prepos.engine.view.FIELDS`: never the scheduler, the KV pool, the
    pre-positioner or the back end behind them."""
    from prepos.engine import Engine
    from prepos.engine.view import FIELDS

    public = {n for cls in Engine.__mro__ for n in vars(cls) if not n.startswith("_")}
    reads = engine_reads()
    assert "snapshot" in reads and "turn" in reads  # the scan sees what it looks for
    assert {n: at for n, at in reads.items() if n not in public | set(FIELDS)} == {}


def test_the_server_imports_only_the_engines_public_names():
    """server/ imports `prepos.engine` (its `__all__`), never a module beneath it."""
    import prepos.engine

    found = []
    for f in sorted((SRC / "server").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prepos.engine"):
                if node.module != "prepos.engine":
                    found.append(f"{f.relative_to(SRC)}:{node.lineno} {node.module}")
                else:
                    found += [f"{f.relative_to(SRC)}:{node.lineno} {a.name}" for a in node.names
                              if a.name not in prepos.engine.__all__]
            elif isinstance(node, ast.Import):
                found += [f"{f.relative_to(SRC)}:{node.lineno} {a.name}" for a in node.names
                          if a.name.startswith("prepos.engine.")]
    assert found == []


def test_the_store_imports_nothing_of_http():
    """server/store/ keeps state (the journal, leases, records, stored responses): HTTP's
    shapes, statuses and middleware stay in server/http/, which reads the store."""
    found = []
    for f in sorted((SRC / "server" / "store").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{f.relative_to(SRC)}:{node.lineno} {n}" for n in names
                      if n.startswith(("prepos.server.http", "prepos.server.openai",
                                       "prepos.server.anthropic", "starlette", "fastapi"))]
    assert found == []


def test_a_conversation_sent_whole_is_dispatched_in_one_place():
    """Chat completions, Messages and Responses each translate their body into a
    `ConversationRequest` and hand it to the flow: the checks of a conversation's messages,
    the hop to the node that keeps it (`converse`) and the choice of stateless, streaming or
    agentic (`answer`) are made there alone, not copied per API."""
    calls: dict[str, list[str]] = {name: [] for name in (
        "check_input", "hop", "stateless", "streaming", "agentic", "ConversationRequest")}
    for f in sorted((SRC / "server").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name in calls:
                    calls[name].append(str(f.relative_to(SRC)))
    assert calls["hop"] == ["server/openai/flow.py"]
    for kind in ("stateless", "streaming", "agentic"):  # `flow.answer`, whichever API sent it
        assert calls[kind] == ["server/openai/flow.py"], kind
    assert sorted(calls["ConversationRequest"]) == [
        "server/anthropic/routes.py", "server/openai/responses.py", "server/openai/routes.py"]
    assert calls["check_input"].count("server/anthropic/routes.py") == 1  # count_tokens'
    assert calls["check_input"].count("server/openai/routes.py") == 1  # completions' prompts
