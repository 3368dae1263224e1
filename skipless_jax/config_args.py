"""Config arguments: `configs/x.py:skip_sab=False,depth=8` -> typed values with defaults.

The same argument names are used by every config that has them: skip_sab, skip_ffn, depth,
seed, init, opt, tg, eps, variant.
"""

from __future__ import annotations

from typing import Any

# Values an argument may take in every config that has it: the configs document these, with
# their own settings (config_blocks.optimizer gives SOAP's and AdamW's b1/b2; others would run
# with AdamW's learning rate and settings that do not apply).
# `init`: models/init.py's INIT_METHODS (this module imports no model code; tests/test_first_use.py
# checks that the two agree).
CHOICES = {"opt": ("adamw", "soap", "muon", "shampoo_ec"),
           "init": ("default", "skipless", "mimetic", "timm", "mae", "orthogonal")}


def _convert(key: str, text: str, default: Any) -> Any:
    if isinstance(default, bool):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"config arg {key}={text!r} must be True or False")
    if default is None:
        return None if text.lower() in ("none", "") else text
    try:
        return type(default)(text)
    except ValueError:
        raise ValueError(f"config arg {key}={text!r} must be of type {type(default).__name__}") from None


def parse(arg: str | None, **defaults: Any) -> dict[str, Any]:
    """'a=1,b=x' -> {'a': 1, 'b': 'x'} over `defaults`; unknown names are one-line errors."""
    values = dict(defaults)
    for item in filter(None, (arg or "").split(",")):
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or key not in defaults:
            raise ValueError(f"config arg {item!r} is unknown; allowed: {', '.join(f'{k}=' for k in defaults)}")
        values[key] = _convert(key, text.strip(), defaults[key])
        if key in CHOICES and values[key] not in CHOICES[key]:
            raise ValueError(f"config arg {key}={text.strip()!r} is not allowed; allowed: {' | '.join(CHOICES[key])}")
    return values


def optional_number(values: dict[str, Any], key: str) -> float | None:
    """`parse`'s value of an arg whose default is None (unset) as a float, or None; one-line error."""
    text = values[key]
    if text is None or isinstance(text, float):
        return text
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"config arg {key}={text!r} must be a number (or None: unset)") from None


def to_arg(values: dict[str, Any]) -> str:
    """The inverse of `parse`: {'a': 1, 'b': 'x'} -> 'a=1,b=x' (to hand args to another config)."""
    return ",".join(f"{k}={v}" for k, v in values.items())
