"""The program dataclasses (``program.py``, ``plan.py``) <-> the schema's generated classes, by field name.

A dataclass field ``foo_bar`` is the field ``fooBar`` of the schema table of the same name
(``program.fbs``): the writer fills the table's object-API class (``TensorValueT().fooBar``), the reader
reads its accessor class (``TensorValue.FooBar()``, ``FooBarLength()``, ``FooBarAsNumpy()``). Each field's
schema type (a number type such as int32, a string, a table, a vector of them) is read off the generated
accessor; the dataclass's type hints give enums, nested dataclasses, and tuples or lists.

Conventions, not special cases: a field with a sibling ``fooBarExprs`` (``fooBarExpr``) holds sizes, ints
or ``symbolic.Expr`` s, stored as their bounds with the texts beside them ("" where concrete; the whole
sibling absent where all are); a number field whose object-API default is None stays absent for None.
The fields that do not map one to one are in ``_UNIONS`` (``Arg`` and ``HostArg``: one value, in the table
field its kind selects) and ``_SPECIAL`` (a dict, pairs, and the symbols that sizes are read against).

The writer checks every value against the schema's type and range and raises ``TypeError`` /
``ValueError`` naming the field. The reader trusts nothing (the generated code does not verify buffers):
it checks enum values and parses size expressions as integer arithmetic over the method's symbols, and it
bounds its work: each entry of a vector of tables or strings costs one unit of a budget of the buffer's
size, so neither a corrupt length nor tables shared many times over make it loop for long. It raises
:class:`ProgramError` without the file's name (the caller adds it); ``validate.py`` and
``consistency.py`` check the meaning of what it read.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import typing
from enum import IntEnum

from flatbuffers import number_types

from ..plan import Arg
from ..program import Method, Program
from ..errors import ProgramError
from ..symbolic import Expr, from_text
from .generated import program_generated as fb

_NOUNS = {"binaries": "kernel binary", "launches": "launch", "external_files": "external file", "plan": "launch plan"}
_STRS = ("STR", "DTYPE", "DEVICE", "MEMORY_FORMAT", "LAYOUT")
# dataclass -> {kind: (the table field that holds the value, the field of its expression text for a size)}
_UNIONS = {
    "Arg": {"TENSOR": ("ival",), "INT": ("ival", "iexpr"), "FLOAT": ("fval",), "BOOL": ("bval",), "STR": ("sval",)},
    "HostArg": {"NONE": (), "TENSOR": ("ival",), "INT": ("ival",), "FLOAT": ("fval",), "BOOL": ("bval",),
                **dict.fromkeys(_STRS, ("sval",)), "INT_LIST": ("ilist",), "FLOAT_LIST": ("flist",),
                "BOOL_LIST": ("blist",), "TENSOR_LIST": ("tlist",), "SYM_INT": ("ival", "sexpr"),
                "SYM_INT_LIST": ("ilist", "slistExprs")},
}


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One field of a schema table, as a dataclass field holds it."""

    attr: str  # the object-API attribute ("arenaOffset")
    vector: bool
    kind: str  # of the value or vector entries: "num", "str", "enum", "table"
    elem: object  # a flatbuffers number type (Int32Flags, ...), str, an IntEnum, or a dataclass (a table)
    container: type  # of a vector: list or tuple
    exprs: str | None  # sizes: the attribute of their expression texts
    # The generated accessors, unbound (``read(acc)`` is ``acc.ArenaOffset()``): the field, its length
    # and numpy view for a vector, its expression texts and their number for sizes.
    read: typing.Callable
    length: typing.Callable | None
    numpy: typing.Callable | None
    texts: typing.Callable | None
    n_texts: typing.Callable | None

    @functools.cached_property
    def plain(self) -> bool:
        """A number the reader takes as the accessor returns it (most fields)."""
        return self.kind == "num" and not self.vector and self.texts is None

    @functools.cached_property
    def members(self) -> dict:
        """Of an enum: value -> member (a dict lookup is faster than calling the enum)."""
        return {m.value: m for m in self.elem}

    def fits(self, value) -> bool:
        """Whether ``value`` is exactly what this slot holds, needing no check per entry: a str, or an int
        (a list or tuple of ints for a vector) in the slot's range."""
        if self.kind == "str" and not self.vector:
            return type(value) is str
        if self.kind != "num" or self.elem.py_type is not int:
            return False
        lo, hi = self.elem.min_val, self.elem.max_val
        if not self.vector:
            return type(value) is int and lo <= value <= hi
        return type(value) in (list, tuple) and all(type(v) is int and lo <= v <= hi for v in value)


def _upper(attr: str) -> str:
    return attr[0].upper() + attr[1:]


