"""The config's field machinery, for any tree of dataclasses: `ConfigError`, config keys with
their documentation (`key`, `checked`: the text beside each field, `field_doc`), field rules
(`checked` + `check_fields`), type checks against the annotations, dotted overrides
(`parse_override`), merging a nested dict into the dataclasses with did-you-mean errors
(`apply_dict`), keys declared elsewhere (`flat_settings`) and the tree as a dict (`as_dict`).
fastpo.config builds the training configuration with them."""
from __future__ import annotations

import copy
import dataclasses
import types
import typing
from dataclasses import field
from typing import Any, Callable, Literal, Mapping, Union

import yaml


class ConfigError(ValueError):
    """A configuration key is unknown, has the wrong type or an impossible value."""


#: The largest finite float32: rewards, losses and the settings that enter them are float32
#: tensors on every device, so a larger (still finite) Python float would be inf there.
FLOAT32_MAX = 3.4028234663852886e38


@dataclasses.dataclass(frozen=True)
class Rule:
    """A constraint on one config field: `ok(value)` must hold for a value of the field's
    annotated type; `why` says the rule in the error ("must be > 0")."""

    ok: Callable[[Any], bool]
    why: str


def at_least(n: int) -> Callable[[Any], bool]:
    """The rule `value >= n`, for `checked`."""
    return lambda v: v >= n


def key(default: Any = dataclasses.MISSING, *, doc: str, factory: Callable[[], Any] | None = None,
        choices: Callable[[], tuple] | None = None) -> Any:
    """A config key: a dataclass field with `default` (or, for a mutable value or a section,
    `factory()`) and `doc`, what the key means (one paragraph, held in the field's metadata:
    `field_doc`; docs/configuration.md's key table shows it). `choices()` gives the allowed
    values where they are known only at run time (the registered policy losses)."""
    metadata: dict[str, Any] = {"doc": doc}
    if choices is not None:
        metadata["choices"] = choices
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def checked(default: Any, ok: Callable[[Any], bool] = lambda v: True, why: str = "", *, doc: str = "") -> Any:
    """A dataclass field with `default` whose values must have the annotated type and satisfy
    `ok` (see `check_fields`); `doc` as for `key` (every config key has one; a field of
    another dataclass checked this way, e.g. SamplingParams', may go without)."""
    return field(default=default, metadata={"rule": Rule(ok, why), "doc": doc})


def field_doc(f: dataclasses.Field) -> str:
    """What config key `f` means, the `doc` given beside it (`key`, `checked`, `flat_settings`);
    "" when it has none."""
    return f.metadata.get("doc", "")


def flat_settings(declared: Callable[[], Mapping[str, Any]], *, doc: str) -> Any:
    """A dict field whose entries are keys of its section itself, declared elsewhere:
    `declared()` gives {name: declaration}, each with `default`, `kind` (its type), `problem(value)`
    (None, or what is wrong) and `doc` (fastpo.kernels.LossSetting). YAML files, dotted overrides
    (`algorithm.sapo_tau_pos=2`: `apply_dict`) and `as_dict` see the entries as the section's
    keys, in the field's place; the field starts with every declared default. `doc`: what the
    field holds, as for `key` (each entry's own row comes from its declaration)."""
    return field(default_factory=lambda: {n: d.default for n, d in declared().items()},
                 metadata={"flat_keys": declared, "doc": doc})


def flat_keys(obj: Any) -> dict[str, tuple[str, Any]]:
    """{key: (the flat_settings field holding it, its declaration)} of dataclass `obj`."""
    out = {}
    for f in dataclasses.fields(obj):
        declared = f.metadata.get("flat_keys")
        for name, d in (declared() if declared is not None else {}).items():
            out[name] = (f.name, d)
    return out


def section_keys(obj: Any) -> list[str]:
    """The keys of dataclass `obj` as a config file writes them: its fields, a `flat_settings`
    field's entries in that field's place."""
    keys = []
    for f in dataclasses.fields(obj):
        declared = f.metadata.get("flat_keys")
        keys += list(declared()) if declared is not None else [f.name]
    return keys


def section_items(obj: Any) -> list[tuple[str, Any]]:
    """(key, value) of every key of dataclass `obj` (`section_keys`; a flat entry missing from
    its field: its declared default)."""
    out = []
    for f in dataclasses.fields(obj):
        declared = f.metadata.get("flat_keys")
        if declared is None:
            out.append((f.name, getattr(obj, f.name)))
        else:
            held = getattr(obj, f.name)
            out += [(n, held.get(n, d.default)) for n, d in declared().items()]
    return out


def as_dict(obj: Any) -> dict:
    """The dataclass tree `obj` as nested dicts (`dataclasses.asdict`), with `flat_settings`
    entries as keys of their section, in their field's place."""
    return {k: as_dict(v) if dataclasses.is_dataclass(v) else copy.deepcopy(v) for k, v in section_items(obj)}


