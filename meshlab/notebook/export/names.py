"""What a cell takes from the cells before it, and what it leaves for those after: the names
it binds, the names it reads before binding them, and the generators it seeds before drawing
from them. Read from the cell's Python (``ast``), without running it. Notebook side.

Where the order is uncertain the answer leans to "reads it": a name bound only inside an
``if``, a loop or a ``try`` may still be unbound when it is read after them, and a function's
globals are read wherever the cell uses the function (or, if it never does, at its end).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable

SEEDS = {"torch.manual_seed": {"torch", "cuda"}, "torch.random.manual_seed": {"torch", "cuda"},
         "torch.cuda.manual_seed": {"cuda"}, "torch.cuda.manual_seed_all": {"cuda"},
         "random.seed": {"random"}}
"""The calls that set a generator afresh, by the name a cell calls them under."""

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)


def cell_tree(code: str) -> ast.Module | None:
    """A cell's Python: its ``%%mesh`` line and ``%magic``/``!shell`` lines left out; None if
    what remains is not Python."""
    lines = code.splitlines()
    if lines and lines[0].lstrip().startswith("%%"):
        lines = lines[1:]
    text = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)
    try:
        return ast.parse(text)
    except SyntaxError:
        return None


def binds(code: str) -> set[str]:
    """Names the cell may bind at its top level (anywhere but inside a function or class)."""
    tree = cell_tree(code)
    if tree is None:
        return set()
    bound: set[str] = set()
    todo: list[ast.AST] = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.Global):
            bound |= set(node.names)
        if not isinstance(node, (*_FUNCTIONS, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return bound


def free_reads(code: str) -> set[str]:
    """Names the cell may read before it binds them: what it needs from earlier cells.
    Unparsable code reads nothing (export refuses it by name elsewhere)."""
    tree = cell_tree(code)
    if tree is None:
        return set()
    flow = _Flow()
    bound = flow.block(tree.body, set())
    for name in list(flow.functions):  # never used in the cell: a later cell calls it
        flow.read({name}, bound)
    return flow.free


def seeds_first(code: str) -> set[str]:
    """The generators (torch, cuda, random: those meshlab.rank.rng_state watches) the cell
    seeds before it can draw from any: seed calls among its first statements, with only
    imports, definitions and plain values before them."""
    tree = cell_tree(code)
    seeded: set[str] = set()
    for node in tree.body if tree else []:
        value = node.value if isinstance(node, (ast.Expr, ast.Assign, ast.AnnAssign)) else None
        called = _dotted(value.func) if isinstance(value, ast.Call) else ""
        if called in SEEDS:  # torch.manual_seed(0), or g = torch.manual_seed(0)
            seeded |= SEEDS[called]
        elif not (isinstance(node, (ast.Import, ast.ImportFrom, *_FUNCTIONS, ast.Pass)) or (
                value is not None and all(isinstance(n, _PLAIN) for n in ast.walk(value)))):
            break  # it may draw: a seed after it comes too late
    return seeded


_PLAIN = (ast.Constant, ast.Name, ast.Attribute, ast.Tuple, ast.List, ast.UnaryOp, ast.USub,
          ast.Load)
"""What a plain value (``lr = 0.01``, ``steps = -1``, ``dtype = torch.float32``) is made of."""


def _dotted(node: ast.AST) -> str:
    """``torch.cuda.manual_seed`` for the expression spelling it; "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else ""
    return ""


