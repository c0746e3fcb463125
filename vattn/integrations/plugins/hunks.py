"""A release's patch (`patches/<engine>-<version>.patch`) applied in memory, function by
function, to the engine as imported: the plugin's hooks are the patch's hunks.

```
 patch hunk (file, line)  ──AST of the installed file──▶  the innermost def holding it
 every hunk of that def   ──applied to the whole file──▶  patched file text (linecache)
 the def's node there     ──compiled in the module──────▶  new function, set on its owner
```

Three kinds of hunk, by where the first changed line stands in the installed file:
- inside a `def` (a method or a module function): the function is compiled again from the
  patched text, with its decorators, in its module's globals, and replaces the original on
  its class or module (and on every loaded module that imported it by name);
- at module level: only `import`/`from ... import` of vattn modules, run in the module;
- in a class body outside any `def`: only `name: type = value` lines, set as class
  attributes (a dataclass field's default: the patch's new field).

Each hooked function (class, for attributes) is fingerprinted: the sha256 of its source
as installed, which must equal the one recorded for the release (`releases.py`). The
whole patch is planned and compiled first; nothing is installed unless every hunk fits.
"""
from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import linecache
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vattn.errors import HookError  # (re-exported: it was defined here)


@dataclass(frozen=True)
class Hunk:
    """One `@@` hunk: its file, the line it starts at in the original, and its lines
    (each with its ' ', '-' or '+' prefix)."""

    path: str
    old_start: int
    lines: tuple[str, ...]

    def changes(self) -> list[tuple[int, str]]:
        """(original line, text) of every '-' line and every '+' line (the line it goes before)."""
        out, line = [], self.old_start
        for t in self.lines:
            if t[0] == "+":
                if t[1:].strip():  # a blank added line says nothing of where it belongs
                    out.append((line, t))
            else:
                if t[0] == "-":
                    out.append((line, t))
                line += 1
        return out

    @property
    def added(self) -> list[str]:
        return [t[1:] for t in self.lines if t[:1] == "+"]


def parse(text: str) -> list[Hunk]:
    """The hunks of a unified diff (`+++ b/<path>` headers, `@@ -a,b +c,d @@` hunks)."""
    hunks: list[Hunk] = []
    path = None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("+++ "):
            path = re.sub(r"^b/", "", line[4:].split("\t")[0].strip())
        elif line.startswith("@@ ") and path is not None:
            m = re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,(\d+))? @@", line)
            if not m:
                raise HookError(f"malformed hunk header {line!r}")
            old_left = int(m.group(2) or 1)
            new_left = int(m.group(3) or 1)
            body: list[str] = []
            i += 1
            while i < len(lines) and (old_left > 0 or new_left > 0):
                t = lines[i] if lines[i] else " "
                if t.startswith("\\"):  # "\ No newline at end of file"
                    i += 1
                    continue
                body.append(t)
                old_left -= t[0] in " -"
                new_left -= t[0] in " +"
                i += 1
            hunks.append(Hunk(path, int(m.group(1)), tuple(body)))
            continue
        i += 1
    return hunks


def apply_to_text(lines: list[str], hunks: list[Hunk]) -> list[str]:
    """`lines` (a whole file) with `hunks` applied, exactly: every context and removed
    line must stand where the hunk says (no offset, no fuzz). HookError otherwise."""
    out: list[str] = []
    pos = 0  # next original line (0-based) not yet copied
    for h in sorted(hunks, key=lambda h: h.old_start):
        start = h.old_start - 1 if any(t[0] in " -" for t in h.lines) else h.old_start
        if start < pos:
            raise HookError(f"{h.path}: overlapping hunks at line {h.old_start}")
        out.extend(lines[pos:start])
        pos = start
        for t in h.lines:
            if t[0] == "+":
                out.append(t[1:])
                continue
            if pos >= len(lines) or lines[pos].rstrip("\n") != t[1:]:
                got = lines[pos].rstrip("\n") if pos < len(lines) else "<end of file>"
                raise HookError(f"{h.path}:{pos + 1}: expected {t[1:]!r}, found {got!r}")
            if t[0] == " ":
                out.append(lines[pos].rstrip("\n"))
            pos += 1
    out.extend(x.rstrip("\n") for x in lines[pos:])
    return out


def fingerprint(source: str) -> str:
    """The first 16 hex digits of the sha256 of `source` (a function or class as installed)."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _defs(tree: ast.AST) -> list[tuple[str, ast.AST, list[ast.AST]]]:
    """(qualname, node, enclosing nodes) of every def and class, outermost first."""
    out: list[tuple[str, ast.AST, list[ast.AST]]] = []

    def walk(node: ast.AST, prefix: str, chain: list[ast.AST]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                q = f"{prefix}{child.name}"
                out.append((q, child, chain))
                walk(child, q + ".", chain + [child])
            elif not isinstance(child, (ast.expr,)):
                walk(child, prefix, chain)

    walk(tree, "", [])
    return out


def _span(node: ast.AST) -> tuple[int, int]:
    """First and last line of a def or class, its decorators included."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first, node.end_lineno


