"""Constant methods: named values stored with a program, for a runner that needs facts about the model
without running it (the name is ExecuTorch's, as are the names a generation runner reads):

    td.lower(programs, partitioner, constant_methods={"get_max_seq_len": 128, "get_eos_ids": [2]})
    td.load(path).constant_methods["get_max_seq_len"]          # 128

A value is an int, a float, a bool, a string, or a list of them (stored as JSON text). :func:`encode`
checks what ``lower()`` is given; :func:`decode` checks what a file holds (it is untrusted).

Names :class:`~tritondelegate.generate.Generator` reads: ``get_max_seq_len`` (the KV cache's positions:
a prompt and the tokens generated after it must fit), ``get_eos_ids`` (the tokens generation stops at
when no ``stop_tokens`` are given). ``models.llm_constant_methods`` fills these and
``get_max_batch_size``, ``get_vocab_size``, ``get_bos_id``, ``use_kv_cache`` for the project's decoder and
for transformers' static-cache export recipe.
"""

from __future__ import annotations

import json
import math
import re

from .program import ConstantMethod

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SCALARS = (bool, int, float, str)


def _problem(value) -> str | None:
    """Why ``value`` cannot be a constant method's value; None when it can."""
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not isinstance(item, SCALARS):
            return f"holds a {type(item).__name__}; a value is an int, float, bool, str or a list of them"
        if isinstance(item, float) and not math.isfinite(item):
            return f"holds {item}, which JSON cannot store"
    return None


def encode(methods: dict | None, method_names=()) -> list[ConstantMethod]:
    """``lower()``'s ``constant_methods`` as the program stores them; raises ``TypeError`` or
    ``ValueError`` naming the entry that is not a valid name and value, or that names a method."""
    if methods is None:
        return []
    if not isinstance(methods, dict):
        raise TypeError(f"constant_methods must be a dict of name -> value, got {type(methods).__name__}")
    entries = []
    for name, value in methods.items():
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"constant method name {name!r} is not an identifier")
        if name in method_names:
            raise ValueError(f"constant method {name!r} has the name of one of the program's methods")
        problem = _problem(value)
        if problem:
            raise TypeError(f"constant method {name!r} {problem}")
        entries.append(ConstantMethod(name, json.dumps(list(value) if isinstance(value, tuple) else value)))
    return entries


def decode(entries: list[ConstantMethod]) -> dict:
    """The values of a program's constant methods by name; raises ``ValueError`` naming an entry whose
    text is not JSON of a valid value, or a name given twice."""
    values = {}
    for i, entry in enumerate(entries):
        what = f"constant method {i} ({entry.name!r})"
        if not NAME.fullmatch(entry.name) or entry.name in values:
            raise ValueError(f"{what}: not an identifier, or a name given twice")
        try:
            value = json.loads(entry.value)
        except ValueError:
            raise ValueError(f"{what}: its value is not JSON") from None
        problem = _problem(value)
        if problem:
            raise ValueError(f"{what} {problem}")
        values[entry.name] = value
    return values
