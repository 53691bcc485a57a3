"""Loop bodies (and plain segments) compiled to Python: the recording twin of a jinja2 loop body, for the
iterations a :class:`.session.ChatSession` renders.

A jinja2 body render pays for a ``Context``, the recording stand-ins (``loop``, namespaces, ``messages``), a
sandbox call per attribute read and a generator; on the qwen3 template that is 9-31 us per iteration where
the same work written as Python takes about 1 us (``docs/design/chat.md``, session 17). :func:`compile_body`
turns a body's jinja2 AST (after the analysis' rewrites, O5-O6) into one Python function that computes the
body's output and records the body's reads and namespace writes into the iteration's record, as the
jinja2 path does through its stand-ins.

It is a *partial* twin: wherever it is not sure to compute what jinja2 computes, it raises (:class:`Bail`,
or any exception from a Python operation), and the session renders that iteration through the jinja2 body
as before, from a fresh record (a raise leaves no trace: namespace writes go to the record's ``writes``
only, which the caller applies to the loop's state after a successful return). A template using a construct
outside the supported subset is refused at compile time (:class:`Unsupported`): its iterations all take the
jinja2 path.

Runtime contract: ``fn(elem, p, n, chat, state, rec, outer) -> str`` for the iteration at message position
``p`` of ``n`` (``chat`` the prepared messages, ``elem = chat[p]``), ``state`` the loop's namespace state
``{(name, attr): value}`` (read, never written), ``rec`` a fresh ``session._Rec``, ``outer`` the loop's plain
outer values. On return: the output, and ``rec`` holds what the jinja2 path would have recorded.

Proof obligations (C1-C8), each against jinja2 3.1's code generator (``compiler.py``) and runtime, for the
environment :func:`.template.segment_environment` (``PlainFastSandbox`` under jinja2 3.1.5+, whose
``getattr``/``call`` return what the stock sandbox returns; no ``finalize``, no autoescape, no intercepted
operators, not async: checked at compile time). The values a body sees are plain JSON values (messages are
:func:`.template.prepare_plain` dicts of :func:`.template.plain` copies or of JSON parses, which hold exact
JSON types only; outer values pass ``plain_value``), the session's stand-ins, and
jinja2 ``Undefined``; in the compiled code an undefined value is :data:`UNDEFINED`, whose truth value is
``False`` and whose every other use raises.

C1 Names and frames. Scoping is jinja2's own: the body's root frame and each nested ``for`` frame are
   analysed by ``jinja2.idtracking.Symbols`` exactly as ``CodeGenerator.visit_Template`` and ``visit_For``
   do (``declare_parameter("loop")`` first for an extended loop, ``find_undeclared`` deciding it), the
   compiled code uses jinja2's own local names (``l_<level>_<name>``), and a frame's entry (root: once;
   ``for``: once per iteration, inside the Python ``for``) assigns each load as ``enter_frame`` does:
   ``resolve`` -> the value the body context holds for the name (below), ``alias`` -> the outer local,
   ``undefined`` -> :data:`UNDEFINED`, ``param`` -> bound by the ``for``. The body context of the jinja2 path
   holds, by precedence, the comparison recorder, the namespaces, ``messages``, ``loop``, the loop target
   (``elem``), the outer values, then the environment's globals. ``context.vars`` (the root frame's exported
   assignments) is never read back: a name assigned at the root has a root ref, so no inner frame resolves it.
C2 Special names (the recorder, a namespace, ``messages``, the message loop's ``loop``, a global) are used
   only where the compiled code models them (below); any other use, a store to one, or an alias of one is
   :class:`Unsupported`.
C3 Values. ``Const`` (scalars, and lists or tuples of scalars: folded literals) and ``TemplateData`` are
   their values; ``and``/``or``/``not``, comparisons (chained),
   ``+ - * / // % **``, unary ``- +`` and the inline ``if``/``else`` are emitted as the same Python operators
   jinja2 emits (the sandbox intercepts none), so they compute the same values from the same operands, in the
   same order, with the same short-circuits. ``~`` is ``"".join(map(str, ...))`` (``runtime.str_join``).
   An ``UNDEFINED`` operand raises where jinja2's ``Undefined`` would give a value, except for truth
   (``False`` in both).
C4 Attribute and item reads. ``x.a`` (``a`` not a ``dict`` attribute name, ``template.DICT_ATTRIBUTES``) on an
   exact ``dict`` is ``x[a]`` or undefined (``PlainFastSandbox.getattr``); on anything else it raises. In a
   loop body it is ``dict.get(x, a, UNDEFINED)``, a C call: the method descriptor raises ``TypeError`` for
   anything that is not a ``dict``, and no value a body holds is an instance of a ``dict`` subclass (the
   values above are exact JSON types, whose dicts are exact; the compiled code's own values are scalars,
   ``str``, and lists and dicts it builds as literals; filters, tests and ``str`` methods (C6) give none).
   ``x[k]``: a ``dict`` and a ``str`` key it holds, or a ``list``/``tuple``/``str`` and an ``int`` index in
   range, give ``x[k]`` (``SandboxedEnvironment.getitem`` returns ``obj[argument]`` when that succeeds);
   everything else raises. A slice is Python slicing, as jinja2 emits it.
C5 Recording. ``loop.<index0|index|revindex0|revindex|first|last|length>`` of the message loop records
   ``rec.loop_reads[attr] = value`` with the value of ``session._RecLoop`` (:func:`loop_attr`);
   ``ns.attr`` records ``ns_reads[key]`` on the first read that is not after a write of the iteration, and
   reads a missing attribute as undefined (``RecNamespace``); ``set ns.attr = v`` writes ``rec.writes[key]``
   (a later read of the iteration sees it, as ``RecNamespace`` sees ``state``); ``messages[i]`` with ``0 <= i
   < n`` raises ``rec.maxread`` to ``i`` and ``messages|length`` (or ``count``) sets ``rec.nsens``
   (``_RecMessages``), other reads of ``messages`` raise; the analysis' comparison recorder (O6) records an
   outcome or reads through the namespace exactly as ``session._Compare``. A namespace value that is not
   plain JSON, and a write of ``UNDEFINED``, raise (the jinja2 path handles them). Reads happen in the order
   jinja2's generated code makes them (C3), so "first read" means the same read.
C6 Calls, filters, tests. A ``str`` method from :data:`STR_METHODS` called on an exact ``str`` with
   positional arguments is called directly (``PlainFastSandbox.call`` of a builtin method bound to an exact
   ``str``); ``raise_exception`` raises. Filters in :data:`FILTERS` and tests in :data:`TESTS` call the
   environment's own function (none takes a context, eval context or environment: checked) with the same
   arguments, after checking none is ``UNDEFINED``; ``defined``/``undefined``/``none`` are identity tests,
   which give jinja2's answers on ``UNDEFINED`` too.
C7 Statements. ``{{ }}`` appends ``str(value)`` per child (jinja2's default finalize, autoescape off);
   ``if``/``elif``/``else`` are Python ``if`` on the same tests; ``set x = e`` assigns jinja2's local for
   ``x``; a nested ``for`` over a ``list`` or ``tuple`` (anything else raises) binds its target and, when
   extended, ``loop`` with ``LoopContext``'s values for a sequence (``index0 = i``, ``last = i == length - 1``,
   ``length = len(seq)``); ``break``/``continue`` inside it are Python's (``loopcontrols``).
C8 No effects outside the record. The compiled code reads ``state``, ``chat`` and ``outer`` and never writes
   them; filters, tests and ``str`` methods are pure functions of their arguments. So a raise anywhere leaves
   the session as it was before the iteration.
C9 Plain segments (:func:`compile_plain`: ``fn(variables, built) -> (output, assignments)``). The context of
   a plain segment is the environment's globals under the request's variables (``Compiled.new_context``):
   a name the variables hold reads its value (the request's own variables, by id, plain JSON values and
   namespaces; anything else raises), a global is used only as ``namespace(...)`` (the sandbox's
   ``SafeNamespace``, which ``PlainFastSandbox.call`` calls directly; it checks its keywords itself) or
   ``raise_exception`` (raises). ``x.a`` on a namespace reads its attribute dict: the stock ``getattr``
   returns the attribute, or an undefined when it is absent (``Namespace`` has no ``__getitem__``); a value
   that is neither plain JSON nor a namespace raises. No namespace writes (C8: a raise leaves no trace).
   Every assignment of the root frame (the root and root-level ``if`` branches, not nested ``for`` bodies)
   is returned as ``context.vars`` holds it after the jinja2 render; an undefined value there raises.
C10 What the generated source can reach. Template text enters the source only as ``repr`` of a ``str``,
   ``int``, ``bool`` or ``None`` (constants, attribute and keyword names), as jinja2's own local names
   (``l_<level>_<name>``, from names its lexer accepted: the same names jinja2 puts in the code it runs through
   ``exec`` for every template), or as a key into the scope (``_k<n>``: filters, tests, floats, ``namespace``).
   :func:`_load` re-parses the source and refuses it (:class:`Unsupported`) unless it is one ``def body`` made
   of the node types the generator writes, reading only :data:`SOURCE_ATTRIBUTES` of its own objects (its
   output list, a ``str`` constant, the record's dicts; never of a jinja2 local), calling only names (never a
   value of the template: no jinja2 local is ever called), naming nothing that starts with ``__`` and nothing
   it does not bind or the scope holds; it runs with :data:`SOURCE_BUILTINS` as its only builtins. So a
   template reaches attributes, items and calls only through the helpers above (C4, C6), as it reaches them
   through the sandbox on the jinja2 path.
"""

