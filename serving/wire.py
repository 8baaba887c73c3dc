"""Engine step inputs as int32 words: how a multi-process group's process 0 sends each step to the
others.

Each step input type lists its fields' forms once, in a class attribute `WIRE`; `encode` and
`decode` walk those tables, so adding a field is one table entry. Arrays carry their shape; floats
and seeds travel bit for bit. No jax import: a group's processes read it before jax starts."""
from __future__ import annotations

import dataclasses
import typing
import math
from typing import Callable

import numpy as np


class Reader:
    """Words being decoded, read front to back."""

    def __init__(self, words: np.ndarray):
        self.words = words
        self.pos = 0

    def take(self, n: int) -> np.ndarray:
        if self.pos + n > len(self.words):
            raise ValueError(f"malformed step: {len(self.words)} payload words, more needed")
        out = self.words[self.pos:self.pos + n]
        self.pos += n
        return out

    def one(self) -> int:
        return int(self.take(1)[0])


class Array:
    """A numpy array of a 4-byte dtype, any shape: its rank, its dims, then its elements' bits."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        if self.dtype.itemsize != 4:
            raise ValueError(f"only 4-byte dtypes travel as int32 words, not {self.dtype}")

    def put(self, value, out: list) -> None:
        a = np.ascontiguousarray(np.asarray(value, self.dtype))
        out.append(np.array([a.ndim, *a.shape], np.int32))
        out.append(a.reshape(-1).view(np.int32))

    def take(self, r: Reader):
        shape = tuple(int(d) for d in r.take(r.one()))
        return r.take(math.prod(shape)).view(self.dtype).reshape(shape).copy()


class Int:
    def put(self, value, out: list) -> None:
        out.append(np.array([int(value)], np.int32))

    def take(self, r: Reader):
        return r.one()


class Bool(Int):
    def take(self, r: Reader):
        return bool(r.one())


class Ints:
    """A tuple of ints: its length, then the ints."""

    def put(self, value, out: list) -> None:
        out.append(np.array([len(value), *value], np.int32))

    def take(self, r: Reader):
        return tuple(int(v) for v in r.take(r.one()))


class Text:
    """A str: its UTF-8 length in bytes, then the bytes, zero-padded to whole words."""

    def put(self, value: str, out: list) -> None:
        data = value.encode()
        out.append(np.array([len(data)], np.int32))
        out.append(np.frombuffer(data + bytes(-len(data) % 4), np.int32))

    def take(self, r: Reader):
        n = r.one()
        if n < 0:
            raise ValueError(f"malformed step: a text of {n} bytes")
        return r.take(-(-n // 4)).tobytes()[:n].decode()


class Optional:
    """None, or a value of `form`: a flag word first."""

    def __init__(self, form):
        self.form = form

    def put(self, value, out: list) -> None:
        out.append(np.array([value is not None], np.int32))
        if value is not None:
            self.form.put(value, out)

    def take(self, r: Reader):
        return self.form.take(r) if r.one() else None


class Tuple:
    """A tuple of values of one `form`: its length, then each value."""

    def __init__(self, form):
        self.form = form

    def put(self, value, out: list) -> None:
        out.append(np.array([len(value)], np.int32))
        for v in value:
            self.form.put(v, out)

    def take(self, r: Reader):
        return tuple(self.form.take(r) for _ in range(r.one()))


class Record:
    """A NamedTuple or dataclass whose own `WIRE` table says how each of its fields travels."""

    def __init__(self, cls):
        self.cls = cls

    def put(self, value, out: list) -> None:
        for name, form in table(self.cls).items():
            form.put(getattr(value, name), out)

    def take(self, r: Reader):
        return self.cls(**{name: form.take(r) for name, form in table(self.cls).items()})


class ArrayDict:
    """A dict of arrays of one dtype under the names `keys()` gives, in that order (e.g. a
    dataclass's fields, so that the names stay defined once)."""

    def __init__(self, dtype, keys: Callable[[], tuple[str, ...]]):
        self.array, self.keys = Array(dtype), keys

    def put(self, value: dict, out: list) -> None:
        keys = self.keys()
        if set(value) != set(keys):
            raise ValueError(f"expected the arrays {sorted(keys)}, got {sorted(value)}")
        for k in keys:
            self.array.put(value[k], out)

    def take(self, r: Reader):
        return {k: self.array.take(r) for k in self.keys()}


class Stays:
    """A field that does not travel: the other processes get `default`. `refuse(value)` returns
    why a value cannot be left behind (the step must then not be sent), or None."""

    def __init__(self, default=None, refuse: Callable[[object], str | None] = lambda v: None):
        self.default, self.refuse = default, refuse

    def put(self, value, out: list) -> None:
        why = self.refuse(value)
        if why:
            raise ValueError(why)

    def take(self, r: Reader):
        return self.default


def table(cls) -> dict:
    """cls.WIRE, checked against cls's fields (a missing or extra entry is a bug); a dataclass
    of plain ints and bools without one (`models.shapes.StepShape`) travels field by
    field."""
    wire = getattr(cls, "WIRE", None)
    if wire is None and dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        kinds = {f.name: hints.get(f.name) for f in dataclasses.fields(cls)}
        if all(k in (int, bool) for k in kinds.values()):
            wire = {name: Bool() if k is bool else Int() for name, k in kinds.items()}
    if wire is None:
        raise TypeError(f"{cls.__name__} has no WIRE table: it cannot travel to other processes")
    fields = (cls._fields if hasattr(cls, "_fields")
              else tuple(f.name for f in dataclasses.fields(cls)))
    if tuple(wire) != tuple(fields):
        raise TypeError(f"{cls.__name__}.WIRE must list its fields {fields} in order, "
                        f"got {tuple(wire)}")
    return wire


def encode(value) -> np.ndarray:
    """`value` (an instance of a type with a WIRE table) as int32 words."""
    out: list[np.ndarray] = []
    Record(type(value)).put(value, out)
    return np.concatenate(out) if out else np.zeros(0, np.int32)


def decode(cls, words: np.ndarray):
    """The `cls` instance `encode` wrote as `words` (all of them)."""
    r = Reader(np.asarray(words, np.int32))
    value = Record(cls).take(r)
    if r.pos != len(r.words):
        raise ValueError(f"malformed step: {len(r.words)} payload words, {r.pos} used")
    return value