class _Flow:
    """A walk through a cell's statements in the order they run, keeping the names surely
    bound so far: a name loaded while not surely bound is a free read."""

    def __init__(self) -> None:
        self.free: set[str] = set()
        self.functions: dict[str, set[str]] = {}  # a function or class -> globals it reads
        self._reading: set[str] = set()

    def read(self, names: Iterable[str], bound: set[str]) -> None:
        for name in names:
            if name not in bound:
                self.free.add(name)
            if name in self.functions and name not in self._reading:  # called, perhaps
                self._reading.add(name)
                self.read(self.functions[name], bound)
                self._reading.discard(name)

    def block(self, body: list[ast.stmt], bound: set[str]) -> set[str]:
        """Walk ``body`` from ``bound``; the names surely bound after it."""
        bound = set(bound)
        for node in body:
            bound = self.statement(node, bound)
        return bound

    def statement(self, node: ast.stmt, bound: set[str]) -> set[str]:
        read = self.read
        if isinstance(node, _FUNCTIONS):
            read(_loads([*node.decorator_list, *node.args.defaults,
                         *(d for d in node.args.kw_defaults if d)]), bound)
            self.functions[node.name] = _function_globals(node)
            return bound | {node.name}
        if isinstance(node, ast.ClassDef):
            read(_loads([*node.decorator_list, *node.bases, *node.keywords]), bound)
            inside = _Flow()
            inside.functions = dict(self.functions)
            inside.block(node.body, bound)  # the class body runs now; its names stay in it
            read(inside.free, bound)
            self.functions[node.name] = set().union(
                *(_function_globals(n) for n in node.body if isinstance(n, _FUNCTIONS)))
            return bound | {node.name}
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return bound | {(a.asname or a.name).split(".")[0] for a in node.names
                            if a.name != "*"}
        if isinstance(node, ast.AugAssign):
            read(_loads([node.target, node.value]) | _stored([node.target]), bound)
            return bound | _stored([node.target]) | _walrus(node.value)
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            values = [node.value] if node.value is not None else []
            annotation = [node.annotation] if isinstance(node, ast.AnnAssign) else []
            read(_loads([*values, *annotation, *targets]), bound)
            return bound | (_stored(targets) if values else set()) | _walrus(*values)
        if isinstance(node, ast.Delete):
            read(_loads(node.targets) | _stored(node.targets), bound)  # del x needs x bound
            return bound - _stored(node.targets)
        if isinstance(node, (ast.For, ast.AsyncFor)):
            read(_loads([node.iter, node.target]), bound)
            self.block(node.body, bound | _stored([node.target]) | _walrus(node.iter))
            self.block(node.orelse, bound)  # the body may not have run, or only in part
            return bound | _walrus(node.iter)
        if isinstance(node, ast.While):
            read(_loads([node.test]), bound)
            tested = bound | _walrus(node.test)
            self.block(node.body, tested)
            self.block(node.orelse, tested)
            return tested
        if isinstance(node, ast.If):
            read(_loads([node.test]), bound)
            tested = bound | _walrus(node.test)
            return self.block(node.body, tested) & self.block(node.orelse, tested)
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                read(_loads([item.context_expr]), bound)
                bound = bound | _walrus(item.context_expr)
                if item.optional_vars is not None:
                    read(_loads([item.optional_vars]), bound)
                    bound = bound | _stored([item.optional_vars])
            return self.block(node.body, bound)
        if isinstance(node, ast.Try) or (sys.version_info >= (3, 11)
                                          and isinstance(node, ast.TryStar)):
            ends = [self.block(node.orelse, self.block(node.body, bound))]
            for handler in node.handlers:  # the body may have stopped anywhere
                read(_loads([handler.type] if handler.type else []), bound)
                ends.append(self.block(handler.body, bound | ({handler.name} if handler.name
                                                              else set())))
            return set.intersection(*ends) | self.block(node.finalbody, bound)
        if isinstance(node, ast.Match):
            read(_loads([node.subject]), bound)
            for case in node.cases:
                captured = bound | _stored([case.pattern])
                read(_loads([case.guard] if case.guard else []), captured)
                self.block(case.body, captured)
            return bound | _walrus(node.subject)
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            return bound
        read(_loads([node]), bound)  # return, raise, assert, an expression...
        return bound | (_walrus(node.value) if isinstance(node, ast.Expr) else set())