from __future__ import annotations

import ast
import operator
from typing import Any, Callable

from toktier_backend.chat.analysis import COMPARE


class Unsupported(Exception):
    """The body uses a construct the compiler does not model (the message says which); it renders through
    jinja2."""


class Bail(Exception):
    """At run time: this iteration is not sure to match jinja2 here; render it through jinja2."""


class _Undefined:
    """jinja2's ``Undefined`` in compiled code: false, and every other use raises :class:`Bail` (or a
    ``TypeError`` from Python: an operation it does not define)."""

    __slots__ = ()

    def __bool__(self):
        return False

    def _bail(self, *args, **kwargs):
        raise Bail("undefined value")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _bail
    __str__ = __repr__ = __format__ = __iter__ = __len__ = __contains__ = __getitem__ = _bail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __mod__ = __rmod__ = _bail
    __hash__ = _bail  # type: ignore[assignment]


UNDEFINED = _Undefined()


#: ``str`` methods called directly on an exact ``str`` (C6): each is a builtin method bound to the string
#: (asserted in the tests), so ``PlainFastSandbox.call`` calls it as it is.
STR_METHODS = frozenset({
    "capitalize", "casefold", "center", "count", "endswith", "expandtabs", "find", "index", "isalnum", "isalpha",
    "isascii", "isdecimal", "isdigit", "isidentifier", "islower", "isnumeric", "isprintable", "isspace",
    "istitle", "isupper", "join", "ljust", "lower", "lstrip", "partition", "removeprefix", "removesuffix",
    "replace", "rfind", "rindex", "rjust", "rpartition", "rsplit", "rstrip", "split", "splitlines",
    "startswith", "strip", "swapcase", "title", "upper", "zfill",
})
#: Filters called as the environment's own function (C6).
FILTERS = frozenset({"length", "count", "tojson", "trim", "lower", "upper", "title", "capitalize"})
#: Tests called as the environment's own function (C6), besides the identity tests.
TESTS = frozenset({"string", "number", "integer", "float", "boolean", "mapping", "iterable", "sequence",
                   "true", "false"})
