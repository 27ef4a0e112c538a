"""What the grader takes from a submitted notebook: the student's definitions, read from
its source without running it.

    found = definitions([(cell number, source), ...], {"my_broadcast", ...})
    found.answers["my_broadcast"]      # a pplab.checks.SourceAnswer
    found.notes                        # "ignored cell 4, line 2: `pplab.checks.run_check = ...`: ..."

For each answer name: the last top-level definition of it and, transitively, the last
top-level definition of every global name that code reads (in function bodies,
decorators, default values, class bodies), in notebook order. A definition is a def, a
class, an import, or an assignment to plain names. Nothing else at the top level is kept
(expressions, calls, assignments to attributes or items, for/if/with/try blocks): the
grader runs only definitions, and only in the processes that call the answer.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field

# Calls that, at the top level of a notebook, look like tampering with the grader rather
# than like an answer: listed in the notes when the grader leaves them out.
_TAMPERING_CALLS = {"setattr", "delattr", "exec", "eval", "compile", "globals", "__import__", "breakpoint"}
_TAMPERING_ATTRS = {"system", "popen", "remove", "unlink", "rename", "replace", "rmtree", "kill", "write_text",
                    "write_bytes", "run", "Popen", "call", "check_call", "check_output", "reload", "symlink_to"}


# The grader's own modules: an answer that imports them (to call the checker's reference or
# its inputs) is refused, whatever it does with them.
_CHECKER_MODULES = ("pplab.checks", "pplab.course")


@dataclass
class Definitions:
    answers: dict = field(default_factory=dict)     # answer name -> pplab.checks.SourceAnswer
    notes: list = field(default_factory=list)       # what was left out, and why
    refused: dict = field(default_factory=dict)     # answer name -> why it gets no mark


def _python(source: str) -> str:
    try:
        from IPython.core.inputtransformer2 import TransformerManager
        return TransformerManager().transform_cell(source)      # %magics and !shell become Python
    except Exception:                                          # noqa: BLE001 - keep the raw source
        return source


def _bound(node) -> list[str]:
    """The names a top-level definition binds: def, class, import, assignment to plain names."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Import):
        return [a.asname or a.name.split(".")[0] for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [a.asname or a.name for a in node.names]
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
    names = []
    for target in targets:
        parts = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
        if not all(isinstance(t, ast.Name) for t in parts):
            return []                                   # `x.y = ...`, `d[k] = ...`: not a definition
        names += [t.id for t in parts]
    return names


def _loads(source: str) -> set[str]:
    """Global names a statement's code reads: at the top level and in every function and
    class body inside it (decorators, default values and annotations included)."""
    import symtable

    names, tables = set(), [symtable.symtable(source, "<cell>", "exec")]
    while tables:
        table = tables.pop()
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (table.get_type() == "module" or symbol.is_global()):
                names.add(symbol.get_name())
        tables += table.get_children()
    return names


def _walk_here(node):
    """ast.walk, without going into the bodies of functions and lambdas (code that runs
    only when called)."""
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        body = n.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
            [n.body] if isinstance(n, ast.Lambda) else []
        todo += [c for c in ast.iter_child_nodes(n) if not any(c is b for b in body)]


def _tampering(node, modules: set[str]) -> bool:
    """An assignment to an attribute or item of a module (or of globals()), or a call that
    patches, evaluates, writes files or starts processes, run at the top level."""
    def root(target):
        while isinstance(target, (ast.Attribute, ast.Subscript, ast.Starred)):
            target = target.value
        return target

    for n in _walk_here(node):
        targets = []
        if isinstance(n, (ast.Assign, ast.Delete)):
            targets = n.targets
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            targets = [n.target]
        for target in targets:
            for t in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]):
                if isinstance(t, (ast.Attribute, ast.Subscript)):
                    base = root(t)
                    if isinstance(base, ast.Call) or (isinstance(base, ast.Name) and base.id in modules):
                        return True
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Name) and f.id in _TAMPERING_CALLS:
                return True
            if isinstance(f, ast.Attribute) and f.attr in _TAMPERING_ATTRS:
                return True
            if isinstance(f, ast.Name) and f.id == "open":
                mode = n.args[1] if len(n.args) > 1 else next((k.value for k in n.keywords if k.arg == "mode"), None)
                if not (mode is None or (isinstance(mode, ast.Constant) and set(str(mode.value)) <= set("rbt"))):
                    return True
    return False


def _shown(node, source: str) -> str:
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        text = " = ".join(ast.unparse(t) for t in targets) + " = ..."
    else:
        text = (source.strip().splitlines() or [""])[0]
    return text if len(text) <= 80 else text[:79] + "…"