@functools.cache
def _slot(table: str, attr: str, hint, exprs: str | None = None) -> _Slot:
    """Field ``attr`` of schema table ``table``, held by a dataclass field of type ``hint`` (``exprs``: the
    field of its expression texts, where it does not follow the ``Exprs``/``Expr`` naming)."""
    names = getattr(getattr(fb, table), _upper(attr)).__code__.co_names  # what the generated accessor reads
    vector = "Vector" in names
    elem = typing.get_args(hint)[0] if vector and typing.get_args(hint) else hint  # list[X] -> X
    flags = [n for n in names if n.endswith("Flags") and n != "UOffsetTFlags"]
    if "String" in names:
        kind, elem = "str", str
    elif isinstance(elem, type) and issubclass(elem, IntEnum):
        kind = "enum"
    elif flags:
        kind, elem = "num", getattr(number_types, flags[0])
    else:
        kind = "table"  # elem: its dataclass
    if exprs is None:
        blank = getattr(fb, table + "T")()
        exprs = next((a for a in (attr + "Exprs", attr + "Expr") if hasattr(blank, a)), None)
    container = tuple if (typing.get_origin(hint) or hint) is tuple else list
    acc, get, texts = getattr(fb, table), _upper(attr), exprs and _upper(exprs)
    return _Slot(attr, vector, kind, elem, container, exprs, getattr(acc, get), getattr(acc, get + "Length", None),
                 getattr(acc, get + "AsNumpy", None), texts and getattr(acc, texts),
                 texts and getattr(acc, texts + "Length", None))


@functools.cache
def _fields(cls) -> tuple[tuple[str, _Slot | None], ...]:
    """(field name, its slot; None for a special one) of dataclass ``cls``; ``symbols`` first (sizes are
    read against them)."""
    hints = typing.get_type_hints(cls)
    names = sorted((f.name for f in dataclasses.fields(cls)), key=lambda n: n != "symbols")
    return tuple((n, None if (cls.__name__, n) in _SPECIAL else
                  _slot(cls.__name__, "".join(w.capitalize() if i else w for i, w in enumerate(n.split("_"))),
                        hints[n])) for n in names)


@functools.cache
def _union(cls) -> dict:
    """kind -> the slot of the value (None: no value) of union dataclass ``cls``."""
    fields = _UNIONS[cls.__name__]
    return {k: _slot(cls.__name__, fields[k.name][0], list, *fields[k.name][1:]) if fields[k.name] else None
            for k in typing.get_type_hints(cls)["kind"] if k.name in fields}


def _union_slot(cls, kind: int) -> _Slot | None:
    try:
        return _union(cls)[kind]
    except KeyError:  # a new kind member without an entry in _UNIONS
        raise RuntimeError(f"internal error: no encoding of {cls.__name__} kind {kind}") from None


def _at(where: str, name: str | None) -> str:
    return where if name is None else f"{where} {name}" if where else name


def _item(where: str, name: str, i, label: str = "") -> str:
    noun = _NOUNS.get(name) or name.removesuffix("s")
    return f"{where} {noun} {i}{label}" if where else f"{noun} {i}{label}"


def _valid(cls) -> str:
    return ", ".join(f"{m.value} ({m.name})" for m in cls)


# ----------------------------------------------------------------------------------------------
# dataclass -> object API


def to_object(obj, where: str = ""):
    """``obj``, a program dataclass, as its table's object-API instance (``Program`` -> ``ProgramT``)."""
    cls = type(obj)
    t = getattr(fb, cls.__name__ + "T")()
    for name, slot in _fields(cls):
        if slot is None:
            _SPECIAL[cls.__name__, name][1](t, obj, where)
        else:
            _put(t, slot, getattr(obj, name), where, name)
    return t


def _put(t, s: _Slot, value, where: str, name: str | None = None) -> None:
    """Sets slot ``s`` of ``t`` to ``value``: field ``name`` of the table at ``where`` (None: the value of
    the union at ``where``)."""
    if s.fits(value):  # (sizes: all concrete, no expression texts)
        setattr(t, s.attr, list(value) if s.vector else value)
        return
    at = _at(where, name)
    if s.exprs:
        pairs = [_size(v, f"{at}[{i}]") for i, v in enumerate(_list(value, at))] if s.vector else [_size(value, at)]
        texts = [text or "" for _, text in pairs]
        setattr(t, s.attr, [n for n, _ in pairs] if s.vector else pairs[0][0])
        setattr(t, s.exprs, (texts if s.vector else texts[0]) if any(texts) else None)
    elif not s.vector:
        if not (value is None and s.kind == "num" and getattr(t, s.attr) is None):
            setattr(t, s.attr, _pack(s, value, at))
    elif s.kind == "table":
        setattr(t, s.attr, [_pack(s, v, _item(where, name, i, _label(v))) for i, v in enumerate(_list(value, at))])
    else:
        setattr(t, s.attr, [_pack(s, v, f"{at}[{i}]") for i, v in enumerate(_list(value, at))])