def check_fields(obj: Any, prefix: str = "", what: str = "config key") -> None:
    """Check every field of dataclass `obj` that carries a `Rule` (made with `checked`): its
    type (the annotation, as `apply_dict` reads it), then the rule. The one validator of
    field constraints, for `validate` and for the dataclasses' own `__post_init__`.

    Raises ConfigError (a ValueError) "config key 'rollout.top_p' = 2: must be in (0, 1]",
    naming `prefix` + the field and the value.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        rule = f.metadata.get("rule")
        if rule is None:
            continue
        value, key = getattr(obj, f.name), repr(f"{prefix}{f.name}")
        key = f"{what} {key}" if what else key
        ok, _ = type_ok(value, hints[f.name])
        if not ok:
            raise ConfigError(f"{key}: expected {describe_type(hints[f.name])}, got {value!r} ({type(value).__name__})")
        if not rule.ok(value):
            raise ConfigError(f"{key} = {value!r}: {rule.why}")


def type_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check (and lightly coerce: int -> float) `value` against annotation `tp`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True, value
    if origin is Literal:
        return (value in typing.get_args(tp)), value
    if origin is Union or (hasattr(types, "UnionType") and isinstance(tp, types.UnionType)):
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return True, None
                continue
            ok, v = type_ok(value, arg)
            if ok:
                return True, v
        return False, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return (isinstance(value, int) and not isinstance(value, bool)), value
    if tp is float:
        if isinstance(value, bool):
            return False, value
        if isinstance(value, (int, float)):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if tp is list or origin is list:
        return isinstance(value, (list, tuple)), list(value) if isinstance(value, (list, tuple)) else value
    if tp is dict or origin is dict:
        return isinstance(value, dict), value
    return isinstance(value, tp), value


def describe_type(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is Union:
        return " or ".join(describe_type(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def did_you_mean(obj: Any, key: str, prefix: str) -> str:
    """' (did you mean ...?)' for a key that exists one level down (a bare `group_size`) or is
    a near miss of a key here (`grup_size`); '' otherwise."""
    import difflib

    if not isinstance(key, str):  # e.g. a YAML key `1:` or `yes:`
        return ""
    here = section_keys(obj)
    below = [f"{f.name}.{key}" for f in dataclasses.fields(obj) if dataclasses.is_dataclass(getattr(obj, f.name))
             and key in section_keys(getattr(obj, f.name))]
    guesses = below or difflib.get_close_matches(key, here, n=1)
    return f" (did you mean {' or '.join(prefix + g for g in guesses)}?)" if guesses else ""


def apply_dict(obj: Any, updates: dict, prefix: str = "") -> None:
    """Merge a nested dict into the dataclass tree `obj` in place.

    Raises ConfigError naming the dotted key for an unknown key or a wrong type.
    """
    if not isinstance(updates, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(updates).__name__}")
    hints = typing.get_type_hints(type(obj))
    names, flat = set(section_keys(obj)), flat_keys(obj)
    for key, value in updates.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key {dotted!r}{did_you_mean(obj, key, prefix)}; "
                              f"valid keys here: {', '.join(sorted(names))}")
        if key in flat:  # an entry of a flat_settings field
            holder, declared = flat[key]
            ok, coerced = type_ok(value, declared.kind)
            if not ok:
                raise ConfigError(f"config key {dotted!r}: expected {describe_type(declared.kind)}, got {value!r} "
                                  f"({type(value).__name__})")
            getattr(obj, holder)[key] = coerced
            continue
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            apply_dict(current, value, dotted + ".")
            continue
        ok, coerced = type_ok(value, hints[key])
        if not ok:
            raise ConfigError(f"config key {dotted!r}: expected {describe_type(hints[key])}, got {value!r} "
                              f"({type(value).__name__})")
        if isinstance(current, dict) and isinstance(coerced, dict):
            coerced = {**current, **coerced}
        setattr(obj, key, coerced)


def parse_override(text: str) -> dict:
    """Turn ``"algorithm.clip_high=0.3"`` into ``{"algorithm": {"clip_high": 0.3}}``.

    The value is read as YAML (numbers, true/false, null, [lists] work). Raises ConfigError
    when there is no ``=`` or the key is empty.
    """
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({str(e).splitlines()[0]}; quote the "
                          "whole override for the shell if it holds spaces)") from None
    if isinstance(value, str):
        # YAML 1.1 reads "1e-5" (no dot) as a string; a number is what anyone means
        try:
            value = float(value) if not value.strip().lower() in ("nan", "inf", "-inf", ".inf") else value
        except ValueError:
            pass
    return nested_dict(key, value)


def nested_dict(key: str, value: Any) -> dict:
    """``("a.b.c", v)`` -> ``{"a": {"b": {"c": v}}}``."""
    out: dict = {}
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out
