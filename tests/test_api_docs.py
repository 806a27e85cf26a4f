"""docs/api.md matches the code: every documented name exists with its documented signature.

The page's conventions (stated at its top): inside a ``## `module` `` section,
a ``### `` heading or a ``- `` bullet that starts with a code span is an entry:

    Name(params) [-> ret]     a class (its constructor) or a function
    Name.attr(params) [-> ret]  a method, written without ``self``
    Name.attr / Name          a property / any attribute (existence only)
    NAME = value              a constant (compared with the literal)

Signatures are compared with ``inspect.signature`` parameter by parameter:
name, kind, default (the documented expression evaluated in the defining
module) and annotation (both sides normalised through ``ast``), and the
return annotation for functions and methods. Parameters starting with ``_``
are internal and not documented.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

API_MD = Path(__file__).resolve().parent.parent / "docs" / "api.md"

# Entries known to differ from the code, with the reason. strict=True: once the
# code is fixed the xfail turns into a failure, and the entry comes off this list.
KNOWN_DRIFT: dict = {}

# The names the API reference must always cover.
REQUIRED = {
    "mpishard": ["Tensor", "no_grad", "Backend", "MemoryLedger", "OutOfMemoryBudget",
                 "install_abort_hook"],
    "mpishard.autodiff": ["add", "mul", "matmul", "sum", "reshape", "linear", "layer_norm",
                          "gelu", "cross_entropy", "causal_self_attention"],
    "mpishard.nn": ["Module", "Parameter", "Linear", "Embedding", "LayerNorm"],
    "mpishard.models": ["GPT", "GPTConfig", "MLPClassifier"],
    "mpishard.optim": ["AdamW", "SGD", "Adam", "CosineSchedule", "clip_grad_norm"],
    "mpishard.comm": ["Communicator", "Mesh", "Handle", "install_abort_hook", "check_launcher"],
    "mpishard.parallel": ["DataParallel", "ZeRO", "StepResult", "Strategy",
                          "ParallelModel", "Pipeline", "ColumnParallelLinear", "RowParallelLinear"],
    "mpishard.planning.memory": ["estimate_memory", "MemoryEstimate"],
    "mpishard.planning.layout": ["Layout", "estimate_layout"],
    "mpishard.data.corpus": ["load_corpus", "BatchSampler", "DataError"],
    "mpishard.checkpoint": ["save_checkpoint", "load_checkpoint", "consolidate",
                            "CheckpointError"],
}

_SECTION = re.compile(r"^## `([\w.]+)`\s*$")
_ENTRY = re.compile(r"^(?:### |- )`([^`]+)`")
_NAME = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)(.*)$", re.S)


@dataclass
class Entry:
    module: str
    text: str       # the code span
    line: int

    @property
    def qualname(self) -> str:
        return f"{self.module}.{_NAME.match(self.text).group(1)}"


def parse_entries(markdown: str) -> list[Entry]:
    """Every entry of an API page: code spans opening a ``###`` heading or a bullet."""
    entries, module = [], None
    in_fence = False
    for number, line in enumerate(markdown.splitlines(), start=1):
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        section = _SECTION.match(line)
        if section:
            module = section.group(1)
            continue
        entry = _ENTRY.match(line)
        if entry and module is not None:
            entries.append(Entry(module, entry.group(1), number))
    return entries


# -- what the code says ---------------------------------------------------------

def _resolve(entry: Entry):
    """(object, kind, owner class or None, module globals) for an entry's name."""
    module = importlib.import_module(entry.module)
    name = _NAME.match(entry.text).group(1)
    head, _, attr = name.partition(".")
    exported = getattr(module, "__all__", None)
    if exported is not None and head not in exported:
        raise LookupError(f"{entry.module}.{head} is not in {entry.module}.__all__")
    if not hasattr(module, head):
        raise LookupError(f"{entry.module} has no attribute {head!r}")
    obj = getattr(module, head)
    if not attr:
        kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "value"
        defining = sys.modules.get(getattr(obj, "__module__", None) or "", module)
        return obj, kind, None, vars(defining)
    if not inspect.isclass(obj):
        raise LookupError(f"{entry.module}.{head} is not a class, so it has no {attr!r}")
    try:
        static = inspect.getattr_static(obj, attr)
    except AttributeError:
        raise LookupError(f"{entry.module}.{head} has no attribute {attr!r}") from None
    defining = vars(sys.modules[obj.__module__])
    if isinstance(static, property):
        return static, "property", obj, defining
    if isinstance(static, classmethod):
        return getattr(obj, attr), "function", obj, defining      # bound: no cls
    if isinstance(static, staticmethod):
        return static.__func__, "function", obj, defining
    if callable(static):
        return static, "method", obj, defining                     # drop self
    return static, "value", obj, defining