def _parse(python: str) -> ast.Module:
    """ast.parse under Python's default recursion limit, so how deep a cell may nest does not
    depend on what else ran in the grader's process (a raised limit parses what the default refuses)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        return ast.parse(python)
    finally:
        sys.setrecursionlimit(limit)


def definitions(cells, answers) -> Definitions:
    """The answers the notebook defines, as SourceAnswers: for each answer name, the last
    top-level definition of it and, transitively, the last top-level definition of every
    global name that code reads (helpers, constants, imports, classes), in notebook order.

    cells: [(cell number, source)] of code cells. Nothing else at the top level is kept
    (expressions, calls, attribute or item assignments, for/if/with/try blocks): the grader
    runs only definitions. Kept or not, statements that look like tampering are named in
    the notes, and a definition whose value looks like tampering is left out.
    """
    from ..checks import SourceAnswer

    found = Definitions()
    statements = []                              # (cell, line, node, source), in notebook order
    nested: dict[str, tuple] = {}               # answer name -> (cell, line, block) where it hides in a block
    for number, source in cells:
        python = _python(source)
        try:
            tree = _parse(python)
        except SyntaxError as err:
            found.notes.append(f"cell {number} has a syntax error (line {err.lineno}): it was not graded")
            continue
        except (RecursionError, MemoryError, ValueError) as err:   # too deeply nested, too long, a NUL byte
            found.notes.append(f"cell {number} could not be read by Python's parser ({type(err).__name__}): "
                               f"it was not graded")
            continue
        lines = python.splitlines(keepends=True)
        for node in tree.body:
            first = node.decorator_list[0] if getattr(node, "decorator_list", None) else node
            line, col = first.lineno, first.col_offset - (first is not node)        # "@" comes before it
            text = "".join(lines[line - 1:node.end_lineno])
            text = text[col:len(text) - len(lines[node.end_lineno - 1]) + node.end_col_offset]
            statements.append((number, line, node, text))
            if not _bound(node) and not isinstance(node, (ast.Expr,)):
                for inner in ast.walk(node):
                    for name in set(answers) & set(_bound(inner) if isinstance(inner, ast.stmt) else ()):
                        nested.setdefault(name, (number, inner.lineno, type(node).__name__.lower()))
    modules = {"sys", "builtins", "__builtins__", "os"}
    for _, _, node, _ in statements:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules.update(_bound(node))
    last, kept_ok = {}, {}
    for i, (number, line, node, source) in enumerate(statements):
        tampering = _tampering(node, modules)
        if tampering:
            found.notes.append(f"ignored cell {number}, line {line}: `{_shown(node, source)}`: the grader runs only "
                               f"definitions")
        for name in _bound(node):
            last[name] = i
        kept_ok[i] = not tampering and bool(_bound(node))
    elsewhere = {t.id for _, _, node, _ in statements if not _bound(node)
                 for t in ast.walk(node) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
    for answer in sorted(answers):
        if answer not in last and answer in nested:
            cell, line, block = nested[answer]
            found.notes.append(f"{answer} is defined inside an `{block}` block (cell {cell}, line {line}), not at the "
                               f"top level of a cell: the grader takes only top-level definitions, so it was not "
                               f"found. Move it out of the block.")
        if answer not in last or not kept_ok[last[answer]]:
            continue
        keep, todo, unbound = set(), [last[answer]], set()
        while todo:
            i = todo.pop()
            if i in keep:
                continue
            keep.add(i)
            try:
                needed = _loads(statements[i][3])
            except (SyntaxError, RecursionError, ValueError):
                needed = set()
            for name in needed:
                if name in last and kept_ok[last[name]]:
                    todo.append(last[name])
                elif name in elsewhere:
                    unbound.add(name)
        for name in sorted(unbound):
            found.notes.append(f"{answer} uses `{name}`, which no definition at the top level binds (the grader "
                               f"runs only def, class, import and assignments to plain names)")
        for i in sorted(keep):
            used = _checker_use(statements[i][2])
            if used:
                found.refused[answer] = (f"{answer} uses {used} (cell {statements[i][0]}), the grader's own code: an "
                                         f"answer may not call the checker or its reference, so it gets no mark")
                break
        node = statements[last[answer]][2]
        params = None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.decorator_list:
            params = _params(node.args)
        found.answers[answer] = SourceAnswer(answer, tuple((f"<cell {statements[i][0]}>", statements[i][1],
                                                            statements[i][3]) for i in sorted(keep)), params)
    return found


def _checker_use(node) -> str:
    """The checker module a definition imports or names (`import pplab.checks`, `from pplab
    import checks`, `pplab.course.grading.x`, "pplab.checks" in a string), or ""."""
    def checker(name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in _CHECKER_MODULES)

    for n in ast.walk(node):
        if isinstance(n, ast.Import):
            hit = next((a.name for a in n.names if checker(a.name)), None)
        elif isinstance(n, ast.ImportFrom):
            hit = n.module if n.module and checker(n.module) else next(
                (f"{n.module}.{a.name}" for a in n.names if checker(f"{n.module}.{a.name}")), None)
        elif isinstance(n, ast.Attribute):
            hit = _dotted(n) if checker(_dotted(n)) else None
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            hit = next((m for m in _CHECKER_MODULES if m in n.value), None)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr" and \
                len(n.args) > 1 and isinstance(n.args[1], ast.Constant) and \
                f"pplab.{n.args[1].value}" in _CHECKER_MODULES:
            hit = f"pplab.{n.args[1].value}"
        else:
            hit = None
        if hit:                                  # named by its module: `pplab.checks`, not a function in it
            return f"`{next((m for m in _CHECKER_MODULES if m in hit), hit)}`"
    return ""


def _dotted(node) -> str:
    """`a.b.c` of an attribute chain whose root is a plain name, else ""."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _params(args: ast.arguments) -> tuple:
    """(name, kind, has a default) of each parameter, read from the source."""
    out = [(a.arg, "positional_only", False) for a in args.posonlyargs]
    out += [(a.arg, "positional_or_keyword", False) for a in args.args]
    n_defaults = len(args.defaults)
    for k in range(n_defaults):                          # defaults belong to the last positional ones
        j = len(out) - n_defaults + k
        out[j] = (out[j][0], out[j][1], True)
    if args.vararg:
        out.append((args.vararg.arg, "var_positional", False))
    out += [(a.arg, "keyword_only", d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append((args.kwarg.arg, "var_keyword", False))
    return tuple(out)


def defined_names(source: str) -> list[str]:
    """Names a cell defines at top level (def, class, import, assignment), in order."""
    try:
        tree = _parse(_python(source))
    except SyntaxError:
        return []
    return [name for node in tree.body if not isinstance(node, (ast.Import, ast.ImportFrom))
            for name in _bound(node)]
