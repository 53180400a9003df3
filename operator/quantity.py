"""Kubernetes resource quantities ("512Mi", "2", "500m", "1.5G") as exact numbers.

Only what the operator needs: parse a quantity into a `Fraction` of base units
(bytes or cores), add quantities, and format a byte count back into a canonical
binary-suffixed string. Parsing is exact (no floats), so "0.5Gi" + "512Mi"
formats as "1Gi" rather than an approximation.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
# The same grammar the API server accepts (sign, number, suffix or exponent).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_RE = re.compile(
    r"^(?P<num>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<bin>[KMGTPE]i)|(?P<dec>[numkMGTPE])|[eE](?P<exp>[+-]?[0-9]+))?$"
)


class QuantityError(ValueError):
    """A string that is not a Kubernetes resource quantity."""


def parse_quantity(value: str | int | float) -> Fraction:
    """Return the quantity's value in base units (bytes, cores, ...), exactly."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is not a resource quantity")
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise QuantityError(f"{value!r} is not a resource quantity")
        return Fraction(str(value))
    if not isinstance(value, str):
        raise QuantityError(f"{value!r} is not a resource quantity (expected e.g. '512Mi', '2Gi', '500m', '4')")
    match = _RE.match(value.strip())
    if not match:
        raise QuantityError(
            f"{value!r} is not a resource quantity (expected e.g. '512Mi', '2Gi', '500m', '4')"
        )
    number = Fraction(match["num"])
    if match["bin"]:
        return number * _BINARY[match["bin"]]
    if match["dec"]:
        return number * _DECIMAL[match["dec"]]
    if match["exp"]:
        return number * Fraction(10) ** int(match["exp"])
    return number


def format_bytes(value: Fraction | int) -> str:
    """Format a byte count with the largest binary suffix that keeps it whole.

    Rounds up to a whole byte first: a memory request must never come out
    smaller than what was asked for.
    """
    whole = -(-Fraction(value).numerator // Fraction(value).denominator)
    if whole <= 0:
        return "0"
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = _BINARY[suffix]
        if whole % unit == 0:
            return f"{whole // unit}{suffix}"
    return str(whole)


def add_bytes(*quantities: str | int) -> str:
    """Sum memory quantities into one canonical string."""
    return format_bytes(sum((parse_quantity(q) for q in quantities), Fraction(0)))