@dataclass
class Hook:
    """The hunks of one function (kind "function"), one module's imports ("import") or one
    class body's new attributes ("attribute"), and what installing them means."""

    module: str
    qualname: str  # "" for "import"
    kind: str
    hunks: list[Hunk] = field(default_factory=list)
    fingerprint: str = ""
    new: Any = None  # the compiled function, or {name: value} for "attribute", or code for "import"

    @property
    def name(self) -> str:
        """`module:qualname`, the key of the release's fingerprint table."""
        return f"{self.module}:{self.qualname}" if self.qualname else f"{self.module}:<imports>"


def _module_name(path: str) -> str:
    return path[:-3].replace("/", ".") if path.endswith(".py") else path.replace("/", ".")


def _source_file(module: str, root: Path | None = None) -> Path:
    """The installed source of `module` (or its file under `root`, a tree holding the package)."""
    if root is not None:
        return Path(root, *module.split(".")).with_suffix(".py")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise HookError(f"module {module} is not installed as Python source")
    return Path(spec.origin)


def plan(patch_text: str, root: Path | None = None) -> list[Hook]:
    """The hooks of a patch against the installed engine (or the tree under `root`): each
    hunk placed, each hooked function fingerprinted and compiled from the patched text.
    Imports nothing of the engine but its packages (to find the files). HookError when a
    hunk does not fit."""
    by_file: dict[str, list[Hunk]] = {}
    for h in parse(patch_text):
        by_file.setdefault(h.path, []).append(h)
    hooks: list[Hook] = []
    for path, hunks in by_file.items():
        hooks += _plan_file(_module_name(path), hunks, root)
    return hooks


def fingerprints(patch_text: str, root: Path | None = None) -> dict[str, str]:
    """{hook name: fingerprint} of a patch's hooked functions and classes (`releases.py`'s table)."""
    return {h.name: h.fingerprint for h in plan(patch_text, root) if h.kind != "import"}


def _holder(defs: list, line: int, text: str) -> tuple[str, ast.AST | None, str]:
    """(qualname, node, kind) of what a changed line at original `line` belongs to: the
    innermost def (kind "function"), else the innermost class ("attribute"), else the
    module ("import"). An added line belongs to the def before it when indented deeper."""
    holders = [(q, n) for q, n, _ in defs if _span(n)[0] <= line <= _span(n)[1]]
    if text[0] == "+":
        indent = len(text[1:]) - len(text[1:].lstrip())
        holders = [(q, n) for q, n, _ in defs
                   if _span(n)[0] <= line - 1 <= _span(n)[1] and n.col_offset < indent] or holders
    funcs = [(q, n) for q, n in holders if not isinstance(n, ast.ClassDef)]
    if funcs:
        return (*max(funcs, key=lambda qn: _span(qn[1])[0]), "function")
    if holders:
        return (*max(holders, key=lambda qn: _span(qn[1])[0]), "attribute")
    return "", None, "import"


def _plan_file(module: str, hunks: list[Hunk], root: Path | None = None) -> list[Hook]:
    file = _source_file(module, root)
    if not file.is_file():
        raise HookError(f"{file} does not exist: the patch is for another layout of the engine")
    lines = file.read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    defs = _defs(tree)
    patched = apply_to_text(lines, hunks)  # every hunk fits exactly, or HookError
    hooks: dict[tuple[str, str], Hook] = {}
    for h in hunks:
        for line, text in h.changes():
            q, node, kind = _holder(defs, line, text)
            hook = hooks.setdefault((kind, q), Hook(module, q, kind))
            if h not in hook.hunks:
                hook.hunks.append(h)
            if node is not None and not hook.fingerprint:
                a, b = _span(node)
                hook.fingerprint = fingerprint("\n".join(lines[a - 1:b]))
    fname = f"<vattn-patched {file}>"
    text = "\n".join(patched) + "\n"
    linecache.cache[fname] = (len(text), None, text.splitlines(True), fname)  # tracebacks show the hooks
    new_tree = ast.parse(text, fname)
    new_defs = {q: n for q, n, _ in _defs(new_tree)}
    for hook in hooks.values():
        if hook.kind == "function":
            if hook.qualname not in new_defs:
                raise HookError(f"{module}: the patch removes or renames {hook.qualname}")
            hook.new = _compile_function(new_defs[hook.qualname], fname)
        elif hook.kind == "import":
            hook.new = _compile_imports(hook, fname)
        else:
            hook.new = _attributes(hook)
    return list(hooks.values())