_IDENTITY_TESTS = {"defined": "is not", "undefined": "is", "none": "is"}

LOOP_ATTRS = frozenset({"index0", "index", "revindex0", "revindex", "first", "last", "length"})

_BINOPS = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/", "FloorDiv": "//", "Mod": "%", "Pow": "**",
           "And": "and", "Or": "or"}
_UNOPS = {"Not": "not ", "Neg": "-", "Pos": "+"}
_CMP = {"eq": "==", "ne": "!=", "gt": ">", "gteq": ">=", "lt": "<", "lteq": "<=", "in": "in", "notin": "not in"}
OPS = {"eq": operator.eq, "ne": operator.ne, "gt": operator.gt, "gteq": operator.ge, "lt": operator.lt,
       "lteq": operator.le}


def loop_attr(attr: str, p: int, n: int, reverse: bool, start: int):
    """``loop.<attr>`` of the message loop at message position ``p`` of ``n`` (``messages[start:]`` forward,
    or all of them reversed): the value jinja2's ``LoopContext`` has there.

    Raises:
        KeyError: ``attr`` is not one of :data:`LOOP_ATTRS`.
    """
    if reverse:
        length, t = n, n - 1 - p
    else:
        length, t = n - start, p - start
    if attr == "index0":
        return t
    if attr == "index":
        return t + 1
    if attr == "revindex0":
        return length - 1 - t
    if attr == "revindex":
        return length - t
    if attr == "first":
        return t == 0
    if attr == "last":
        return t == length - 1
    if attr == "length":
        return length
    raise KeyError(attr)


# the formulas of loop_attr as source over ``_t`` (position in the loop) and ``_len`` (its length)
_LOOP_SOURCE = {"index0": "_t", "index": "_t + 1", "revindex0": "_len - 1 - _t", "revindex": "_len - _t",
                "first": "_t == 0", "last": "_t == _len - 1", "length": "_len"}
_INNER_SOURCE = {"index0": "{i}", "index": "({i} + 1)", "revindex0": "({n} - 1 - {i})", "revindex": "({n} - {i})",
                 "first": "({i} == 0)", "last": "({i} == {n} - 1)", "length": "{n}"}


# ---------------------------------------------------------------- run-time helpers (C4-C6)

_PLAIN_SCALARS = frozenset({str, int, float, bool, type(None)})


def plain_value(v: Any, depth: int = 0) -> bool:
    """Is ``v`` made of exact JSON types (and tuples) only, ``str`` keys, at most 64 levels deep?"""
    t = type(v)
    if t in _PLAIN_SCALARS:
        return True
    if depth > 64:
        return False
    if t is list or t is tuple:
        return all(plain_value(x, depth + 1) for x in v)
    if t is dict:
        return all(type(k) is str and plain_value(x, depth + 1) for k, x in v.items())
    return False


def _bail(*args, **kwargs):
    raise Bail("jinja2 raises here")


def _ga(obj, name):
    """``obj.name`` for ``name`` not in ``DICT_ATTRIBUTES`` (C4)."""
    if type(obj) is dict:
        return obj.get(name, UNDEFINED)
    raise Bail("attribute of a non-dict")


def _gi(obj, key):
    """``obj[key]`` (C4)."""
    t = type(obj)
    if t is dict:
        if type(key) is str and key in obj:
            return obj[key]
    elif (t is list or t is tuple or t is str) and type(key) is int:
        try:
            return obj[key]
        except IndexError:
            pass
    raise Bail("item read jinja2 answers otherwise")


def _sm(s, name, args):
    """``s.name(*args)`` for a :data:`STR_METHODS` name (C6)."""
    if type(s) is not str:
        raise Bail("str method on a non-str")
    for a in args:
        if a is UNDEFINED:
            raise Bail("undefined argument")
    return getattr(s, name)(*args)


def _call(f, args, kwargs):
    """A filter or test of the environment (C6)."""
    for a in args:
        if a is UNDEFINED:
            raise Bail("undefined argument")
    for a in kwargs.values():
        if a is UNDEFINED:
            raise Bail("undefined argument")
    return f(*args, **kwargs)


def _call1(f, a):
    if a is UNDEFINED:
        raise Bail("undefined argument")
    return f(a)


def _seq(v):
    """The iterable of a nested ``for`` (C7)."""
    if type(v) is list or type(v) is tuple:
        return v
    raise Bail("for over a non-sequence")


def _concat(values) -> str:
    return "".join(map(str, values))


def _make_ns_read(missing):
    def _nsr(state, reads, writes, key):
        """``ns.attr`` (C5)."""
        if key in writes:
            return writes[key]
        v = state.get(key, missing)
        if key not in reads:
            reads[key] = v
        if v is missing:
            return UNDEFINED
        if type(v) not in _PLAIN_SCALARS and not plain_value(v):
            raise Bail("a namespace value that is not plain JSON")
        return v

    def _cmp(state, rec, key, opname, left, other):
        """The comparison recorder on a namespace attribute (C5; ``session._Compare``)."""
        reads, writes = rec.ns_reads, rec.writes
        op = OPS[opname]
        if key not in writes and key not in reads:
            v = state.get(key, missing)
            if v is not missing:
                if type(v) not in _PLAIN_SCALARS and not plain_value(v):
                    raise Bail("a namespace value that is not plain JSON")
                out = op(v, other) if left else op(other, v)
                if type(out) is not bool:
                    raise Bail("a comparison gave a non-bool")
                rec.cmps.setdefault(key, []).append((opname, "left" if left else "right", other, out))
                return out
        v = _nsr(state, reads, writes, key)
        return op(v, other) if left else op(other, v)

    return _nsr, _cmp