def _loads(nodes: Iterable[ast.AST | None], local: frozenset[str] = frozenset()) -> set[str]:
    """Names the expressions load from the cell's namespace (not a lambda's arguments or a
    comprehension's own variables)."""
    found: set[str] = set()
    for node in nodes:
        if node is None:
            continue
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load) and node.id not in local:
                found.add(node.id)
        elif isinstance(node, ast.Lambda):
            args = node.args
            found |= _loads([*args.defaults, *args.kw_defaults], local)
            found |= _loads([node.body], local | _arguments(args))
        elif isinstance(node, _COMPREHENSIONS):
            first, *rest = node.generators
            found |= _loads([first.iter], local)  # evaluated outside the comprehension
            inner = local | _stored([g.target for g in node.generators])
            parts: list[ast.AST] = [first.target, *first.ifs]
            for g in rest:
                parts += [g.target, g.iter, *g.ifs]
            parts += [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            found |= _loads(parts, inner)
        elif isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
            continue  # a statement's own: the flow reads those
        else:
            found |= _loads(ast.iter_child_nodes(node), local)
    return found


def _stored(targets: Iterable[ast.AST]) -> set[str]:
    """Names assignment targets (or a match pattern) bind."""
    names: set[str] = set()
    for target in targets:
        for node in ast.walk(target):
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                names.add(node.id)
            elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
                names.add(node.name)
            elif isinstance(node, ast.MatchMapping) and node.rest:
                names.add(node.rest)
    return names


def _walrus(*nodes: ast.AST | None) -> set[str]:
    """Names an expression surely binds with ``:=`` (not in a branch that may be skipped)."""
    names: set[str] = set()
    todo = [n for n in nodes if n is not None]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        if isinstance(node, ast.BoolOp):
            todo.append(node.values[0])  # the rest may be short-circuited
        elif isinstance(node, ast.IfExp):
            todo.append(node.test)
        elif not isinstance(node, (ast.Lambda, *_COMPREHENSIONS, *_FUNCTIONS, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
    return names


def _arguments(args: ast.arguments) -> frozenset[str]:
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    return frozenset(a.arg for a in every if a is not None)


def _function_globals(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The global names a function's body reads when it runs (its own locals aside)."""
    local, declared, reads = set(_arguments(node.args)), set(), set()
    todo: list[ast.AST] = list(node.body)
    while todo:  # its own scope: functions and classes inside it add what they read
        s = todo.pop()
        if isinstance(s, (*_FUNCTIONS, ast.ClassDef)):
            local.add(s.name)
            outside = [*s.decorator_list, *(s.bases + s.keywords if isinstance(s, ast.ClassDef)
                                            else [*s.args.defaults, *s.args.kw_defaults])]
            reads |= _loads(outside)
            if isinstance(s, ast.ClassDef):
                todo += [n for n in s.body if not isinstance(n, _FUNCTIONS)]
            inner = [s] if isinstance(s, _FUNCTIONS) else \
                [n for n in s.body if isinstance(n, _FUNCTIONS)]
            for function in inner:
                reads |= _function_globals(function)
        elif isinstance(s, (ast.Lambda, *_COMPREHENSIONS)):
            reads |= _loads([s])
        elif isinstance(s, ast.Name):
            (reads if isinstance(s.ctx, ast.Load) else local).add(s.id)
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            local |= {(a.asname or a.name).split(".")[0] for a in s.names}
        elif isinstance(s, ast.Global):
            declared |= set(s.names)
        elif isinstance(s, ast.Nonlocal):
            local |= set(s.names)  # the enclosing function's, never a global
        else:
            if isinstance(s, ast.ExceptHandler) and s.name:
                local.add(s.name)
            if isinstance(s, ast.pattern):
                local |= _stored([s])
            todo.extend(ast.iter_child_nodes(s))
    return reads - (local - declared)