def _pack(s: _Slot, value, where: str):
    """``value`` as the object API holds an entry of slot ``s``, after checking its type and range."""
    elem = s.elem
    if s.kind == "table":
        if not isinstance(value, elem):
            raise TypeError(f"{where}: expected {elem.__name__}, got {type(value).__name__} {value!r}")
        return to_object(value, where)
    if s.kind == "enum":
        try:
            return int(elem(value))
        except ValueError:
            raise ValueError(f"{where}: {value!r} is not a {elem.__name__}; valid: {_valid(elem)}") from None
    return _scalar(elem, value, where)


def _scalar(elem, value, where: str):
    if elem is str:
        if not isinstance(value, str):
            raise TypeError(f"{where}: expected a str, got {type(value).__name__} {value!r}")
        return value
    if elem is number_types.BoolFlags:
        if isinstance(value, bool) or (hasattr(value, "__index__") and operator.index(value) in (0, 1)):
            return bool(value)
        raise TypeError(f"{where}: expected a bool, got {type(value).__name__} {value!r}")
    if elem is number_types.Float64Flags:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
            raise TypeError(f"{where}: expected a float, got {type(value).__name__} {value!r}")
        return float(value)
    if isinstance(value, bool) or not hasattr(value, "__index__"):  # numpy/torch ints are fine
        raise TypeError(f"{where}: expected an int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if not elem.min_val <= value <= elem.max_val:
        raise ValueError(f"{where}: {value} is outside [{elem.min_val}, {elem.max_val}]")
    return value


def _size(value, where: str) -> tuple[int, str | None]:
    """An int or :class:`Expr` as the format stores it: its bound, and its text (None when concrete)."""
    if isinstance(value, Expr):
        if not isinstance(value.text, str) or not value.text.strip():
            raise ValueError(f"{where}: a size expression without text: {value!r}")
        return _scalar(number_types.Int64Flags, value.bound, f"{where} (bound of {value.text!r})"), value.text
    return _scalar(number_types.Int64Flags, value, where), None


def _list(value, where: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
    return value


def _label(obj) -> str:
    name = getattr(obj, "kernel", None) or getattr(obj, "name", None)
    return f" ({name!r})" if isinstance(name, str) and name else ""


# ----------------------------------------------------------------------------------------------
# flatbuffer -> dataclass


def from_buffer(buf: bytes) -> Program:
    """The program in flatbuffer ``buf`` (its identifier checked by the caller)."""
    return _Reader(len(buf)).table(fb.Program.GetRootAs(buf, 0), Program, "")


class _Reader:
    def __init__(self, budget: int):
        self.budget = budget
        self.names: frozenset[str] = frozenset()  # the symbols of the method being read

    def entries(self, n: int, where: str, name: str | None = None) -> range:
        self.budget -= n
        if self.budget < 0:
            raise ProgramError(f"the flatbuffer is corrupt: {_at(where, name)} claims {n} entries, more than it "
                               "can hold")
        return range(n)

    def table(self, acc, cls, where: str):
        values = {}
        for name, slot in _fields(cls):
            if slot is None:
                values[name] = _SPECIAL[cls.__name__, name][0](self, cls, acc, where, values)
            else:
                values[name] = slot.read(acc) if slot.plain else self.get(acc, slot, where, name)
        return cls(**values)

    def get(self, acc, s: _Slot, where: str, name: str | None = None):
        """The value of slot ``s`` in accessor ``acc`` (``where``, ``name``: as in ``_put``)."""
        if not s.vector:
            value = s.read(acc)
            if s.kind == "num":
                return value if s.texts is None else self.size(value, s.texts(acc), _at(where, name))
            if s.kind == "str":
                return value.decode() if value else ""
            if s.kind == "enum":
                if value not in s.members:
                    raise ProgramError(f"{where} has {s.elem.__name__} value {value}; valid: {_valid(s.elem)}")
                return s.members[value]
            if value is None:
                raise ProgramError(f"{where} has no {_NOUNS.get(name, name)}")
            return self.table(value, s.elem, _at(where, name))
        if s.kind == "num":
            array = s.numpy(acc)
            values = [] if isinstance(array, int) else array.tolist()  # the accessor returns 0 when absent
            if s.texts:
                values = self.sizes(values, acc, s, _at(where, name))
            return values if s.container is list else s.container(values)
        read, items = s.read, self.entries(s.length(acc), where, name)
        if s.kind == "str":
            values = [_text(read(acc, i)) for i in items]
        else:
            prefix = _item(where, name, "")  # "method 0 value " (one f-string per entry, not a call)
            values = [self.table(read(acc, i), s.elem, f"{prefix}{i}") for i in items]
        return values if s.container is list else s.container(values)

    def size(self, bound: int, text, where: str):
        """A size that may be symbolic: ``bound`` when ``text`` is empty, else its checked ``Expr``."""
        text = _text(text)
        if not text:
            return bound
        try:
            value = from_text(text, bound, self.names)
        except ProgramError as e:
            raise ProgramError(f"{where}: {e}") from None
        if isinstance(value, int) and value != bound:
            raise ProgramError(f"{where}: the literal size {text!r} differs from its bound {bound}")
        return value

    def sizes(self, bounds: list, acc, s: _Slot, where: str) -> list:
        """Sizes that may be symbolic: ``bounds``, with the texts of slot ``s`` (none: all concrete)."""
        n = s.n_texts(acc)
        if n == 0:
            return bounds
        if n != len(bounds):
            raise ProgramError(f"{where} has {n} size expressions for {len(bounds)} sizes")
        return [self.size(b, s.texts(acc, i), f"{where}[{i}]") for i, b in zip(self.entries(n, where), bounds)]


def _text(b) -> str:
    return b.decode() if b else ""


# ----------------------------------------------------------------------------------------------
# The fields that do not map one to one: (read(reader, dataclass, accessor, where, the fields read so
# far), write(object-API instance, dataclass instance, where)).


def _read_union(r: _Reader, cls, acc, where: str, values: dict):
    slot = _union_slot(cls, values["kind"])
    return None if slot is None else r.get(acc, slot, where)


def _write_union(t, obj, where: str) -> None:
    slot = _union_slot(type(obj), t.kind)  # the kind, checked
    if slot is not None:
        _put(t, slot, obj.value, where)
    elif obj.value is not None:
        raise ValueError(f"{where}: a NONE argument holds {obj.value!r}")


def _read_constexprs(r: _Reader, cls, acc, where: str, values: dict) -> dict:
    out = {}
    for k in r.entries(acc.ConstexprsLength(), where, "constexprs"):
        entry = acc.Constexprs(k)
        arg = entry.Arg()
        if arg is None:
            raise ProgramError(f"{where} constexpr {k} has no value")
        out[_text(entry.Name())] = r.table(arg, Arg, f"{where} constexpr {k}")
    return out


def _write_constexprs(t, obj, where: str) -> None:
    if not isinstance(obj.constexprs, dict):
        raise TypeError(f"{where} constexprs: expected a dict, got {type(obj.constexprs).__name__}")
    t.constexprs = [fb.NamedArgT(_scalar(str, name, f"{where} constexpr name"), to_object(a, f"{where} constexpr {name!r}"))
                    for name, a in obj.constexprs.items()]


def _read_mutated(r: _Reader, cls, acc, where: str, values: dict) -> list:
    entries = (acc.MutatedBuffers(i) for i in r.entries(acc.MutatedBuffersLength(), where, "mutated_buffers"))
    return [(b.Buffer(), b.Value()) for b in entries]


def _write_mutated(t, obj, where: str) -> None:
    at = f"{where} mutated_buffers"
    t.mutatedBuffers = [fb.MutatedBufferT(*(_scalar(number_types.Int32Flags, x, f"{at}[{i}]")
                                            for x in _list(pair, f"{at}[{i}]")))
                        for i, pair in enumerate(_list(obj.mutated_buffers, at))]


def _symbols() -> _Slot:
    return _slot("Method", "symbols", typing.get_type_hints(Method)["symbols"])


def _read_symbols(r: _Reader, cls, acc, where: str, values: dict) -> list:
    symbols = r.get(acc, _symbols(), where, "symbols")
    r.names = frozenset(s.name for s in symbols)
    return symbols


def _write_symbols(t, obj, where: str) -> None:
    _put(t, _symbols(), obj.symbols, where, "symbols")
    t.symbols = t.symbols or None  # absent, not empty, without symbols (as in files from before them)


_SPECIAL = {
    ("Arg", "value"): (_read_union, _write_union),
    ("HostArg", "value"): (_read_union, _write_union),
    ("Launch", "constexprs"): (_read_constexprs, _write_constexprs),
    ("Method", "mutated_buffers"): (_read_mutated, _write_mutated),
    ("Method", "symbols"): (_read_symbols, _write_symbols),
}
