"""Command-line argument types and config-file reading shared by every process's parser.

Imported whenever the `kvmesh` parser is built: nothing heavy at module level.
"""

from __future__ import annotations

import argparse
import math
import re
from fractions import Fraction


class ArgsError(ValueError):
    """A command line or config file asks for something the process cannot do; the message says what."""


# A number, an optional exponent ("1e9", as Kubernetes quantities allow), then a unit.
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([kmgtpe]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1} | {p + s: 2**(10 * i) if s.startswith("i") else 10**(3 * i)
                            for i, p in enumerate("kmgtpe", start=1) for s in ("", "b", "i", "ib")}


def parse_size(text: str) -> int:
    """Bytes from "2GiB", "512MiB", "1.5G", "1000000", or a Kubernetes quantity ("8Gi", "64M", "1e9").

    K/M/G/T/P/E are decimal, Ki/Mi/Gi/Ti/Pi/Ei binary; case and a trailing "B" are ignored, so a
    lowercase "m" means mega here (never Kubernetes' milli: a byte count has no fractions).
    Fractions round up to a whole byte.
    """
    m = _SIZE.match(text)
    unit = (m.group(3) or "").lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 8Gi, 1000000)")
    value = Fraction(m.group(1)) * Fraction(10) ** int(m.group(2) or 0) * _UNITS[unit]
    n = math.ceil(value)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return n


def add_max_request_bytes(group: argparse._ArgumentGroup, default: int) -> None:
    """``--max-request-bytes``: the bound on one request body (the engine server and the router)."""
    group.add_argument("--max-request-bytes", type=parse_size, default=default, metavar="SIZE",
                       help="largest request body accepted; larger ones get 413 before they are read "
                            f"(default: {default >> 20}MiB)")


def port_or_zero(text: str, highest: int = 65535, what: str = "a port", zero: str = "any free port") -> int:
    """An argparse port in [0, highest]; the message says what 0 means for this flag."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= highest:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r} (0 for {zero}, or 1..{highest})")
    return port


def non_negative_int(text: str) -> int:
    """An argparse count >= 0."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"not a count >= 0: {text!r}")
    return n


def config_model_path(path: str) -> str | None:
    """The model path a kvmesh YAML config names (model.source.path), or None."""
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ArgsError(f"cannot read --config {path}: {e}") from None
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise ArgsError(f"--config {path} must hold a YAML mapping, not {type(doc).__name__}")
    source = (doc.get("model") or {}).get("source") or {}
    return source.get("path") if isinstance(source, dict) else None