def _cmpv(obj, attr, opname, left, other):
    """The comparison recorder on a value that is not a namespace: ``obj.attr <op> other`` (C4, C5)."""
    v = _ga(obj, attr)
    return OPS[opname](v, other) if left else OPS[opname](other, v)


def _make_plain_helpers(ns_class):
    def _pv(v, built):
        """A value of the variables, as a plain segment reads it (C9): the request's own variables (plain by
        construction), plain JSON values and namespaces; anything else raises."""
        t = type(v)
        if t in _PLAIN_SCALARS or t is ns_class or id(v) in built or plain_value(v):
            return v
        raise Bail("a variable that is not plain JSON")

    def _gap(obj, name):
        """``obj.name`` in a plain segment (C9): a ``dict`` as in a body (C4), or a namespace's attribute."""
        t = type(obj)
        if t is dict:
            return obj.get(name, UNDEFINED)
        if t is ns_class:
            v = object.__getattribute__(obj, "_Namespace__attrs").get(name, UNDEFINED)
            if v is UNDEFINED or type(v) in _PLAIN_SCALARS or type(v) is ns_class or plain_value(v):
                return v
        raise Bail("attribute of a non-dict")

    return _pv, _gap


def _ex(value):
    """A value a plain segment exports (C9)."""
    if value is UNDEFINED:
        raise Bail("an undefined value exported")
    return value


def _nsw(writes, key, value):
    """``set ns.attr = value`` (C5)."""
    if value is UNDEFINED:
        raise Bail("an undefined value written to a namespace")
    writes[key] = value


def _mget(chat, rec, i):
    """``messages[i]`` (C5)."""
    if type(i) is int and 0 <= i < len(chat):
        if i > rec.maxread:
            rec.maxread = i
        return chat[i]
    raise Bail("a messages read that depends on the length")


def _mlen(rec, n):
    """``messages|length`` (C5)."""
    rec.nsens = True
    return n


# ---------------------------------------------------------------- the compiler

_VALUE, _LOOP, _MESSAGES, _NS, _COMPARE, _GLOBAL = "value", "loop", "messages", "ns", "compare", "global"


def environment_supported(env) -> str | None:
    """Why ``env`` is not one the proofs cover (``None``: it is)."""
    import jinja2

    from toktier_backend.chat.template import fast_sandbox_proven, plain_fast_sandbox

    if not fast_sandbox_proven(jinja2.__version__):
        return f"jinja2 {jinja2.__version__} (the proofs read 3.1.5+)"
    if type(env) is not type(plain_fast_sandbox()):
        return "not the segments' sandbox"
    if env.finalize is not None or env.autoescape is not False or env.is_async:
        return "finalize, autoescape or async"
    if env.intercepted_binops or env.intercepted_unops:
        return "intercepted operators"
    return None


#: The attributes generated source reads: its output list's ``append``, ``str.join`` and the record's dicts.
SOURCE_ATTRIBUTES = frozenset({"append", "join", "__setitem__", "loop_reads", "ns_reads", "writes"})
#: The only builtins generated source has (C10).
SOURCE_BUILTINS = {"enumerate": enumerate, "len": len, "str": str}
_SOURCE_NODES = frozenset({
    ast.Module, ast.FunctionDef, ast.arguments, ast.arg, ast.Assign, ast.Expr, ast.Return, ast.If, ast.For,
    ast.Pass, ast.Break, ast.Continue, ast.Name, ast.Load, ast.Store, ast.Attribute, ast.Subscript, ast.Slice,
    ast.Call, ast.keyword, ast.Constant, ast.Tuple, ast.List, ast.Dict, ast.IfExp, ast.BoolOp, ast.And, ast.Or,
    ast.UnaryOp, ast.Not, ast.USub, ast.UAdd, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
    ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn, ast.Is, ast.IsNot,
})


def _load(source: str, scope: dict, filename: str) -> Callable:
    """The function ``body`` that ``source`` defines, run in ``scope`` with :data:`SOURCE_BUILTINS` only,
    after checking the source is inside what the generator writes (C10).

    Raises:
        Unsupported: the source is outside that subset (a generator bug: the template then renders through
            jinja2).
    """
    try:
        tree = ast.parse(source, filename)
    except (SyntaxError, RecursionError, MemoryError) as e:  # e.g. nesting past the parser's limit
        raise Unsupported(f"generated source does not parse: {type(e).__name__}") from None
    fn = tree.body[0] if len(tree.body) == 1 else None
    if type(fn) is not ast.FunctionDef or fn.name != "body" or fn.decorator_list or fn.returns:
        raise Unsupported("generated source: not one plain 'def body'")
    for node in ast.walk(tree):
        t = type(node)
        if t not in _SOURCE_NODES or (t is ast.FunctionDef and node is not fn):
            raise Unsupported(f"generated source: a {t.__name__} node")
        if t is ast.Attribute:
            base = node.value
            while type(base) is ast.Attribute:
                base = base.value
            if node.attr not in SOURCE_ATTRIBUTES or not (
                    (type(base) is ast.Name and not base.id.startswith("l_")) or type(base) is ast.Constant):
                raise Unsupported(f"generated source: attribute {node.attr!r} of a template value")
        if t is ast.Name and node.id.startswith("__"):
            raise Unsupported(f"generated source: name {node.id!r}")
        if t is ast.Call and not (type(node.func) is ast.Attribute or (
                type(node.func) is ast.Name and not node.func.id.startswith("l_"))):
            raise Unsupported("generated source: a call of a value")
        if t is ast.arg and node.annotation is not None:
            raise Unsupported("generated source: an annotation")
    bound = {a.arg for a in fn.args.args} | {n.id for n in ast.walk(fn) if type(n) is ast.Name
                                              and type(n.ctx) is ast.Store}
    free = {n.id for n in ast.walk(fn) if type(n) is ast.Name} - bound - scope.keys() - SOURCE_BUILTINS.keys()
    if free:
        raise Unsupported(f"generated source: names it does not bind {sorted(free)}")
    try:
        code = compile(tree, filename, "exec")
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise Unsupported(f"generated source does not compile: {type(e).__name__}") from None
    scope["__builtins__"] = dict(SOURCE_BUILTINS)
    exec(code, scope)  # noqa: S102 - our own generated source, checked above (C10)
    return scope["body"]