def _norm_annotation(annotation) -> str | None:
    if annotation is inspect.Parameter.empty:
        return None
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    try:
        return ast.unparse(ast.parse(text, mode="eval"))
    except SyntaxError:
        return text


def _actual_params(obj, kind: str, owner) -> tuple[list, str | None]:
    signature = inspect.signature(obj)
    params = list(signature.parameters.values())
    if kind == "method":
        params = params[1:]
    params = [p for p in params if not (p.name.startswith("_")
                                        and p.default is not inspect.Parameter.empty)]
    returns = None if kind == "class" else _norm_annotation(signature.return_annotation)
    return params, returns


# -- what the page says -----------------------------------------------------------

_KINDS = {"posonlyargs": inspect.Parameter.POSITIONAL_ONLY,
          "args": inspect.Parameter.POSITIONAL_OR_KEYWORD,
          "kwonlyargs": inspect.Parameter.KEYWORD_ONLY}


def _documented_params(signature_text: str, line: int) -> tuple[list, str | None]:
    """[(name, kind, default_node | None, annotation | None)], return annotation."""
    try:
        tree = ast.parse(f"def _documented{signature_text}: pass")
    except SyntaxError as err:
        raise AssertionError(f"docs/api.md:{line}: signature {signature_text!r} is not "
                             f"valid Python ({err.msg})") from None
    fn = tree.body[0]
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = []
    for arg, default in zip(positional, defaults):
        kind = _KINDS["posonlyargs" if arg in a.posonlyargs else "args"]
        out.append((arg.arg, kind, default, arg.annotation))
    if a.vararg:
        out.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, None, a.vararg.annotation))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, inspect.Parameter.KEYWORD_ONLY, default, arg.annotation))
    if a.kwarg:
        out.append((a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, None, a.kwarg.annotation))
    out = [(n, k, d, None if ann is None else ast.unparse(ann)) for n, k, d, ann in out]
    return out, None if fn.returns is None else ast.unparse(fn.returns)


def _default_matches(node, actual, param_name: str, owner, namespace: dict) -> bool:
    if actual is dataclasses.MISSING or type(actual).__name__ == "_HAS_DEFAULT_FACTORY_CLASS":
        # a dataclass field(default_factory=...): document it as written
        is_field = isinstance(node, ast.Call) and ast.unparse(node.func) == "field" and \
            [k.arg for k in node.keywords] == ["default_factory"]
        fields = getattr(owner, "__dataclass_fields__", {})
        if not is_field or param_name not in fields:
            return False
        factory = eval(compile(ast.Expression(node.keywords[0].value), "<api.md>", "eval"),
                       namespace)
        code_factory = fields[param_name].default_factory
        # the same callable, or (a lambda in the code) one that makes the same kind of object
        return factory is code_factory or type(factory()) is type(code_factory())
    value = eval(compile(ast.Expression(node), "<api.md>", "eval"), namespace)
    if inspect.ismodule(actual) or callable(actual):
        return value is actual
    return type(value) is type(actual) and value == actual or \
        (isinstance(actual, float) and isinstance(value, float) and value == actual)


def check_entry(entry: Entry) -> list[str]:
    """Differences between an entry and the code (empty when they agree)."""
    where = f"docs/api.md:{entry.line}: {entry.qualname}"
    match = _NAME.match(entry.text)
    if match is None:
        return [f"docs/api.md:{entry.line}: {entry.text!r} is not an entry (Name, Name(...), "
                f"Name.attr(...) or NAME = value)"]
    rest = match.group(2)
    try:
        obj, kind, owner, namespace = _resolve(entry)
    except LookupError as err:
        return [f"{where}: documented but missing: {err}"]

    if not rest.strip():
        return []                                                     # existence only
    if rest.startswith(" = "):
        try:
            documented = ast.literal_eval(rest[3:])
        except (ValueError, SyntaxError):
            return [f"{where}: {rest[3:]!r} is not a literal"]
        return [] if documented == obj else [f"{where}: documented value {documented!r}, "
                                             f"code has {obj!r}"]
    if not rest.startswith("("):
        return [f"{where}: cannot read {rest!r}; write Name(params) or Name = value"]
    if kind in ("property", "value"):
        return [f"{where}: documented with a signature, but it is a {kind}"]

    documented, doc_returns = _documented_params(rest, entry.line)
    try:
        actual, returns = _actual_params(obj, kind, owner)
    except (TypeError, ValueError) as err:
        return [f"{where}: inspect.signature failed: {err}"]
    problems = []
    doc_names = [d[0] for d in documented]
    code_names = [p.name for p in actual]
    if doc_names != code_names:
        return [f"{where}: documented parameters {doc_names}, code has {code_names}"]
    for (name, doc_kind, default, annotation), param in zip(documented, actual):
        if doc_kind != param.kind:
            problems.append(f"{where}: parameter {name!r} is {doc_kind.description} in the "
                            f"docs, {param.kind.description} in the code")
        code_annotation = _norm_annotation(param.annotation)
        if annotation != code_annotation:
            problems.append(f"{where}: parameter {name!r} annotated {annotation!r} in the docs, "
                            f"{code_annotation!r} in the code")
        if (default is None) != (param.default is inspect.Parameter.empty):
            problems.append(f"{where}: parameter {name!r} default: docs "
                            f"{None if default is None else ast.unparse(default)!r}, code "
                            f"{param.default!r}")
        elif default is not None and not _default_matches(
                default, param.default, name, owner or obj, namespace):
            problems.append(f"{where}: parameter {name!r} default {ast.unparse(default)!r} in "
                            f"the docs, {param.default!r} in the code")
    if kind != "class" and doc_returns != returns:
        problems.append(f"{where}: returns {doc_returns!r} in the docs, {returns!r} in the code")
    if kind == "class" and doc_returns is not None:
        problems.append(f"{where}: a class entry has no return annotation")
    return problems