def _compile_function(node: ast.AST, fname: str) -> Any:
    """Code that, run in the module's globals with `__class__` bound, defines the function.
    Wrapped in a maker taking `__class__` so that a zero-argument `super()` works outside
    the class body; private (`__x`) names, which a class body would mangle, are refused."""
    src_names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    src_names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    private = sorted(x for x in src_names if x.startswith("__") and not x.endswith("__"))
    if private:
        raise HookError(f"{node.name} uses private names {private}: it cannot be compiled outside its class")
    maker = ast.parse(f"def _vattn_make(__class__):\n    return {node.name}").body[0]
    maker.body.insert(0, node)
    mod = ast.Module(body=[maker], type_ignores=[])
    ast.fix_missing_locations(mod)
    return compile(mod, fname, "exec")


def _compile_imports(hook: Hook, fname: str) -> Any:
    code = "\n".join(textwrap.dedent(t) for t in (x for h in hook.hunks for x in h.added) if t.strip())
    tree = ast.parse(code)
    for stmt in tree.body:
        mods = [stmt.module or ""] if isinstance(stmt, ast.ImportFrom) else (
            [a.name for a in stmt.names] if isinstance(stmt, ast.Import) else None)
        if mods is None or not all(m == "vattn" or m.startswith("vattn.") for m in mods):
            raise HookError(f"{hook.module}: a module-level hunk may only import vattn, got {ast.unparse(stmt)!r}")
    return compile(tree, fname, "exec")


def _attributes(hook: Hook) -> dict[str, str]:
    """`name: type = value` lines of a class-body hunk: {name: value expression}."""
    code = textwrap.dedent("\n".join(t for h in hook.hunks for t in h.added if t.strip() and
                                     not t.strip().startswith("#")))
    out: dict[str, str] = {}
    for stmt in ast.parse(code).body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None):
            raise HookError(f"{hook.module}.{hook.qualname}: a class-body hunk may only add `name: type = value` "
                            f"lines, got {ast.unparse(stmt)!r}")
        out[stmt.target.id] = ast.unparse(stmt.value)
    return out


def _owner(module: Any, qualname: str) -> tuple[Any, str]:
    parts = qualname.split(".")
    obj = module
    for p in parts[:-1]:
        obj = getattr(obj, p)
    return obj, parts[-1]


@dataclass
class Installed:
    """What `install` changed, to put back (`uninstall`): (owner, name, old value or a
    marker for "was absent")."""

    changes: list[tuple[Any, str, Any]] = field(default_factory=list)


_ABSENT = object()


def install(hooks: list[Hook]) -> Installed:
    """Install planned hooks: import their modules, run the imports, set the new functions
    and attributes. Call only after `plan` succeeded for every hook."""
    done = Installed()
    try:
        for hook in sorted(hooks, key=lambda h: h.kind != "import"):  # imports first: functions use them
            mod = importlib.import_module(hook.module)
            if hook.kind == "import":
                before = dict(mod.__dict__)
                exec(hook.new, mod.__dict__)
                for k in set(mod.__dict__) - set(before):
                    done.changes.append((mod, k, _ABSENT))
            elif hook.kind == "attribute":
                cls, _ = _owner(mod, hook.qualname + ".x")
                for name, expr in hook.new.items():
                    done.changes.append((cls, name, cls.__dict__.get(name, _ABSENT)))
                    setattr(cls, name, eval(expr, mod.__dict__))
            else:
                owner, name = _owner(mod, hook.qualname)
                ns: dict[str, Any] = {}
                exec(hook.new, mod.__dict__, ns)
                cls = owner if isinstance(owner, type) else None
                new = ns["_vattn_make"](cls)
                old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
                done.changes.append((owner, name, old))
                setattr(owner, name, new)
                if cls is None:  # a module function: rebind where it was imported by name
                    for other in list(sys.modules.values()):
                        if other is not mod and _holds(other, name, old):
                            done.changes.append((other, name, old))
                            setattr(other, name, new)
    except BaseException:
        uninstall(done)
        raise
    return done


def _holds(module: Any, name: str, value: Any) -> bool:
    """Whether `module` bound `name` to `value` itself, read from its namespace: never its
    `__getattr__`, which a lazy module answers by importing (transformers' image processors
    raise ModuleNotFoundError without torchvision): an unrelated module's import error must not
    decide whether the hooks install."""
    try:
        return vars(module).get(name) is value
    except Exception:  # not a module (anything may sit in sys.modules), or no __dict__
        return False


def uninstall(done: Installed) -> None:
    """Put back what `install` changed (tests; a failed install)."""
    for owner, name, old in reversed(done.changes):
        if old is _ABSENT:
            try:
                delattr(owner, name)
            except AttributeError:
                pass
        else:
            setattr(owner, name, old)
    done.changes.clear()