def compile_body(env, node, *, target: str, reverse: bool, start: int, ns_names: tuple[str, ...],
                 outer_names: tuple[str, ...], uses_messages: bool, missing: Any) -> Callable:
    """The compiled twin of the loop body ``node`` (a ``jinja2.nodes.Template``) for one specialization:
    the loop's form (``reverse``, ``start``), the names that hold namespaces and those that hold plain outer
    values in the body's context, whether the context holds the ``messages`` view. ``missing``: the value
    the session's state uses for an absent namespace attribute (``session.MISSING``).

    Raises:
        Unsupported: the body, or the environment, is outside what :mod:`.bodycode` models.
    """
    why = environment_supported(env)
    if why is not None:
        raise Unsupported(why)
    gen = _Gen(env, target=target, reverse=reverse, start=start, ns_names=frozenset(ns_names),
               outer_names=frozenset(outer_names), uses_messages=uses_messages)
    source = gen.source(node)
    nsr, cmp_ = _make_ns_read(missing)
    scope = {"U": UNDEFINED, "Bail": Bail, "_dg": dict.get, "_gi": _gi, "_sm": _sm, "_call": _call,
             "_call1": _call1, "_seq": _seq, "_concat": _concat, "_nsr": nsr, "_cmp": cmp_, "_nsw": _nsw,
             "_cmpv": _cmpv, "_mget": _mget, "_mlen": _mlen, "_bail": _bail, **gen.consts}
    fn = _load(source, scope, f"<chat body {target}>")
    fn.source = source
    return fn


def compile_plain(env, node, *, present: frozenset[str]) -> Callable:
    """The compiled twin of a plain segment ``node`` (a ``jinja2.nodes.Template`` of root statements) for
    the variables whose names are ``present``: ``fn(variables, built) -> (output, exported)``, where
    ``built`` holds the ids of the request's own variables (plain by construction) and ``exported`` is the
    jinja2 render's ``context.vars`` (every root assignment, names starting with ``_`` included: C9).

    Raises:
        Unsupported: the segment, or the environment, is outside what :mod:`.bodycode` models.
    """
    why = environment_supported(env)
    if why is not None:
        raise Unsupported(why)
    ns_class = env.globals.get("namespace")
    gen = _Gen(env, target=None, reverse=False, start=0, ns_names=frozenset(), outer_names=frozenset(present),
               uses_messages=False, plain=True)
    source = gen.source(node)
    pv, gap = _make_plain_helpers(ns_class)
    scope = {"U": UNDEFINED, "Bail": Bail, "_ga": _ga, "_gi": _gi, "_sm": _sm, "_call": _call, "_call1": _call1,
             "_seq": _seq, "_concat": _concat, "_bail": _bail, "_pv": pv, "_gap": gap, "_ex": _ex,
             **gen.consts}
    fn = _load(source, scope, "<chat plain segment>")
    fn.source = source
    return fn