ENTRIES = parse_entries(API_MD.read_text(encoding="utf-8"))


def _param(entry: Entry):
    marks = ()
    if entry.qualname in KNOWN_DRIFT:
        marks = pytest.mark.xfail(strict=True, reason=KNOWN_DRIFT[entry.qualname])
    return pytest.param(entry, id=f"{entry.qualname}:{entry.line}", marks=marks)


def test_the_page_has_entries_in_every_section():
    modules = {e.module for e in ENTRIES}
    assert set(REQUIRED) <= modules, f"sections without entries: {set(REQUIRED) - modules}"
    assert len(ENTRIES) > 200


@pytest.mark.parametrize("entry", [_param(e) for e in ENTRIES])
def test_documented_name_matches_the_code(entry):
    problems = check_entry(entry)
    assert not problems, "\n".join(problems)


def test_required_names_are_documented():
    documented = {(e.module, _NAME.match(e.text).group(1)) for e in ENTRIES}
    missing = [f"{module}.{name}" for module, names in REQUIRED.items() for name in names
               if (module, name) not in documented]
    assert not missing, f"docs/api.md lacks entries for {missing}"


def test_each_entry_is_documented_once():
    seen: dict = {}
    for e in ENTRIES:
        key = (e.module, _NAME.match(e.text).group(1))
        assert key not in seen, f"{key} documented on lines {seen[key]} and {e.line}"
        seen[key] = e.line


# -- the checker itself catches drift ------------------------------------------------

@pytest.mark.parametrize("text,complaint", [
    ("AdamW(params, lr: float = 0.01, betas: tuple = (0.9, 0.999), eps: float = 1e-8, "
     "weight_decay: float = 0.01, ledger: MemoryLedger | None = None)", "default"),
    ("AdamW(params, lr: float = 0.001, betas: tuple = (0.9, 0.999), eps: float = 1e-8, "
     "weight_decay: float = 0.01)", "documented parameters"),
    ("AdamW(params, lr: int = 0.001, betas: tuple = (0.9, 0.999), eps: float = 1e-8, "
     "weight_decay: float = 0.01, ledger: MemoryLedger | None = None)", "annotated"),
    ("AdamW(params, *, lr: float = 0.001, betas: tuple = (0.9, 0.999), eps: float = 1e-8, "
     "weight_decay: float = 0.01, ledger: MemoryLedger | None = None)", "keyword-only"),
    ("clip_grad_norm(params, max_norm: float) -> int", "returns"),
    ("AdamW.step(grad_scale=1.0, skip=None) -> float", "returns"),
    ("AdamW.no_such_method()", "documented but missing"),
    ("NoSuchOptimizer(lr)", "documented but missing"),
    ("clip_coefficient = 3", "documented value"),
])
def test_checker_reports_drift(text, complaint):
    problems = check_entry(Entry("mpishard.optim", text, 1))
    assert any(complaint in p for p in problems), problems


def test_checker_accepts_a_correct_entry():
    text = ("AdamW(params, lr: float = 0.001, betas: tuple = (0.9, 0.999), eps: float = 1e-8, "
            "weight_decay: float = 0.01, ledger: MemoryLedger | None = None)")
    assert check_entry(Entry("mpishard.optim", text, 1)) == []
    entries = parse_entries("## `mpishard.data.corpus`\n\n### `VOCAB_SIZE = 256`\n\n```\n"
                            "- `ignored(x)`\n```\n- `BatchSampler.state_dict() -> dict`: x\n")
    assert [e.text for e in entries] == ["VOCAB_SIZE = 256", "BatchSampler.state_dict() -> dict"]
    assert all(check_entry(e) == [] for e in entries)
