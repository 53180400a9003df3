from fractions import Fraction

import pytest

from kvmesh.operator.quantity import QuantityError, add_bytes, format_bytes, parse_quantity


@pytest.mark.parametrize(
    "text,value",
    [
        ("512Mi", 512 * 2**20),
        ("1Gi", 2**30),
        ("1.5Gi", 3 * 2**29),
        ("2", 2),
        ("500m", Fraction(1, 2)),
        ("1G", 10**9),
        ("1e3", 1000),
        (".5Ki", 512),
        (4, 4),
    ],
)
def test_parse_quantity(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("bad", ["", "Gi", "1GiB", "1 Gi", "one", "1..2", True])
def test_parse_quantity_rejects(bad):
    with pytest.raises(QuantityError):
        parse_quantity(bad)


def test_format_bytes_picks_largest_whole_suffix():
    assert format_bytes(2**30) == "1Gi"
    assert format_bytes(3 * 2**29) == "1536Mi"
    assert format_bytes(1000) == "1000"
    assert format_bytes(Fraction(1, 2)) == "1"  # rounds up, never down
    assert format_bytes(0) == "0"


def test_add_bytes_is_exact():
    assert add_bytes("8Gi", "1Gi") == "9Gi"
    assert add_bytes("0.5Gi", "512Mi") == "1Gi"
    assert add_bytes("1G", "0") == "1000000000"
