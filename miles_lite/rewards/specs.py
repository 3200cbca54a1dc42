"""`rewards.custom` entries: which plug-in, called with which arguments, under which name and maximum.

`rewards.custom` holds one entry or a list of them (TRL's `reward_funcs=[...]`; weights by name in
`rewards.weights`, as TRL's `reward_weights`). An entry is

- an import path `package.module:fn` (a reward function, or a `RewardSet` that replaces `rewards.set`);
- a factory call `package.module:factory(arg=value, ...)` (literal arguments, as Python writes them), whose
  return value is the reward function, e.g. `trl.rewards:get_soft_overlong_punishment(max_completion_len=64,
  soft_punish_cache=16)`;
- a block `{fn: package.module:factory, kwargs: {...}, name: ..., max_value: ...}`: the factory called with
  `kwargs` (omit it for a plain function), and optionally the name the reward is scored and weighted under
  and its best raw value (for evaluation and presampling: `rewards.success`).
"""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from miles_lite.plugins import PluginError

BLOCK_KEYS = ("fn", "kwargs", "name", "max_value")


@dataclass(frozen=True)
class PluginSpec:
    """One `rewards.custom` entry, parsed. `call`: the factory is called (with `args` and `kwargs`)."""

    path: str
    field: str
    call: bool = False
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    name: str | None = None
    max_value: float | None = None

    @property
    def shown(self) -> str:
        """The entry as the user wrote it, for messages."""
        if not self.call:
            return self.path
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.path}({', '.join(parts)})"


def _literal(node: ast.expr, field_name: str, text: str) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise PluginError(f"{field_name}={text!r}: the factory's arguments must be literals (numbers, strings, "
                          f"lists, dicts, True/False/None), got {ast.unparse(node)!r}") from None


def parse_call(text: str, field_name: str) -> PluginSpec:
    """`package.module:fn` or `package.module:factory(literal arguments)`."""
    text = text.strip()
    head, paren, rest = text.partition("(")
    if not paren:
        return PluginSpec(head, field_name)
    module, sep, attr = head.partition(":")
    if not sep or not module or not attr.strip():
        raise PluginError(f"{field_name}={text!r} is not an import path; write it as 'package.module:factory(...)'")
    try:
        tree = ast.parse(f"f({rest}", mode="eval")
    except SyntaxError:
        raise PluginError(f"{field_name}={text!r}: cannot read the factory's arguments; write them as Python "
                          "does, e.g. 'package.module:factory(max_len=64, scale=0.5)'") from None
    call = tree.body
    assert isinstance(call, ast.Call)
    if any(k.arg is None for k in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args):
        raise PluginError(f"{field_name}={text!r}: name each argument (no *args or **kwargs)")
    args = tuple(_literal(a, field_name, text) for a in call.args)
    kwargs = {k.arg: _literal(k.value, field_name, text) for k in call.keywords if k.arg is not None}
    return PluginSpec(f"{module}:{attr.strip()}", field_name, True, args, kwargs)


def _block(entry: Mapping[str, Any], field_name: str) -> PluginSpec:
    unknown = sorted(set(entry) - set(BLOCK_KEYS))
    if unknown:
        raise PluginError(f"{field_name}: unknown key(s) {unknown}; an entry's keys are {', '.join(BLOCK_KEYS)}")
    path = entry.get("fn")
    if not isinstance(path, str) or not path:
        raise PluginError(f"{field_name}: 'fn' must name the function or factory as 'package.module:name'")
    spec = parse_call(path, f"{field_name}.fn")
    kwargs = entry.get("kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise PluginError(f"{field_name}.kwargs must be a mapping of argument names to values")
        if spec.call:
            raise PluginError(f"{field_name}: give the factory's arguments once, in 'fn' or in 'kwargs'")
        spec = PluginSpec(spec.path, field_name, True, (), dict(kwargs))
    name = entry.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise PluginError(f"{field_name}.name must be a non-empty string")
    max_value = entry.get("max_value")
    if max_value is not None:
        if isinstance(max_value, bool) or not isinstance(max_value, int | float) or not math.isfinite(max_value):
            raise PluginError(f"{field_name}.max_value must be a finite number, got {max_value!r}")
        max_value = float(max_value)
    return PluginSpec(spec.path, field_name, spec.call, spec.args, spec.kwargs, name, max_value)


def custom_specs(custom: Any, field_name: str = "rewards.custom") -> list[PluginSpec]:
    """The entries of `rewards.custom` (None: none)."""
    if custom is None or custom == "":
        return []
    entries = list(custom) if isinstance(custom, list | tuple) else [custom]
    specs = []
    for i, entry in enumerate(entries):
        where = f"{field_name}[{i}]" if isinstance(custom, list | tuple) else field_name
        if isinstance(entry, str):
            specs.append(parse_call(entry, where))
        elif isinstance(entry, Mapping):
            specs.append(_block(entry, where))
        else:
            raise PluginError(f"{where}: expected 'package.module:fn', 'package.module:factory(...)' or a block "
                              f"{{fn: ..., kwargs: {{...}}}}, got {type(entry).__name__}")
    return specs
