import pytest

from lazytrain.util.units import format_size, parse_count, parse_size

GiB = 2**30


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * GiB),
        ("24gib", 24 * GiB),
        ("24 GiB", 24 * GiB),
        ("24GB", 24 * 10**9),
        ("24gb", 24 * 10**9),
        ("24000MB", 24 * 10**9),
        ("24_000MB", 24 * 10**9),
        ("1.5TiB", 3 * 2**39),
        ("512MiB", 2**29),
        ("100g", 100 * GiB),
        ("100G", 100 * GiB),
        ("2k", 2048),
        ("1.5KiB", 1536),
        ("1073741824", GiB),
        ("1073741824B", GiB),
        ("1e9", 10**9),
        (" 8GiB ", 8 * GiB),
        (4096, 4096),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x", "needs a size like 24GiB, 24GB or 24000MB, got 'x'"),
        ("", "needs a size like"),
        ("GiB", "needs a size like"),
        ("24 GiB GiB", "needs a size like"),
        ("nan", "needs a size like"),
        ("inf", "needs a size like"),
        ("24GHz", "unknown size unit in '24GHz'"),
        ("24gibibytes", "unknown size unit"),
        ("24Gb/s", "needs a size like"),
        ("0", "must be positive"),
        ("0GiB", "must be positive"),
        ("-24GiB", "must be positive"),
        ("1.5", "must be whole"),
        ("0.1B", "must be whole"),
        (0, "must be positive"),
        (-5, "must be positive"),
        (True, "needs a size like"),
        (None, "needs a size like"),
        (24.0, "needs a size like"),
    ],
)
def test_parse_size_rejects(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_size(text)


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [(0, "0 B"), (512, "512 B"), (1536, "1.5 KiB"), (25132175360, "23.4 GiB"), (24 * GiB, "24.0 GiB"),
     (3 * 2**40, "3.0 TiB"), (5000 * 2**40, "5000.0 TiB"), (-2 * GiB, "-2.0 GiB")],
)
def test_format_size(nbytes, expected):
    assert format_size(nbytes) == expected


def test_format_then_parse_is_close():
    for nbytes in (1536, 7 * 2**20, 139 * GiB):
        assert abs(parse_size(format_size(nbytes).replace(" ", "")) - nbytes) <= nbytes * 0.01


def test_parse_count():
    assert parse_count("32", "--batch") == 32
    assert parse_count(" 8 ", "--batch") == 8
    assert parse_count("1_024", "--seq") == 1024
    assert parse_count(4, "--batch") == 4
    for bad in ("0", "-3", 0, -1):
        with pytest.raises(ValueError, match="--batch must be positive"):
            parse_count(bad, "--batch")
    for bad in ("x", "1.5", "", "8k", 2.0, True, None):
        with pytest.raises(ValueError, match="--batch needs a positive whole number"):
            parse_count(bad, "--batch")