class _Gen:
    def __init__(self, env, *, target, reverse, start, ns_names, outer_names, uses_messages, plain=False):
        self.plain = plain
        self.loop_depth = 0
        self.env = env
        self.target = target
        self.reverse = reverse
        self.start = start
        self.ns_names = ns_names
        self.outer_names = outer_names
        self.uses_messages = uses_messages
        self.lines: list[str] = []
        self.depth = 1
        self.consts: dict[str, Any] = {}
        self.special: dict[str, tuple[str, str]] = {}  # jinja2 ref -> (kind, name)
        self.inner: dict[str, tuple[str, str]] = {}  # an inner loop's ``loop`` ref -> (index var, length var)
        self.loop_attrs: set[str] = set()
        self.counter = 0

    # -------------------------------------------------------------- output

    def line(self, text: str) -> None:
        self.lines.append("    " * self.depth + text)

    def const(self, value) -> str:
        name = f"_k{len(self.consts)}"
        self.consts[name] = value
        return name

    def fresh(self, stem: str) -> str:
        self.counter += 1
        return f"_{stem}{self.counter}"

    def source(self, node) -> str:
        from jinja2 import nodes
        from jinja2.compiler import find_undeclared
        from jinja2.idtracking import Symbols

        if not isinstance(node, nodes.Template):
            raise Unsupported("not a template node")
        if "self" in find_undeclared(node.body, ("self",)):
            raise Unsupported("the body reads 'self'")
        sym = Symbols()
        sym.analyze_node(node)
        self.enter_frame(sym)
        self.block(node.body, sym)
        body = self.lines
        self.lines = []
        if self.plain:
            return "\n".join(["def body(variables, built):", "    _o = []", "    _a = _o.append", "    _x = {}"]
                             + body + ["    return ''.join(_o), _x", ""])
        head = ["def body(elem, p, n, chat, state, rec, outer):",
                "    _o = []", "    _a = _o.append"]
        if self.loop_attrs:
            head.append("    _lr = rec.loop_reads.__setitem__")
            if self.reverse:
                head += ["    _len = n", "    _t = n - 1 - p"]
            else:
                head += [f"    _len = n - {self.start}", f"    _t = p - {self.start}"]
            for attr in sorted(self.loop_attrs):
                head.append(f"    _L_{attr} = {_LOOP_SOURCE[attr]}")
        return "\n".join(head + body + ["    return ''.join(_o)", ""])

    # -------------------------------------------------------------- frames (C1, C2)

    def classify(self, name: str) -> str:
        """What the jinja2 path's body context holds for ``name`` (C1; a plain segment: C9)."""
        if self.plain:
            if name in self.outer_names:
                return _VALUE
            return _GLOBAL if name in self.env.globals else "undefined"
        if name == COMPARE:
            return _COMPARE
        if name in self.ns_names:
            return _NS
        if name == "messages" and self.uses_messages:
            return _MESSAGES
        if name == "loop":
            return _LOOP
        if name == self.target or name in self.outer_names:
            return _VALUE
        if name in self.env.globals:
            return _GLOBAL
        return "undefined"

    def enter_frame(self, sym) -> None:
        from jinja2.idtracking import VAR_LOAD_ALIAS, VAR_LOAD_PARAMETER, VAR_LOAD_RESOLVE, VAR_LOAD_UNDEFINED

        for ref, (action, param) in sym.loads.items():
            if action == VAR_LOAD_PARAMETER:
                continue
            if action == VAR_LOAD_RESOLVE:
                kind = self.classify(param)
                if kind == _VALUE:
                    if self.plain:
                        self.line(f"{ref} = _pv(variables[{param!r}], built)")
                    else:
                        self.line(f"{ref} = elem" if param == self.target else f"{ref} = outer[{param!r}]")
                elif kind == "undefined":
                    self.line(f"{ref} = U")
                else:
                    if param in sym.stores:
                        raise Unsupported(f"the body assigns {param!r}")
                    self.special[ref] = (kind, param)
            elif action == VAR_LOAD_ALIAS:
                if param in self.special:
                    raise Unsupported(f"the body aliases {self.special[param][1]!r}")
                self.line(f"{ref} = {param}")
            elif action == VAR_LOAD_UNDEFINED:
                self.line(f"{ref} = U")
            else:
                raise Unsupported(f"load {action}")

    def ref(self, name: str, sym) -> str:
        ref = sym.find_ref(name)
        if ref is None:
            raise Unsupported(f"no reference for {name!r}")
        return ref

    def special_of(self, node, sym) -> tuple[str, str] | None:
        """``(kind, name)`` when ``node`` is a name that resolves to a special object (C2)."""
        from jinja2 import nodes

        if isinstance(node, nodes.Name) and node.ctx == "load":
            return self.special.get(self.ref(node.name, sym))
        return None

    def inner_of(self, node, sym) -> tuple[str, str] | None:
        from jinja2 import nodes

        if isinstance(node, nodes.Name) and node.ctx == "load":
            return self.inner.get(self.ref(node.name, sym))
        return None

    # -------------------------------------------------------------- statements (C7)

    def block(self, stmts, sym) -> None:
        before = len(self.lines)
        for s in stmts:
            self.stmt(s, sym)
        if len(self.lines) == before:
            self.line("pass")

    def stmt(self, node, sym) -> None:
        from jinja2 import nodes

        kind = type(node).__name__
        if kind == "Output":
            consts: list[str] = []
            for child in node.nodes:
                if isinstance(child, nodes.TemplateData):
                    consts.append(child.data)
                    continue
                if isinstance(child, nodes.Const) and type(child.value) is str:
                    consts.append(child.value)
                    continue
                if consts:
                    self.line(f"_a({''.join(consts)!r})")
                    consts = []
                self.line(f"_a(str({self.expr(child, sym)}))")
            if consts:
                self.line(f"_a({''.join(consts)!r})")
        elif kind == "If":
            self.line(f"if {self.expr(node.test, sym)}:")
            self.indented(node.body, sym)
            for elif_ in node.elif_:
                self.line(f"elif {self.expr(elif_.test, sym)}:")
                self.indented(elif_.body, sym)
            if node.else_:
                self.line("else:")
                self.indented(node.else_, sym)
        elif kind == "Assign":
            value = self.expr(node.node, sym)
            tgt = node.target
            if isinstance(tgt, nodes.Name):
                ref = self.ref(tgt.name, sym)
                if ref in self.special or ref in self.inner:
                    raise Unsupported(f"the body assigns {tgt.name!r}")
                self.line(f"{ref} = {value}")
                if self.plain and not self.loop_depth:
                    # a root-frame assignment (the root or a root-level if): ``context.vars``; an undefined
                    # value raises (UNDEFINED must not reach the variables)
                    self.line(f"_x[{tgt.name!r}] = _ex({ref})")
            elif isinstance(tgt, nodes.NSRef) and self.plain:
                raise Unsupported("a namespace write in a plain segment")
            elif isinstance(tgt, nodes.NSRef):
                sp = self.special.get(self.ref(tgt.name, sym))
                if sp is None or sp[0] != _NS or tgt.attr.startswith("_"):
                    # jinja2 raises: not a namespace (TemplateRuntimeError), or an underscore name (SecurityError)
                    self.line(f"_bail({value})")
                else:
                    self.line(f"_nsw(rec.writes, {(sp[1], tgt.attr)!r}, {value})")
            else:
                raise Unsupported(f"assignment to a {type(tgt).__name__}")
        elif kind == "For":
            self.for_(node, sym)
        elif kind in ("Break", "Continue"):
            self.line(kind.lower())
        else:
            raise Unsupported(f"statement {kind}")

    def indented(self, stmts, sym) -> None:
        self.depth += 1
        self.block(stmts, sym)
        self.depth -= 1

    def for_(self, node, sym) -> None:
        from jinja2 import nodes
        from jinja2.compiler import find_undeclared
        from jinja2.idtracking import Symbols

        if node.else_ or node.test is not None or node.recursive:
            raise Unsupported("a nested for with else, if or recursive")
        if not isinstance(node.target, nodes.Name):
            raise Unsupported("a nested for that unpacks its target")
        if any(b.scoped for b in node.find_all(nodes.Block)):
            raise Unsupported("a scoped block")
        extended = "loop" in find_undeclared(node.iter_child_nodes(only=("body",)), ("loop",))
        seq = self.expr(node.iter, sym)  # the iterable is evaluated in the outer frame (visit_For)
        lsym = Symbols(parent=sym)
        loop_ref = lsym.declare_parameter("loop") if extended else None
        lsym.analyze_node(node, for_branch="body")
        # jinja2 names a frame's locals by depth (l_<level>_<name>): a sibling frame at the same depth reuses
        # a ref, so what an earlier sibling made of it (a special name, a nested loop's loop) is dropped here
        # before this frame binds its own (C1, C2)
        for ref in lsym.loads:
            self.special.pop(ref, None)
            self.inner.pop(ref, None)
        target = lsym.ref(node.target.name)
        it = self.fresh("it")
        self.line(f"{it} = _seq({seq})")
        if extended:
            i, length = self.fresh("i"), self.fresh("n")
            self.inner[loop_ref] = (i, length)
            self.line(f"{length} = len({it})")
            self.line(f"for {i}, {target} in enumerate({it}):")
        else:
            self.line(f"for {target} in {it}:")
        self.depth += 1
        self.loop_depth += 1
        self.enter_frame(lsym)
        self.block(node.body, lsym)
        self.loop_depth -= 1
        self.depth -= 1

    # -------------------------------------------------------------- expressions (C3-C6)

    def expr(self, node, sym) -> str:
        from jinja2 import nodes

        kind = type(node).__name__
        if kind == "Const":
            v = node.value
            if v is None or type(v) in (str, int, bool):
                return repr(v)
            if type(v) is float:
                return self.const(v)
            if type(v) in (tuple, list) and all(x is None or type(x) in (str, int, bool) for x in v):
                return repr(v)  # a literal the optimizer folded (``x in ['a', 'b']``): a new one per evaluation
            raise Unsupported(f"a constant of type {type(v).__name__}")
        if kind == "TemplateData":
            return repr(node.data)
        if kind == "Name":
            if node.ctx != "load":
                raise Unsupported("a name that is not loaded")
            ref = self.ref(node.name, sym)
            if ref in self.special or ref in self.inner:
                raise Unsupported(f"{node.name!r} used other than as the compiled code models it")
            return ref
        if kind == "Getattr":
            return self.getattr(node, sym)
        if kind == "Getitem":
            return self.getitem(node, sym)
        if kind in _BINOPS:
            return f"({self.expr(node.left, sym)} {_BINOPS[kind]} {self.expr(node.right, sym)})"
        if kind in _UNOPS:
            return f"({_UNOPS[kind]}{self.expr(node.node, sym)})"
        if kind == "Compare":
            parts = [self.expr(node.expr, sym)]
            for op in node.ops:
                if op.op not in _CMP:
                    raise Unsupported(f"comparison {op.op}")
                parts.append(f"{_CMP[op.op]} {self.expr(op.expr, sym)}")
            return "(" + " ".join(parts) + ")"
        if kind == "Concat":
            return "_concat((" + "".join(self.expr(x, sym) + ", " for x in node.nodes) + "))"
        if kind == "CondExpr":
            # without ``else``: jinja2's ``cond_expr_undefined(...)``, an ``Undefined`` (C3)
            other = "U" if node.expr2 is None else self.expr(node.expr2, sym)
            return f"({self.expr(node.expr1, sym)} if {self.expr(node.test, sym)} else {other})"
        if kind == "Filter":
            return self.filter(node, sym)
        if kind == "Test":
            return self.test(node, sym)
        if kind == "Call":
            return self.call(node, sym)
        if isinstance(node, nodes.Expr):
            raise Unsupported(f"expression {kind}")
        raise Unsupported(f"node {kind}")

    def getattr(self, node, sym) -> str:
        from toktier_backend.chat.template import DICT_ATTRIBUTES

        sp = self.special_of(node.node, sym)
        if sp is not None:
            kind, name = sp
            if kind == _LOOP and node.attr in LOOP_ATTRS:
                self.loop_attrs.add(node.attr)
                return f"(_lr({node.attr!r}, _L_{node.attr}) or _L_{node.attr})"
            if kind == _NS:
                return f"_nsr(state, rec.ns_reads, rec.writes, {(name, node.attr)!r})"
            raise Unsupported(f"{name}.{node.attr}")
        inner = self.inner_of(node.node, sym)
        if inner is not None:
            if node.attr not in _INNER_SOURCE:
                raise Unsupported(f"loop.{node.attr} of a nested loop")
            i, length = inner
            return _INNER_SOURCE[node.attr].format(i=i, n=length)
        if node.attr in DICT_ATTRIBUTES:
            raise Unsupported(f"attribute {node.attr!r} (a dict attribute name)")
        if self.plain:
            if node.attr[:1] != "_":
                return f"_gap({self.expr(node.node, sym)}, {node.attr!r})"
            return f"_ga({self.expr(node.node, sym)}, {node.attr!r})"
        return f"_dg({self.expr(node.node, sym)}, {node.attr!r}, U)"  # dict.get (C4)

    def getitem(self, node, sym) -> str:
        from jinja2 import nodes

        sp = self.special_of(node.node, sym)
        if isinstance(node.arg, nodes.Slice):
            if sp is not None:
                raise Unsupported("a slice of a special name")
            s = node.arg
            parts = [self.expr(x, sym) if x is not None else "" for x in (s.start, s.stop)]
            step = f":{self.expr(s.step, sym)}" if s.step is not None else ""
            return f"({self.expr(node.node, sym)}[{parts[0]}:{parts[1]}{step}])"
        if sp is not None:
            if sp[0] == _MESSAGES:
                return f"_mget(chat, rec, {self.expr(node.arg, sym)})"
            raise Unsupported(f"an item of {sp[1]!r}")
        return f"_gi({self.expr(node.node, sym)}, {self.expr(node.arg, sym)})"

    def arguments(self, node, sym) -> tuple[list[str], list[str]]:
        if node.dyn_args is not None or node.dyn_kwargs is not None:
            raise Unsupported("*args or **kwargs")
        args = [self.expr(a, sym) for a in node.args]
        kwargs = [f"{kw.key!r}: {self.expr(kw.value, sym)}" for kw in node.kwargs]
        return args, kwargs

    def filter(self, node, sym) -> str:
        from jinja2.utils import _PassArg

        if node.node is None:
            raise Unsupported("a filter block")
        sp = self.special_of(node.node, sym)
        if sp is not None:
            if sp[0] == _MESSAGES and node.name in ("length", "count") and not (node.args or node.kwargs
                                                                                  or node.dyn_args or node.dyn_kwargs):
                return "_mlen(rec, n)"
            raise Unsupported(f"filter {node.name} of {sp[1]!r}")
        if node.name not in FILTERS:
            raise Unsupported(f"filter {node.name}")
        return self.env_call(self.env.filters[node.name], node, sym, _PassArg)

    def test(self, node, sym) -> str:
        from jinja2.utils import _PassArg

        if self.special_of(node.node, sym) is not None:
            raise Unsupported("a test of a special name")
        if node.name in _IDENTITY_TESTS and not (node.args or node.kwargs or node.dyn_args or node.dyn_kwargs):
            if self.env.tests.get(node.name) is not _stock_test(node.name):
                raise Unsupported(f"test {node.name} is not jinja2's")
            other = "U" if node.name != "none" else "None"
            return f"({self.expr(node.node, sym)} {_IDENTITY_TESTS[node.name]} {other})"
        if node.name not in TESTS:
            raise Unsupported(f"test {node.name}")
        return self.env_call(self.env.tests[node.name], node, sym, _PassArg)

    def env_call(self, f, node, sym, pass_arg) -> str:
        if pass_arg.from_obj(f) is not None:
            raise Unsupported(f"{node.name} takes a context or environment")
        name = self.const(f)
        value = self.expr(node.node, sym)
        args, kwargs = self.arguments(node, sym)
        if not args and not kwargs:
            return f"_call1({name}, {value})"
        return f"_call({name}, ({value}, {''.join(a + ', ' for a in args)}), {{{', '.join(kwargs)}}})"

    def call(self, node, sym) -> str:
        from jinja2 import nodes

        sp = self.special_of(node.node, sym)
        if sp is not None:
            kind, name = sp
            if kind == _COMPARE:
                return self.compare_call(node, sym)
            if kind == _GLOBAL and name == "namespace" and self.plain:
                ns_class = self.env.globals["namespace"]
                if not (isinstance(ns_class, type) and ns_class.__name__ == "SafeNamespace"):
                    raise Unsupported("namespace is not the sandbox's")
                args, kwargs = self.arguments(node, sym)
                return f"_call({self.const(ns_class)}, ({''.join(a + ', ' for a in args)}), {{{', '.join(kwargs)}}})"
            if kind == _GLOBAL and name == "raise_exception":
                args, kwargs = self.arguments(node, sym)
                return f"_bail({''.join(a + ', ' for a in args)}{''.join('**{' + k + '}, ' for k in kwargs)})"
            raise Unsupported(f"a call of {name!r}")
        callee = node.node
        if isinstance(callee, nodes.Getattr) and callee.attr in STR_METHODS:
            if self.special_of(callee.node, sym) is not None or self.inner_of(callee.node, sym) is not None:
                raise Unsupported(f"a method of a special name")
            if node.kwargs:
                raise Unsupported("keyword arguments to a str method")
            obj = self.expr(callee.node, sym)
            args, _ = self.arguments(node, sym)
            return f"_sm({obj}, {callee.attr!r}, ({''.join(a + ', ' for a in args)}))"
        raise Unsupported("a call")

    def compare_call(self, node, sym) -> str:
        """The analysis' comparison recorder (O6): ``recorder(x, 'x', attr, op, side, other)``."""
        from jinja2 import nodes

        args = node.args
        if (len(args) != 6 or node.kwargs or node.dyn_args or node.dyn_kwargs
                or not all(isinstance(a, nodes.Const) for a in args[1:5])):
            raise Unsupported("a call of the comparison recorder that the analysis did not write")
        attr, op, side = args[2].value, args[3].value, args[4].value
        if op not in OPS or side not in ("left", "right"):
            raise Unsupported("a comparison the recorder does not know")
        sp = self.special_of(args[0], sym)
        # jinja2 evaluates the recorder's arguments (x, constants, then other) before the recorder reads
        # x.attr: as Python evaluates a call's arguments
        if sp is not None and sp[0] == _NS:
            return f"_cmp(state, rec, {(sp[1], attr)!r}, {op!r}, {side == 'left'}, {self.expr(args[5], sym)})"
        if sp is not None or self.inner_of(args[0], sym) is not None:
            raise Unsupported(f"a comparison of {args[0].name!r}")
        from toktier_backend.chat.template import DICT_ATTRIBUTES

        if attr in DICT_ATTRIBUTES:
            raise Unsupported(f"attribute {attr!r} (a dict attribute name)")
        return (f"_cmpv({self.expr(args[0], sym)}, {attr!r}, {op!r}, {side == 'left'}, "
                f"{self.expr(args[5], sym)})")


def _stock_test(name):
    from jinja2.tests import TESTS as STOCK

    return STOCK.get(name)
