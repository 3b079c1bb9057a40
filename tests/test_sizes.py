import pytest

from fxstar.sizes import Share, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        (4096.0, 4096),
        ("100000", 100000),
        ("123B", 123),
        ("4GiB", 4 * 1024**3),
        ("4gib", 4 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("2KiB", 2048),
        ("1TiB", 1024**4),
        ("1.5 GB", 1_500_000_000),
        ("0.1GB", 100_000_000),
        ("3kb", 3000),
        ("2TB", 2 * 1000**4),
        ("8k", 8192),
        ("2M", 2 * 1024**2),
        ("1G", 1024**3),
        ("1Gi", 1024**3),
        (" 16 MiB ", 16 * 1024**2),
        ("0.3KiB", 307),  # fractions of a byte are truncated
    ],
)
def test_bytes(text, expected):
    assert parse_size(text, "device_memory") == expected


@pytest.mark.parametrize(("text", "percent"), [("30%", 30.0), ("12.5 %", 12.5), ("1000%", 1000.0)])
def test_share(text, percent):
    share = parse_size(text, "device_memory")
    assert share == Share(percent)
    assert parse_size(str(share), "x") == share


def test_share_resolves_against_param_bytes():
    assert Share(30).resolve(1000) == 300
    assert Share(150).resolve(1000) == 1500
    assert Share(12.5).resolve(1001) == 125


@pytest.mark.parametrize(
    "bad", ["4 gigs", "GiB", "", "-1", "1e9", "4GiBB", "0%", "1001%", "-5%", -1, 1.5, True, None]
)
def test_bad_forms_name_the_field_and_the_accepted_forms(bad):
    with pytest.raises(ValueError, match="host_memory") as info:
        parse_size(bad, "host_memory")
    if not isinstance(bad, int) and bad not in ("0%", "1001%"):
        assert "'4GiB'" in str(info.value) and "'30%'" in str(info.value)


def test_format_size():
    assert format_size(4 * 1024**3) == "4GiB"
    assert format_size(1536 * 1024) == "1.5MiB"
    assert format_size(12) == "12B"
    assert format_size(Share(30)) == "30%"
    assert format_size(None) == "None"
