"""Static analysis of a chat template: may it be rendered one ``messages`` iteration at a time?

:func:`analyze` parses the template (``Environment.parse`` in ``template.segment_environment()``, the full
render's configuration) and splits the root's statements into *segments*, in order:

- a **loop segment** is a root-level ``{% for x in <messages form> %}`` whose iterable is ``messages``,
  ``messages[c:]``, ``messages[::-1]``, ``messages|reverse``, or a root-level name assigned only such forms
  (``loop_messages``). Its body becomes its own template, rendered once per iteration by
  :mod:`.session`;
- a **plain segment** is every run of other root statements (prologue, epilogue, code between loops). A run
  of *reusable* statements (O7) is a segment of its own, whose output the session reuses while what it read
  is unchanged; every other plain segment is re-rendered in full on every request.

The proof obligations that make "render the segments one after another, a loop one iteration at a time" equal
to the full render (each is checked here; a template failing one gets ``Plan.reason`` and is always rendered
whole):

O1. Concatenation: the root template's output is the concatenation of its statements' outputs, so
    concatenating the segments' outputs is the full output, if every name a segment reads has the value
    the full render would give it there. Root-level ``set`` targets are exported by one segment and passed
    to the next as variables; names set inside a loop body are local to one iteration in jinja (the compiled
    body re-resolves them from the outer context at each iteration start), which is also what a fresh render
    of the body template does. No ``extends``/``block``/``include``/``import``/``macro``/``call`` at root:
    they bind names or templates across segments in ways O1 does not cover. No name or keyword name that
    Python's NFKC normalization changes: jinja2's generated code merges ``ｘ`` into ``x``, the context does not.
O2. The loop is a plain iteration: no ``else``, no ``if`` filter, not ``recursive``, a single name as
    target, no ``break``/``continue`` at body level (they act on the loop the body no longer sits in); a
    loop over messages nested anywhere but at root is not handled (the whole template renders in full).
O3. What an iteration reads: the body's free names (:func:`free_names`: jinja2's undeclared names and the
    globals it loads, which a variable may shadow) are the loop target (the message: reused only for the same
    message object, and the session reuses an object only for a message equal to the previous request's, see
    :mod:`.session`), ``loop`` (a recording stand-in whose every attribute read is recorded with its value,
    then checked against the new position and length), ``messages`` (only through ``messages[i]`` and the
    ``length``/``count``/``first``/``last`` filters, each recorded: the highest index read, or "depends on the
    length"), namespaces (every attribute read before the iteration wrote it is recorded with its value; writes
    are recorded), and other outer values, compared whole between requests (any change: no iteration is
    reused). Deterministic globals only: ``strftime_now`` and the ``random``/``lipsum``/``cycler``/``joiner``
    helpers in a body, and outer values that are not plain JSON or namespaces (macros, cyclers), disqualify
    reuse.
O4. Determinism: given equal recorded reads, the body takes the same branches and produces the same output
    and the same namespace writes (jinja expressions are pure over the sandbox's immutable values; the only
    mutable objects are namespaces, whose reads are recorded). An iteration that raised is never cached:
    the request falls back to the full render, which raises the same error.
O5. Inlining (to make reads lazy): a body-level ``{% set v = e %}`` where ``e`` is built only from integer
    constants, ``loop.<attr>``, ``messages|length`` and ``+ - *`` (total: it cannot raise and has no effect),
    reading ``loop`` or the length (a constant, substituted, could be folded by jinja2's optimizer together with
    the expression around the read, where the local is not),
    ``v`` is assigned nowhere else in the body, is not read before it, and is not read inside a nested loop
    (where ``loop`` means another loop), is removed and ``e`` substituted at each read of ``v``: the value is
    the same at every read, so output is unchanged, while an iteration that never reads ``v`` no longer
    records the reads of ``e``. (Qwen3's reverse scan: ``index`` is computed from ``loop.index0`` and the
    length but read only when the user query is found.)
O5b. Position (to make reads independent of the length): in a loop over ``messages[::-1]`` or
    ``messages|reverse`` (every message, in reverse; not through an alias), ``(messages|length - 1) -
    loop.index0`` and ``messages|length - loop.index0 - 1`` are replaced by ``loop.revindex0`` wherever
    ``loop`` is this loop's (not inside a nested ``for``) and the body never stores ``messages`` or
    ``loop``. Both are the same int: the length ``n`` is the iterated list's, ``index0 = n - 1 - p`` at
    message position ``p``, and ``revindex0 = n - 1 - index0 = p``. A record then reads the position, which
    does not change when messages are appended. (Qwen3's reverse scan writes ``ns.last_query_index =
    index``: its match is no longer re-rendered on every turn.)
O6. Comparisons: ``x.attr <op> e`` (or ``e <op> x.attr``) with ``<op>`` one of ``== != > >= < <=`` and
    ``e`` total as in O5 is rewritten to a call of the recorder with ``x``'s name, the attribute, the op and
    ``e``; it evaluates exactly what jinja would (the sandbox's ``getattr``, then Python's operator) and,
    when ``x`` is a namespace, records the outcome instead of the value: the iteration depends on
    ``x.attr`` only through that outcome. (Qwen3's ``loop.index0 > ns.last_query_index``: a new user query
    moves the index but leaves the outcome of earlier turns unchanged.) The recorder's name is bound in
    loop bodies only: a template that names it itself is not incremental (it would read the recorder where
    the reference reads an undefined).
O7. Reusable plain statements: a root statement other than a loop over messages that contains no
    ``set`` (``Assign``, ``AssignBlock``, namespace attribute targets), no macro, call block, ``with``,
    include or import (so it binds no name and writes no namespace: its only effect is its output, or an
    error), calls none of the nondeterministic globals of O3 and no ``random`` filter, reads no alias of
    messages, and reads ``messages`` only as O3 allows. Its output is then a function of its free names'
    values (jinja expressions are pure over the sandbox's immutable values, O4) and of the messages it
    reads. The session renders it with ``messages`` as a recording view (highest index read, whether it
    read the length) and the other free names' values compared whole with the previous request's (``same``),
    and reuses its output when those are equal, every message it read lies before the first changed
    position, and the length is unchanged if it read it. At render time a free name whose value is not a
    plain JSON value (a namespace, a macro), or ``messages`` rebound at root (``set messages = ...``),
    renders it in full. (Qwen3's and Qwen2.5's ``{% if tools %}`` prologue writes the tools' JSON on every
    request otherwise.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from toktier_backend.errors import UnsupportedTokenizer

COMPARE = "toktier_compare__"  # the body's name for the comparison recorder (O6)
_CMP_OPS = frozenset({"eq", "ne", "gt", "gteq", "lt", "lteq"})
_NONDETERMINISTIC = frozenset({"strftime_now", "lipsum", "cycler", "joiner"})
_MESSAGE_FILTERS = frozenset({"length", "count", "first", "last"})
_ROOT_UNSUPPORTED = ("Extends", "Block", "Include", "Import", "FromImport", "Macro", "CallBlock", "Scope",
                     "ScopedEvalContextModifier", "OverlayScope")


class IterForm(NamedTuple):
    """A loop's iterable as positions in ``messages``: ``messages[start:]`` forward, or all of it reversed.
    (A named tuple: compared and hashed in C, on every request.)"""

    start: int
    reverse: bool


class Compiled:
    """A jinja2 ``Template`` with a context builder that skips the template's ``ChainMap`` of globals.

    ``new_context(variables)`` returns the context ``template.new_context(variables)`` returns (jinja2 3.1
    ``runtime.new_context`` with ``shared=False``, no locals: ``Context(environment, dict(globals,
    **variables), name, blocks, globals=globals)``), from a dict copy of the globals taken here. Equal
    because the sandbox's globals are set when its environment is built (``template.segment_environment``)
    and never changed after, and a template compiled from a node has no globals of its own. Iterating a
    ``ChainMap`` runs in Python, key by key, twice per context (the parent dict and ``globals_keys``).
    """

    __slots__ = ("template", "root_render_func", "_globals", "_context_class", "_env", "_name", "_blocks")

    def __init__(self, template):
        self.template = template
        self.root_render_func = template.root_render_func
        self._globals = dict(template.globals)
        self._env = template.environment
        self._context_class = self._env.context_class
        self._name = template.name
        self._blocks = template.blocks

    def new_context(self, variables: dict):
        parent = self._globals.copy()
        parent.update(variables)
        return self._context_class(self._env, parent, self._name, self._blocks, globals=self._globals)


@dataclass
class LoopSegment:
    """A root loop over messages. ``forms`` holds one entry for a direct iterable, or the candidates of an
    alias (which one ran is decided at render time by comparing the alias's value with each)."""

    target: str
    alias: str | None
    forms: tuple[IterForm, ...]
    body: Compiled  # the (inlined) body
    free: frozenset[str]
    uses_messages: bool
    outer_names: tuple[str, ...] = ()  # ``free`` less the target, ``loop`` and ``messages``, sorted (O3)
    node: object = None  # the body's ``jinja2.nodes.Template`` (what :mod:`.bodycode` compiles)
    # compiled twins of the body by specialization (:meth:`.session.ChatSession._fast_body`); ``None``: refused
    fast: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class PlainSegment:
    """A run of root statements, rendered whole. ``reusable``: every statement satisfies O7; ``free``: the
    names they read (with ``messages`` if ``uses_messages``)."""

    template: Compiled
    reusable: bool = False
    free: frozenset[str] = frozenset()
    uses_messages: bool = False
    node: object = None  # the statements' ``jinja2.nodes.Template`` (what :mod:`.bodycode` compiles)
    # compiled twins by the free names the variables hold (:meth:`.session.ChatSession._fast_plain`)
    fast: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class Plan:
    """Result of :func:`analyze`. ``reason`` is ``None`` when the template renders incrementally, else why not."""

    segments: list = field(default_factory=list)
    reason: str | None = None
    inlined: tuple[str, ...] = ()
    observes_message_order: bool = True  # may the template see a message dict's key order (O3, messages)
    # paths inside a message (keys; "*" any key or index) where a dict's key order may be seen: iterated
    # (flat) or written out with everything under it (deep); None: anywhere (not analysed)
    order_paths: tuple[frozenset, frozenset] | None = None

    @property
    def incremental(self) -> bool:
        return self.reason is None


def analyze(source: str) -> Plan:
    """Split ``source`` into segments (module docstring) or give the reason it must render whole.

    Raises:
        UnsupportedTokenizer: the template does not parse.
    """
    import jinja2

    from toktier_backend.chat.template import segment_environment

    env = segment_environment()  # the full render's configuration; its own getattr (template.PlainFastSandbox)
    try:
        root = env.parse(source)
    except jinja2.TemplateError as e:
        raise UnsupportedTokenizer(f"chat template does not compile: {e}") from e
    try:
        plan = _plan(env, root)
    except _NotIncremental as e:
        return Plan(reason=str(e))
    plan.observes_message_order = _observes_message_order(root, _aliases(root))
    plan.order_paths = _order_paths(root, _aliases(root))
    return plan


class _NotIncremental(Exception):
    pass


def _plan(env, root) -> Plan:
    import unicodedata

    from jinja2 import nodes

    # jinja2 writes names and keyword names into Python source, where the parser NFKC-normalizes
    # identifiers ("ｘ" and "x" are one local), while the context keeps them as written: the segments'
    # bookkeeping keys names as written, so such a template renders whole
    written = {n.name for n in root.find_all(nodes.Name)} | {k.key for k in root.find_all(nodes.Keyword)}
    odd = sorted(x for x in written if unicodedata.normalize("NFKC", x) != x)
    if odd:
        raise _NotIncremental(f"names that Python normalizes (NFKC): {odd!r} (O1)")
    for node in root.body:
        if type(node).__name__ in _ROOT_UNSUPPORTED:
            raise _NotIncremental(f"root-level {type(node).__name__} (O1)")
    if any(n.name == COMPARE for n in root.find_all(nodes.Name)):
        raise _NotIncremental(f"the template names {COMPARE!r}, the loop bodies' comparison recorder")
    aliases = _aliases(root)
    plan = Plan()
    pending: list = []
    loops = 0
    for node in root.body:
        forms = _iter_forms(node, aliases) if isinstance(node, nodes.For) else None
        if forms is None:
            if _mentions_message_loop(node, aliases):
                raise _NotIncremental(f"a loop over messages that is not at root level, line {node.lineno} (O2)")
            pending.append(node)
            continue
        plan.segments += _plain_segments(env, pending, aliases)
        pending = []
        plan.segments.append(_loop_segment(env, node, forms, aliases, plan))
        loops += 1
    plan.segments += _plain_segments(env, pending, aliases)
    if not loops:
        raise _NotIncremental("no root-level loop over messages")
    return plan


# what O7 refuses inside a statement: the root-level binders of O1, and every kind of assignment or scope
_BINDS = frozenset(_ROOT_UNSUPPORTED) | {"Assign", "AssignBlock", "NSRef", "With", "EvalContextModifier"}


def free_names(env, node) -> frozenset[str]:
    """The names ``node`` (a ``jinja2.nodes.Template``) reads from its context: jinja2's undeclared names,
    and the environment's global names it loads (``find_undeclared_variables`` leaves those out, yet a
    variable of the same name, passed or set at root, shadows the global in the context)."""
    import jinja2.meta
    from jinja2 import nodes

    loaded_globals = {n.name for n in node.find_all(nodes.Name) if n.ctx == "load" and n.name in env.globals}
    return frozenset(jinja2.meta.find_undeclared_variables(node)) | loaded_globals


def _plain_segments(env, stmts, aliases) -> list:
    """A run of root statements as plain segments: each maximal run of O7-reusable statements, and each
    maximal run of the others, in order (concatenation, O1)."""
    from jinja2 import nodes

    out: list = []
    i = 0
    while i < len(stmts):
        ok = _reusable(env, stmts[i], aliases)
        j = i + 1
        while j < len(stmts) and _reusable(env, stmts[j], aliases) == ok:
            j += 1
        node = nodes.Template(stmts[i:j], lineno=1).set_environment(env)
        compiled = Compiled(env.from_string(node))
        free = free_names(env, nodes.Template(stmts[i:j], lineno=1).set_environment(env))
        out.append(PlainSegment(compiled, ok, free, ok and "messages" in free, node=node))
        i = j
    return out


def _reusable(env, node, aliases) -> bool:
    """Does the root statement ``node`` satisfy O7 (module docstring)?"""
    from jinja2 import nodes

    if type(node).__name__ in _BINDS or any(type(n).__name__ in _BINDS for n in node.find_all(nodes.Node)):
        return False
    tmpl = nodes.Template([node], lineno=1).set_environment(env)
    loaded = {n.name for n in tmpl.find_all(nodes.Name) if n.ctx == "load"}
    if loaded & (_NONDETERMINISTIC | set(aliases)):
        return False
    if any(f.name == "random" for f in tmpl.find_all(nodes.Filter)):
        return False
    try:
        _check_message_uses(tmpl, f"line {node.lineno}")
    except _NotIncremental:
        return False
    return True


def _message_form(expr) -> IterForm | None:
    from jinja2 import nodes

    if isinstance(expr, nodes.Name) and expr.name == "messages":
        return IterForm(0, False)
    if isinstance(expr, nodes.Filter) and expr.name == "reverse" and not (expr.args or expr.kwargs or expr.dyn_args
                                                                          or expr.dyn_kwargs):
        inner = _message_form(expr.node)
        return IterForm(0, True) if inner == IterForm(0, False) else None
    if (isinstance(expr, nodes.Getitem) and isinstance(expr.node, nodes.Name) and expr.node.name == "messages"
            and isinstance(expr.arg, nodes.Slice) and expr.arg.stop is None):
        start, step = _const_int(expr.arg.start), _const_int(expr.arg.step)
        if expr.arg.step is None or step == 1:
            s = 0 if expr.arg.start is None else start
            if s is not None and s >= 0:
                return IterForm(s, False)
        elif step == -1 and expr.arg.start is None:
            return IterForm(0, True)
    return None


def _const_int(expr):
    from jinja2 import nodes

    if isinstance(expr, nodes.Const) and type(expr.value) is int:
        return expr.value
    if isinstance(expr, nodes.Neg):
        inner = _const_int(expr.node)
        return None if inner is None else -inner
    return None


def _aliases(root) -> dict[str, tuple[IterForm, ...]]:
    """Root-level names assigned only messages forms (in root statements or root ``if`` branches, never in a
    loop): name -> the candidate forms. A name assigned anything else anywhere is not an alias."""
    from jinja2 import nodes

    found: dict[str, list] = {}
    bad: set[str] = set()

    def visit(stmts, in_loop):
        for n in stmts:
            if isinstance(n, nodes.Assign) and isinstance(n.target, nodes.Name):
                form = _message_form(n.node)
                if form is None or in_loop:
                    bad.add(n.target.name)
                else:
                    found.setdefault(n.target.name, []).append(form)
            for child in n.iter_child_nodes():
                if isinstance(child, nodes.Stmt):
                    visit([child], in_loop or isinstance(n, (nodes.For, nodes.Macro, nodes.CallBlock)))
            if isinstance(n, nodes.AssignBlock) and isinstance(n.target, nodes.Name):
                bad.add(n.target.name)
            if isinstance(n, nodes.For):
                for t in n.target.find_all(nodes.Name):
                    bad.add(t.name)

    visit(root.body, False)
    return {k: tuple(dict.fromkeys(v)) for k, v in found.items() if k not in bad}


def _iter_forms(node, aliases) -> tuple[IterForm, ...] | None:
    from jinja2 import nodes

    form = _message_form(node.iter)
    if form is not None:
        return (form,)
    if isinstance(node.iter, nodes.Name) and node.iter.name in aliases:
        return aliases[node.iter.name]
    return None


def _mentions_message_loop(node, aliases) -> bool:
    from jinja2 import nodes

    return any(_iter_forms(f, aliases) is not None for f in node.find_all(nodes.For))


def _loop_segment(env, node, forms, aliases, plan) -> LoopSegment:
    from jinja2 import nodes

    where = f"line {node.lineno}"
    if node.else_ or node.test is not None or node.recursive:
        raise _NotIncremental(f"the loop at {where} has else/if/recursive (O2)")
    if not isinstance(node.target, nodes.Name):
        raise _NotIncremental(f"the loop at {where} unpacks its target (O2)")
    for ctl in _outside_nested_loops(node.body, (nodes.Break, nodes.Continue)):
        raise _NotIncremental(f"break/continue in the loop body at line {ctl.lineno} (O2)")
    for f in node.find_all(nodes.For):
        if _iter_forms(f, aliases) is not None:
            raise _NotIncremental(f"a loop over messages inside the loop at {where} (O2)")
    body = list(node.body)
    body, inlined = _inline(body)
    plan.inlined += inlined
    if forms == (IterForm(0, True),) and not isinstance(node.iter, nodes.Name):
        body = _rewrite_positions(body)
    body = [_rewrite_compares(stmt) for stmt in body]
    tmpl_node = nodes.Template(body, lineno=1).set_environment(env)
    free = free_names(env, tmpl_node) - {COMPARE}
    bad = free & _NONDETERMINISTIC
    if bad:
        raise _NotIncremental(f"the loop body at {where} calls {sorted(bad)} (O3)")
    for flt in tmpl_node.find_all(nodes.Filter):
        if flt.name == "random":
            raise _NotIncremental(f"the loop body at {where} uses the random filter (O3)")
    uses_messages = "messages" in free
    if uses_messages:
        _check_message_uses(tmpl_node, where)
    alias = node.iter.name if isinstance(node.iter, nodes.Name) and node.iter.name != "messages" else None
    if alias is not None and alias in free:
        raise _NotIncremental(f"the loop body at {where} reads {alias!r} (O3: only messages is modelled)")
    return LoopSegment(target=node.target.name, alias=alias, forms=forms, body=Compiled(env.from_string(tmpl_node)),
                       free=free, uses_messages=uses_messages,
                       outer_names=tuple(sorted(free - {node.target.name, "loop", "messages"})), node=tmpl_node)


def _outside_nested_loops(stmts, kinds):
    from jinja2 import nodes

    for n in stmts:
        if isinstance(n, kinds):
            yield n
        if isinstance(n, nodes.For):
            continue
        yield from _outside_nested_loops(list(n.iter_child_nodes()), kinds)


def _check_message_uses(tmpl_node, where) -> None:
    """``messages`` only as ``messages[i]``, ``messages|length`` (count/first/last), a loop iterable or a
    test operand (O3); anything else (a method call, ``messages.x``) is not modelled."""
    from jinja2 import nodes

    allowed: set[int] = set()
    for n in tmpl_node.find_all(nodes.Getitem):
        if isinstance(n.node, nodes.Name):
            allowed.add(id(n.node))
    for n in tmpl_node.find_all(nodes.Filter):
        if n.name in _MESSAGE_FILTERS and isinstance(n.node, nodes.Name):
            allowed.add(id(n.node))
    for n in tmpl_node.find_all(nodes.Test):
        if isinstance(n.node, nodes.Name):
            allowed.add(id(n.node))
    for n in tmpl_node.find_all(nodes.For):
        if isinstance(n.iter, nodes.Name):
            allowed.add(id(n.iter))
    for n in tmpl_node.find_all(nodes.Name):
        if n.name == "messages" and n.ctx == "load" and id(n) not in allowed:
            raise _NotIncremental(f"the loop body at {where} uses messages at line {n.lineno} in a way that is "
                                  "not modelled (O3)")


def _observes_message_order(root, aliases) -> bool:
    """Could the template see the key order of a message dict? A message (a loop target over messages, or
    ``messages[i]``) used only as the base of ``.attr``/``[key]`` (not ``items``/``keys``/``values``) or as
    a test operand cannot; any other use (output, a filter, iteration, a call argument, an assignment) is
    taken to see it. Then the session compares key order too (module docstring of :mod:`.session`)."""
    from jinja2 import nodes

    lists = {"messages", *aliases}
    targets = set()
    for f in root.find_all(nodes.For):
        if _iter_forms(f, aliases) is not None and isinstance(f.target, nodes.Name):
            targets.add(f.target.name)
    parent: dict[int, object] = {}
    stack = [root]
    while stack:
        n = stack.pop()
        for c in n.iter_child_nodes():
            parent[id(c)] = n
            stack.append(c)

    def message_expr(n) -> bool:
        if isinstance(n, nodes.Name) and n.ctx == "load" and n.name in targets:
            return True
        return (isinstance(n, nodes.Getitem) and isinstance(n.node, nodes.Name) and n.node.name in lists
                and not isinstance(n.arg, nodes.Slice))

    for n in root.find_all((nodes.Name, nodes.Getitem)):
        if isinstance(n, nodes.Name) and n.name in lists and n.ctx == "load":
            up = parent.get(id(n))
            if isinstance(up, nodes.Getitem) and up.node is n and not isinstance(up.arg, nodes.Slice):
                continue
            if isinstance(up, nodes.Filter) and up.node is n and up.name in ("length", "count"):
                continue
            if isinstance(up, nodes.Test) and up.node is n:
                continue
            if isinstance(up, nodes.For) and up.iter is n:
                continue
            if isinstance(up, nodes.Assign) and up.node is n:
                continue
            if isinstance(up, nodes.Getitem) and up.node is n and isinstance(up.arg, nodes.Slice):
                continue  # a slice is a list of the same messages: its uses are those of the alias
            return True
        if not message_expr(n):
            continue
        up = parent.get(id(n))
        if isinstance(up, nodes.Getattr) and up.node is n and up.attr not in ("items", "keys", "values"):
            continue
        if isinstance(up, nodes.Getitem) and up.node is n:
            continue
        if isinstance(up, nodes.Test) and up.node is n:
            continue
        if isinstance(up, nodes.Getitem) and up.node is not n and isinstance(n, nodes.Name):
            continue  # used as an index: cannot be (a dict is not an index)
        return True
    return False


_STR_METHODS = frozenset({"startswith", "endswith", "split", "rsplit", "strip", "lstrip", "rstrip", "lower",
                          "upper", "replace", "title", "capitalize", "find", "rfind", "count"})
_ORDER_FREE_FILTERS = frozenset({"length", "count"})
_MAX_PATH = 8


def _order_paths(root, aliases):
    """Where a message value's dict key order may reach the output (for :mod:`.session`'s strict compare).

    Values derived from a message are tracked as paths (``("tool_calls", "*", "function")``) through
    ``.attr``/``[key]``, loop targets (``"*"``) and ``set`` (flow-insensitive, to a fixpoint). A use as
    an ``if``/test operand, ``==``/``!=``/``in`` operand, ``length`` filter or a str method call cannot
    see dict order; iteration sees the order of that dict (flat); anything else (output, other filters,
    call arguments, namespace writes, concatenation) is taken to see every dict under it (deep).
    """
    from jinja2 import nodes

    lists = {"messages", *aliases}
    env: dict[str, set] = {}
    for f in root.find_all(nodes.For):
        if _iter_forms(f, aliases) is not None and isinstance(f.target, nodes.Name):
            env.setdefault(f.target.name, set()).add(())

    def paths(e) -> set:
        if isinstance(e, nodes.Name):
            return env.get(e.name, set()) if e.ctx == "load" else set()
        if isinstance(e, nodes.Getattr):
            return {p + (e.attr,) for p in paths(e.node)}
        if isinstance(e, nodes.Getitem):
            if isinstance(e.node, nodes.Name) and e.node.name in lists and not isinstance(e.arg, nodes.Slice):
                return {()}
            key = e.arg.value if isinstance(e.arg, nodes.Const) and isinstance(e.arg.value, str) else "*"
            return {p + (key,) for p in paths(e.node)}
        if isinstance(e, nodes.CondExpr):
            return paths(e.expr1) | (paths(e.expr2) if e.expr2 is not None else set())
        if isinstance(e, nodes.Call) and isinstance(e.node, nodes.Getattr) and e.node.attr == "get" and e.args \
                and isinstance(e.args[0], nodes.Const) and isinstance(e.args[0].value, str):
            return {p + (e.args[0].value,) for p in paths(e.node.node)}
        return set()

    truncated: set = set()

    def cap(ps: set) -> set:
        # a self-referential ``set x = x.attr`` makes paths grow without end: past _MAX_PATH keys a path is
        # cut, and everything under the cut is taken as seen (deep)
        out = set()
        for p in ps:
            if len(p) > _MAX_PATH:
                p = p[:_MAX_PATH]
                truncated.add(p)
            out.add(p)
        return out

    changed = True
    while changed:
        changed = False
        for n in root.find_all((nodes.Assign, nodes.For)):
            if isinstance(n, nodes.For):
                tgt, src = n.target, cap({p + ("*",) for p in paths(n.iter)})
            else:
                tgt, src = n.target, cap(paths(n.node))
            if isinstance(tgt, nodes.Name) and not src <= env.get(tgt.name, set()):
                env.setdefault(tgt.name, set()).update(src)
                changed = True

    parent: dict[int, object] = {}
    stack = [root]
    while stack:
        n = stack.pop()
        for c in n.iter_child_nodes():
            parent[id(c)] = n
            stack.append(c)
    flat: set = set()
    deep: set = set()
    for e in root.find_all(nodes.Expr):
        ps = paths(e)
        if not ps:
            continue
        up = parent.get(id(e))
        if isinstance(up, (nodes.Getattr, nodes.Getitem)) and up.node is e:
            gp = parent.get(id(up))
            if isinstance(up, nodes.Getattr) and isinstance(gp, nodes.Call) and gp.node is up:
                if up.attr in _STR_METHODS or up.attr == "get":
                    continue
                if up.attr in ("items", "keys", "values"):
                    flat |= ps
                    continue
                deep |= ps
            continue
        if isinstance(up, nodes.Getitem) and up.arg is e:
            deep |= ps
            continue
        if isinstance(up, (nodes.If, nodes.CondExpr)) and getattr(up, "test", None) is e:
            continue
        if isinstance(up, nodes.Test) and up.node is e:
            continue
        if isinstance(up, (nodes.Not, nodes.And, nodes.Or)):
            continue  # truthiness; the and/or value itself is tracked by its own use
        if isinstance(up, nodes.Operand) and up.op in ("eq", "ne", "in", "notin"):
            continue
        if isinstance(up, nodes.Compare) and up.expr is e and all(o.op in ("eq", "ne", "in", "notin")
                                                                  for o in up.ops):
            continue
        if isinstance(up, nodes.Filter) and up.node is e and up.name in _ORDER_FREE_FILTERS:
            continue
        if isinstance(up, nodes.For) and up.iter is e:
            flat |= ps
            continue
        if isinstance(up, nodes.Assign) and up.node is e and isinstance(up.target, nodes.Name):
            continue
        deep |= ps
    return frozenset(flat), frozenset(deep | truncated)


def path_matches(static: tuple, path: tuple) -> bool:
    """Does a runtime ``path`` match a ``static`` one (``"*"`` matches any key or index)?"""
    return len(static) == len(path) and all(a == "*" or a == b for a, b in zip(static, path))


@lru_cache(maxsize=4096)
def order_observed(order_paths, path: tuple) -> bool:
    """May a dict at runtime ``path`` (keys; list indices as ``"*"``) have its key order seen? (Memoized:
    a plan's ``order_paths`` are fixed, and the same few paths recur in every message.)"""
    if order_paths is None:
        return True
    flat, deep = order_paths
    if any(path_matches(q, path) for q in flat):
        return True
    return any(len(q) <= len(path) and path_matches(q, path[:len(q)]) for q in deep)


# ---------------------------------------------------------------- O5: inlining total local expressions


def _loop_attr_name(expr) -> str | None:
    """``attr`` when ``expr`` is ``loop.<attr>``, else ``None``."""
    from jinja2 import nodes

    if isinstance(expr, nodes.Getattr) and isinstance(expr.node, nodes.Name) and expr.node.name == "loop":
        return expr.attr
    return None


def _messages_length(expr) -> bool:
    """Is ``expr`` ``messages|length`` (no arguments)?"""
    from jinja2 import nodes

    return (isinstance(expr, nodes.Filter) and expr.name == "length" and isinstance(expr.node, nodes.Name)
            and expr.node.name == "messages" and not (expr.args or expr.kwargs or expr.dyn_args or expr.dyn_kwargs))


def _total(expr) -> bool:
    from jinja2 import nodes

    if isinstance(expr, nodes.Const):
        return type(expr.value) is int
    if isinstance(expr, nodes.Getattr):
        return _loop_attr_name(expr) in ("index0", "index", "revindex0", "revindex", "length")
    if isinstance(expr, nodes.Filter):
        return _messages_length(expr)
    if isinstance(expr, (nodes.Add, nodes.Sub, nodes.Mul)):
        return _total(expr.left) and _total(expr.right)
    if isinstance(expr, (nodes.Neg, nodes.Pos)):
        return _total(expr.node)
    return False


def _inline(body: list) -> tuple[list, tuple[str, ...]]:
    from jinja2 import nodes

    done = []
    i = 0
    while i < len(body):
        n = body[i]
        # a constant e is left alone: substituted, it could be folded by jinja2's optimizer into the
        # expression around the read (``5[0:1]`` folds to an undefined where ``x[0:1]`` raises)
        if (isinstance(n, nodes.Assign) and isinstance(n.target, nodes.Name) and _total(n.node)
                and any(True for _ in n.node.find_all((nodes.Getattr, nodes.Filter)))
                and _inlinable(body, i, n.target.name)):
            name, expr = n.target.name, n.node
            body = body[:i] + [_substitute(s, name, expr) for s in body[i + 1:]]
            done.append(name)
            continue
        i += 1
    return body, tuple(done)


def _rewrite_positions(body: list) -> list:
    """O5b (module docstring): ``body`` of a loop over every message in reverse."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    wrapper = nodes.Template(body, lineno=1)
    if any(n.name in ("messages", "loop") and n.ctx != "load" for n in wrapper.find_all(nodes.Name)):
        return body

    def one(e):
        return isinstance(e, nodes.Const) and type(e.value) is int and e.value == 1

    def index0(e):
        return _loop_attr_name(e) == "index0"

    class Rewrite(NodeTransformer):
        def visit_For(self, node):  # noqa: N802 - inside, ``loop`` is the nested loop's
            return node

        def visit_Sub(self, node):  # noqa: N802
            node = self.generic_visit(node)
            a = node.left
            if isinstance(a, nodes.Sub) and _messages_length(a.left) and (
                    (one(a.right) and index0(node.right)) or (index0(a.right) and one(node.right))):
                return nodes.Getattr(nodes.Name("loop", "load"), "revindex0", "load").set_lineno(node.lineno)
            return node

    return [Rewrite().visit(stmt) for stmt in body]


def _rewrite_compares(stmt):
    """O6 (module docstring)."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def ns_attr(e):
        return (isinstance(e, nodes.Getattr) and isinstance(e.node, nodes.Name) and e.node.ctx == "load"
                and e.node.name not in ("loop", "messages"))

    class Rewrite(NodeTransformer):
        def visit_Compare(self, node):  # noqa: N802 - jinja visitor naming
            node = self.generic_visit(node)
            if len(node.ops) != 1 or node.ops[0].op not in _CMP_OPS:
                return node
            left, op, right = node.expr, node.ops[0].op, node.ops[0].expr
            if ns_attr(left) and _total(right):
                side, attr_node, other = "left", left, right
            elif ns_attr(right) and _total(left):
                side, attr_node, other = "right", right, left
            else:
                return node
            call = nodes.Call(nodes.Name(COMPARE, "load"),
                              [attr_node.node, nodes.Const(attr_node.node.name), nodes.Const(attr_node.attr),
                               nodes.Const(op), nodes.Const(side), other], [], None, None)
            return call.set_lineno(node.lineno)

    return Rewrite().visit(stmt)


def _inlinable(body, i, name) -> bool:
    from jinja2 import nodes

    wrapper = nodes.Template(body, lineno=1)
    stores = [n for n in wrapper.find_all(nodes.Name) if n.name == name and n.ctx != "load"]
    stores += [n for n in wrapper.find_all(nodes.NSRef) if n.name == name]
    if len(stores) != 1:
        return False
    for s in body[:i]:
        if any(n.name == name for n in s.find_all(nodes.Name)):
            return False
    for s in body[i + 1:]:
        for loop in [s] if isinstance(s, nodes.For) else list(s.find_all(nodes.For)):
            if any(n.name == name for n in loop.find_all(nodes.Name)):
                return False
        for scoped in s.find_all((nodes.Macro, nodes.CallBlock, nodes.FilterBlock, nodes.With)):
            if any(n.name == name for n in scoped.find_all(nodes.Name)):
                return False
    return True


def _substitute(stmt, name, expr):
    import copy

    from jinja2.visitor import NodeTransformer

    class Replace(NodeTransformer):
        def visit_Name(self, node):  # noqa: N802 - jinja visitor naming
            if node.name == name and node.ctx == "load":
                new = _clone(expr)
                return new.set_lineno(node.lineno)
            return node

    def _clone(e):
        env = e.environment
        return copy.deepcopy(e, {id(env): env}) if env is not None else copy.deepcopy(e)

    return Replace().visit(stmt)
