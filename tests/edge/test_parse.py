"""Tests for edge_relay.collect.parse: text format 0.0.4, OpenMetrics 1.0, the series cache, errors."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as om_families,
)
from prometheus_client.parser import text_string_to_metric_families

from edge_relay.collect.parse import (
    ParseError,
    SampleLimitExceeded,
    SeriesCache,
    is_openmetrics,
    parse,
)
from schemas.model import Labels, float_bits
from simulator import data_path

FIXTURES = data_path()
FIXTURE_NAMES = ["kepler-current-sample.prom", "kepler-0.7-sample.prom", "dcgm-exporter-sample.prom"]
OM = "application/openmetrics-text; version=1.0.0; charset=utf-8"
TEXT = "text/plain; version=0.0.4; charset=utf-8"


def read_fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def labels_of(name: str, **labels: str) -> Labels:
    return tuple(sorted([("__name__", name), *labels.items()]))


def one(body: str, content_type: str = "") -> tuple[Labels, float, int | None]:
    samples = parse(body, content_type)
    assert len(samples) == 1, samples
    return samples[0]


def parse_error(body: str, content_type: str = "", cache: SeriesCache | None = None) -> ParseError:
    with pytest.raises(ParseError) as info:
        parse(body, content_type, cache)
    return info.value


def same_value(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


# --- cross-check against prometheus_client --------------------------------------------------


def reference_samples(body: str) -> list[tuple[Labels, float, int | None]]:
    """Samples as prometheus_client reads them, put in our shape.

    prometheus_client renames samples of a counter typed without ``_total`` to ``<name>_total``
    (its internal OpenMetrics model); undo that, because we keep names exactly as exposed.
    It also keeps empty-valued labels, which we drop by design.
    """
    out = []
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            name = s.name
            if (
                family.type == "counter"
                and name == family.name + "_total"
                and f"# TYPE {family.name} counter" in body
            ):
                name = family.name
            labels = tuple(sorted([("__name__", name), *((k, v) for k, v in s.labels.items() if v)]))
            out.append((labels, float(s.value), s.timestamp))
    return out


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_fixture_matches_prometheus_client(fixture: str) -> None:
    body = read_fixture(fixture)
    ours = parse(body, TEXT)
    ref = reference_samples(body)
    assert len(ours) == len(ref) > 0
    for (labels, value, ts), (ref_labels, ref_value, ref_ts) in zip(ours, ref, strict=True):
        assert labels == ref_labels
        assert same_value(value, ref_value), (labels, value, ref_value)
        assert ts is None and ref_ts is None


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_fixture_cached_parse_is_identical(fixture: str) -> None:
    body = read_fixture(fixture)
    cache = SeriesCache()
    cold = parse(body, TEXT, cache)
    warm = parse(body, TEXT, cache)
    assert warm == cold
    assert all(a[0] is b[0] for a, b in zip(cold, warm, strict=True))
    assert len(cache) == len({labels for labels, _, _ in cold})


def test_fixture_known_values() -> None:
    dcgm = {labels: value for labels, value, _ in parse(read_fixture("dcgm-exporter-sample.prom"))}
    power = [v for k, v in dcgm.items() if ("__name__", "DCGM_FI_DEV_POWER_USAGE") in k and ("gpu", "0") in k]
    assert power == [212.614]
    gpu0 = next(k for k in dcgm if ("__name__", "DCGM_FI_DEV_POWER_USAGE") in k and ("gpu", "0") in k)
    # Byte order: upper-case label names sort before "__name__", lower-case after.
    assert [n for n, _ in gpu0][:4] == ["DCGM_FI_DRIVER_VERSION", "Hostname", "UUID", "__name__"]
    assert dict(gpu0)["modelName"] == "NVIDIA A100 80GB PCIe"
    energy = [v for k, v in dcgm.items() if ("__name__", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION") in k]
    assert sorted(energy) == [71934118276.0, 118722841509.0]
    # Counter typed without _total keeps its exposed name.
    assert any(("__name__", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS") in k for k in dcgm)

    current = {labels: value for labels, value, _ in parse(read_fixture("kepler-current-sample.prom"))}
    assert current[labels_of("go_gc_gomemlimit_bytes")] == 9.223372036854776e18
    assert current[labels_of("go_gc_duration_seconds", quantile="0.25")] == 6.2109e-05
    assert current[labels_of("go_gc_duration_seconds_count")] == 17342.0
    cpu = labels_of(
        "kepler_node_cpu_watts",
        node_name="edge-gpu-01",
        path="/host/sys/class/powercap/intel-rapl:0",
        zone="package",
    )
    assert current[cpu] == 128.4
    # container_id="" and vm_id="" are dropped.
    chronyd = next(
        k
        for k in current
        if ("comm", "chronyd") in k and dict(k)["__name__"] == "kepler_process_cpu_seconds_total"
    )
    assert {n for n, _ in chronyd} == {"__name__", "comm", "exe", "node_name", "pid", "type"}
    assert current[chronyd] == 210.88

    old = parse(read_fixture("kepler-0.7-sample.prom"))
    triton = labels_of(
        "kepler_container_joules_total",
        container_id="9e22cb4aac49d42632176e4633cf7a1b25faf5489c8523b47ea2cfe2e93bdeec",
        container_name="triton",
        container_namespace="vision",
        mode="dynamic",
        pod_name="triton-inference-6d8f9c7b5-tq4zx",
    )  # source="" dropped
    assert [v for k, v, _ in old if k == triton] == [5.3811391214e07]


# --- text format ---------------------------------------------------------------------------


def test_simple_samples_and_timestamps() -> None:
    body = 'a 1\nb{x="y"} 2 1700000000123\nc -3 -42\n'
    assert parse(body) == [
        (labels_of("a"), 1.0, None),
        (labels_of("b", x="y"), 2.0, 1700000000123),
        (labels_of("c"), -3.0, -42),
    ]


def test_names_kept_exactly_as_exposed() -> None:
    body = (
        "# TYPE requests counter\nrequests 1\n# TYPE hits_total counter\nhits_total 2\n"
        'hits_created 1.7e9\nh_bucket{le="+Inf"} 3\nh_sum 4\nh_count 3\nh_gcount 3\nns:metric:rate5m 5\n'
    )
    names = [dict(labels)["__name__"] for labels, _, _ in parse(body)]
    assert names == [
        "requests",
        "hits_total",
        "hits_created",
        "h_bucket",
        "h_sum",
        "h_count",
        "h_gcount",
        "ns:metric:rate5m",
    ]


def test_label_value_escapes() -> None:
    labels, _, _ = one(r'm{a="back\\slash",b="quote\"d",c="new\nline",d="other\t",e="\\n"} 1')
    d = dict(labels)
    assert d["a"] == "back\\slash"
    assert d["b"] == 'quote"d'
    assert d["c"] == "new\nline"
    assert d["d"] == "other\\t"  # unknown escapes stay verbatim, like Prometheus
    assert d["e"] == "\\n"  # escaped backslash followed by a plain n


def test_label_values_with_awkward_characters() -> None:
    line = 'm{a="x y} z",b="1,2",c="k=v",d="# not a comment",e="Grüße 🌍",f=" 7 8 "} 9 123'
    labels, value, ts = one(line)
    assert dict(labels) == {
        "__name__": "m",
        "a": "x y} z",
        "b": "1,2",
        "c": "k=v",
        "d": "# not a comment",
        "e": "Grüße 🌍",
        "f": " 7 8 ",
    }
    assert (value, ts) == (9.0, 123)


def test_labels_sorted_in_byte_order() -> None:
    labels, _, _ = one('m{zeta="1",Alpha="2",_u="3",beta="4",B="5"} 1')
    assert [n for n, _ in labels] == ["Alpha", "B", "__name__", "_u", "beta", "zeta"]


def test_empty_label_values_dropped() -> None:
    assert one('m{a="",b="x",c=""} 1')[0] == labels_of("m", b="x")
    assert one('m{a=""} 1')[0] == labels_of("m")


def test_trailing_comma_and_empty_braces() -> None:
    assert one('m{a="b",} 1')[0] == labels_of("m", a="b")
    assert one("m{} 1")[0] == labels_of("m")


def test_liberal_whitespace_in_text_format() -> None:
    lines = [
        'm{a="b"} 1',
        'm{a="b"}\t1',
        'm{a="b"}   1   ',
        '  m { a = "b" , } 1',
        'm{\ta="b"\t}\t1',
        'm{a="b"}1',  # Prometheus' lexer needs no space after '}'
    ]
    for line in lines:
        assert one(line)[:2] == (labels_of("m", a="b"), 1.0), line
    assert one("m \t 2 \t 77 \t")[1:] == (2.0, 77)


def test_comments_and_blank_lines_ignored() -> None:
    body = (
        '# HELP m anything at all: {"}\\ \\n # TYPE m counter\n'
        "# TYPE m gauge\n"
        "\n"
        "   \n"
        "#no space comment\n"
        "  # indented comment\n"
        "m 1\n"
        "\n"
    )
    assert parse(body) == [(labels_of("m"), 1.0, None)]
    assert parse("") == []
    assert parse("\n\n# only comments\n") == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", 1.0),
        ("-0", -0.0),
        ("0.5", 0.5),
        (".5", 0.5),
        ("5.", 5.0),
        ("1e3", 1000.0),
        ("1E-3", 0.001),
        ("-1.5e+06", -1.5e6),
        ("118722841509", 118722841509.0),
        ("9.223372036854776e+18", 9.223372036854776e18),
        ("4.9e-324", 5e-324),
        ("1e-400", 0.0),  # underflow is not an error in Go either
        ("+Inf", math.inf),
        ("-Inf", -math.inf),
        ("Inf", math.inf),
        ("inf", math.inf),
        ("+infinity", math.inf),
        ("-INF", -math.inf),
    ],
)
def test_values(text: str, expected: float) -> None:
    value = one(f"m {text}")[1]
    assert float_bits(value) == float_bits(expected)
    # Same through the cached fast path, with and without a timestamp.
    cache = SeriesCache()
    parse("m 0", cache=cache)
    assert float_bits(parse(f"m {text}", cache=cache)[0][1]) == float_bits(expected)
    assert float_bits(parse(f"m {text} 5", cache=cache)[0][1]) == float_bits(expected)


@pytest.mark.parametrize("text", ["NaN", "nan", "NAN"])
def test_nan_is_python_nan(text: str) -> None:
    value = one(f"m {text}")[1]
    assert float_bits(value) == float_bits(float("nan"))


def test_value_bits_preserved() -> None:
    (_, a, _), (_, b, _) = parse("m 0.1\nn 2.718281828459045")
    assert struct.pack("<d", a) == struct.pack("<d", 0.1)
    assert b == math.e


# --- OpenMetrics -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        ("application/openmetrics-text; version=1.0.0; charset=utf-8", True),
        ("application/openmetrics-text", True),
        ("Application/OpenMetrics-Text;version=0.0.1", True),
        ("text/plain; version=0.0.4; charset=utf-8", False),
        ("text/plain", False),
        ("", False),
        ("application/json", False),
    ],
)
def test_is_openmetrics(content_type: str, expected: bool) -> None:
    assert is_openmetrics(content_type) is expected


OM_BODY = """\
# TYPE requests counter
# HELP requests Requests served, with "quotes" and \\ backslashes.
requests_total{path="/api",code="200"} 1027 1700000000.123
requests_created{path="/api",code="200"} 1699990000.5 1700000000.123
requests_total{path="/x y",code="500",empty=""} 3 # {trace_id="abc 123",span="# x"} 1.0 1700000000.001
requests_created{path="/x y",code="500"} 1699990000.25
# TYPE latency_seconds histogram
# UNIT latency_seconds seconds
latency_seconds_bucket{le="0.1"} 8 # {trace_id="t1"} 0.05
latency_seconds_bucket{le="1.0"} 10
latency_seconds_bucket{le="+Inf"} 11
latency_seconds_count 11
latency_seconds_sum 3.5e0
latency_seconds_created 1.6999e9
# TYPE queue gaugehistogram
queue_bucket{le="+Inf"} 4
queue_gcount 4
queue_gsum 2.5
# TYPE temp gauge
temp{sensor="a"} NaN
# TYPE rpc summary
rpc{quantile="0.99"} +Inf 1700000002
rpc_count 9 1700000002
# TYPE old gauge
old 7 -1.5
# TYPE up gauge
up 1 1700000001.0005
# EOF
"""


def test_openmetrics_rendition() -> None:
    samples = parse(OM_BODY, OM)
    got = [(dict(labels), value, ts) for labels, value, ts in samples]
    expected = [
        ({"__name__": "requests_total", "path": "/api", "code": "200"}, 1027.0, 1700000000123),
        ({"__name__": "requests_created", "path": "/api", "code": "200"}, 1699990000.5, 1700000000123),
        ({"__name__": "requests_total", "path": "/x y", "code": "500"}, 3.0, None),
        ({"__name__": "requests_created", "path": "/x y", "code": "500"}, 1699990000.25, None),
        ({"__name__": "latency_seconds_bucket", "le": "0.1"}, 8.0, None),
        ({"__name__": "latency_seconds_bucket", "le": "1.0"}, 10.0, None),
        ({"__name__": "latency_seconds_bucket", "le": "+Inf"}, 11.0, None),
        ({"__name__": "latency_seconds_count"}, 11.0, None),
        ({"__name__": "latency_seconds_sum"}, 3.5, None),
        ({"__name__": "latency_seconds_created"}, 1.6999e9, None),
        ({"__name__": "queue_bucket", "le": "+Inf"}, 4.0, None),
        ({"__name__": "queue_gcount"}, 4.0, None),
        ({"__name__": "queue_gsum"}, 2.5, None),
        ({"__name__": "temp", "sensor": "a"}, math.nan, None),
        ({"__name__": "rpc", "quantile": "0.99"}, math.inf, 1700000002000),
        ({"__name__": "rpc_count"}, 9.0, 1700000002000),
        ({"__name__": "old"}, 7.0, -1500),
        ({"__name__": "up"}, 1.0, 1700000001000),  # .0005 s -> half-even
    ]
    assert len(got) == len(expected)
    for (labels, value, ts), (e_labels, e_value, e_ts) in zip(got, expected, strict=True):
        assert labels == e_labels
        assert same_value(value, e_value)
        assert ts == e_ts
    # Labels are sorted tuples like in the text format.
    assert samples[0][0] == labels_of("requests_total", code="200", path="/api")


def test_openmetrics_matches_prometheus_client() -> None:
    ref = []
    for family in om_families(OM_BODY):
        for s in family.samples:
            labels = tuple(sorted([("__name__", s.name), *((k, v) for k, v in s.labels.items() if v)]))
            ts = None if s.timestamp is None else s.timestamp.sec * 1000 + s.timestamp.nsec // 1_000_000
            ref.append((labels, float(s.value), ts))
    ours = parse(OM_BODY, OM)
    assert [labels for labels, _, _ in ours] == [labels for labels, _, _ in ref]
    assert all(same_value(a[1], b[1]) for a, b in zip(ours, ref, strict=True))
    assert [t for _, _, t in ours] == [t for _, _, t in ref]


def test_openmetrics_cached_parse_is_identical() -> None:
    cache = SeriesCache()
    cold = parse(OM_BODY, OM, cache)
    warm = parse(OM_BODY, OM, cache)
    assert [repr(s) for s in warm] == [repr(s) for s in cold]
    assert all(a[0] is b[0] for a, b in zip(cold, warm, strict=True))


@pytest.mark.parametrize(
    ("seconds", "ms"),
    [
        ("1700000000.123", 1700000000123),
        ("2158054038.483", 2158054038483),  # int(float(x) * 1000) is one ms short for these
        ("1.001", 1001),
        ("1700000000.1239", 1700000000124),
        ("1700000000.1234", 1700000000123),
        ("1700000000", 1700000000000),
        ("1700000000.", 1700000000000),
        ("0.001", 1),
        (".5", 500),
        ("-0.0015", -2),  # half-even
        ("1.7e9", 1700000000000),
        ("1.700000000123E+9", 1700000000123),
        ("+12", 12000),
    ],
)
def test_openmetrics_timestamps(seconds: str, ms: int) -> None:
    assert parse(f"m 1 {seconds}\n# EOF\n", OM)[0][2] == ms
    cache = SeriesCache()
    parse("m 1\n# EOF\n", OM, cache)
    assert parse(f"m 2 {seconds}\n# EOF\n", OM, cache)[0][2] == ms  # cached path


def test_openmetrics_eof_handling() -> None:
    assert parse("m 1\n# EOF", OM) == parse("m 1\n# EOF\n", OM) == [(labels_of("m"), 1.0, None)]
    assert parse("# EOF\n", OM) == []
    for body, lineno in [
        ("m 1\n", 1),
        ("m 1", 1),
        ("", 1),
        ("m 1\nm 2\n", 2),
        ("m 1\n# EOF\n\n", 3),
        ("m 1\n# EOF\nm 2\n", 3),
        ("m 1\n# EOF\nm 2\n# EOF\n", 2),
        ("m 1\n# EOF \n", 2),
    ]:
        err = parse_error(body, OM)
        assert err.lineno == lineno, body
        assert "EOF" in str(err)


def test_text_format_needs_no_eof() -> None:
    assert parse("m 1\n# EOF\n") == [(labels_of("m"), 1.0, None)]


def test_openmetrics_is_strict_about_layout() -> None:
    cache = SeriesCache()
    parse('m 1\nm{a="b"} 1\n# EOF\n', OM, cache)  # warm, so the cached fast path is exercised too
    for line in [
        "m  1",
        "m\t1",
        "m \t1",
        "m 1\t",
        "m 1 \t5",
        "m 1 ",
        'm {a="b"} 1',
        'm{ a="b"} 1',
        'm{a = "b"} 1',
        " m 1",
        "m 1 2 3",
        "m 1 # {a=b} 1",
        'm 1 # {a="b"}',
        'm 1 # {a="b"} x',
        'm 1 # {a="b"} 1 x',
        "m 1 1e999999999999999999999",
        "m 1 1e-999999999999999999999",
        "m 1 1e17",
        "m 1 NaN",
        "m 1 Inf",
        "# some comment",
        "# TYPE m thing",
        "# HELP",
        "",
    ]:
        for c in (None, cache):
            with pytest.raises(ParseError):
                parse(f"ok 1\n{line}\n# EOF\n", OM, c)
    # The same layouts are fine in the liberal text format (when they are samples at all).
    for line in ["m  1", "m\t1", "m 1 ", 'm {a="b"} 1', 'm{ a="b"} 1', 'm{a = "b"} 1', " m 1"]:
        assert len(parse(line)) == 1


def test_cache_keys_do_not_leak_between_formats() -> None:
    cache = SeriesCache()
    parse('m {a="b"} 1\n', TEXT, cache)  # valid only in the text format
    with pytest.raises(ParseError):
        parse('m {a="b"} 1\n# EOF\n', OM, cache)
    om = parse('m{a="b"} 1\n# EOF\n', OM, cache)
    text = parse('m{a="b"} 2\n', TEXT, cache)
    assert om[0][0] is text[0][0]


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("m", "missing value"),
        ('m{a="b"}', "missing value"),
        ("m   ", "missing value"),
        ("m abc", "invalid value"),
        ("m 1_000", "invalid value"),
        ("m 0x10", "invalid value"),
        ("m 0x1p3", "invalid value"),
        ("m +NaN", "invalid value"),
        ("m 1.2.3", "invalid value"),
        ("m ١٢", "invalid value"),  # Python's float() takes Arabic-Indic digits, Go does not
        ("m 1\r", "invalid value"),
        ("m \x0b1", "invalid value"),  # float() strips any whitespace, the format allows space/tab
        ("m 1\x0c", "invalid value"),
        ("m 1 \x0b5", "invalid timestamp"),
        ("m 1e400", "out of float64 range"),
        ("m 1 1.5", "invalid timestamp"),
        ("m 1 abc", "invalid timestamp"),
        ("m 1 99999999999999999999", "timestamp"),
        ("m 1 9223372036854775808", "out of range"),
        ("m 1 2 3", "unexpected text"),
        ('m{a="b} 1', "unterminated label value"),
        ('m{a="b" 1', "expected ','"),
        ('m{a="b",', "unterminated label set"),
        ('m{a="b"', "unterminated label set"),
        ('m{a="b\\"} 1', "unterminated label value"),
        ("m{a=b} 1", "expected quoted value"),
        ('m{a"b"} 1', "expected '='"),
        ('m{1a="b"} 1', "invalid label name"),
        ('m{a-b="c"} 1', "expected '='"),
        ('m{,a="b"} 1', "invalid label name"),
        ('m{a="b",,c="d"} 1', "invalid label name"),
        ('m{a="1",a="2"} 1', "duplicate label name 'a'"),
        ('m{a="",a="2"} 1', "duplicate label name 'a'"),
        ('m{__name__="x"} 1', "duplicate label name '__name__'"),
        ('m{a="b"}{c="d"} 1', "unexpected '{'"),
        ("1m 1", "invalid metric name"),
        ('{a="b"} 1', "invalid metric name"),
        ("m-x 1", "invalid character"),
        ("m.x 1", "invalid character"),
        ("mé 1", "invalid character"),
    ],
)
def test_broken_line_fails_whole_body(line: str, reason: str) -> None:
    body = f"# HELP ok fine\nok 1\n{line}\nok2 2\n"
    for cache in (None, SeriesCache()):
        if cache is not None:
            parse("ok 1\nm 1\nm 1 1\nok2 2\n", TEXT, cache)  # warm: the broken line must not slip through
        err = parse_error(body, TEXT, cache)
        assert err.lineno == 3
        assert err.line == line
        assert reason in err.reason
        assert str(err).startswith(f"line 3: {err.reason}: ")
        assert repr(line[:20]).rstrip("'") in str(err)  # excerpt of the bad line


def test_error_excerpt_is_short() -> None:
    line = 'm{a="' + "x" * 5000
    err = parse_error(f"{line}\n")
    assert err.lineno == 1
    assert len(str(err)) < 200
    assert "..." in str(err)


def test_error_line_number_with_repeated_lines() -> None:
    err = parse_error("a 1\na 1\nb 2\nb x\nb x\n")
    assert err.lineno == 4


def test_truncated_body_fails() -> None:
    body = read_fixture("dcgm-exporter-sample.prom")
    cache = SeriesCache()
    parse(body, TEXT, cache)
    cut = body.index("212.614")
    for end in (cut, cut - 40, body.index('modelName="NVIDIA A100') + 20):
        with pytest.raises(ParseError):
            parse(body[:end], TEXT, cache)


def test_openmetrics_truncated_body_fails() -> None:
    with pytest.raises(ParseError):
        parse(OM_BODY[: OM_BODY.index("# EOF")], OM)
    with pytest.raises(ParseError):
        parse(OM_BODY[:200], OM)


# --- sample limit --------------------------------------------------------------------------


def test_sample_limit() -> None:
    body = "a 1\nb 2\nc 3\n# comment\n"
    assert len(parse(body, sample_limit=3)) == 3
    assert len(parse(body, sample_limit=0)) == 3
    with pytest.raises(SampleLimitExceeded) as info:
        parse(body, sample_limit=2)
    err = info.value
    assert isinstance(err, ParseError)
    assert "sample_limit 2" in str(err)
    assert "3 samples" in str(err)
    assert "failed" in str(err)
    with pytest.raises(SampleLimitExceeded):
        parse("a 1\nb 2\n# EOF\n", OM, sample_limit=1)


# --- cache ---------------------------------------------------------------------------------


def test_cache_hits_return_identical_objects() -> None:
    cache = SeriesCache()
    first = parse('m{a="b",c="d"} 1\nn 2 100\n', cache=cache)
    second = parse('m{a="b",c="d"} 3\nn 4 200\n', cache=cache)
    assert first[0][0] is second[0][0]
    assert first[1][0] is second[1][0]
    assert [s[1:] for s in second] == [(3.0, None), (4.0, 200)]


def test_equal_label_sets_are_interned() -> None:
    cache = SeriesCache()
    spellings = [
        'm{a="b",c="d"} 1',
        'm{c="d",a="b"} 1',
        'm{a="b",c="d",} 1',
        'm{a="b",e="",c="d"} 1',
        'm { a="b", c="d" } 1',
    ]
    objs = [parse(s, cache=cache)[0][0] for s in spellings]
    assert objs[0] == labels_of("m", a="b", c="d")
    assert all(o is objs[0] for o in objs)


def test_cache_is_bounded() -> None:
    cache = SeriesCache(max_entries=10)
    body = "".join(f'm{{i="{i}"}} {i}\n' for i in range(95))
    for _ in range(3):
        samples = parse(body, cache=cache)
        assert len(cache) <= 10
        assert [dict(labels)["i"] for labels, _, _ in samples] == [str(i) for i in range(95)]
        assert [v for _, v, _ in samples] == [float(i) for i in range(95)]
    assert cache.overflows >= 9
    assert len(cache._labelsets) <= 10
    assert len(cache._pairs) <= 11
    cache.clear()
    assert len(cache) == 0


def test_default_cache_still_interns_within_a_body() -> None:
    a, b = parse('m{a="b"} 1\nm{a="b"} 2\n')
    assert a[0] is b[0]


def test_cached_key_is_never_mistaken() -> None:
    cache = SeriesCache()
    parse('in 1\nm 1\nm{a="x"} 1\nm{a="x y"} 1\n', cache=cache)
    # "inf" must not be read as series "in" + value "f"/"inf".
    assert parse_error("inf\n", cache=cache).reason == "missing value"
    # "m" is cached, but here the space is followed by a label set, not a value.
    assert parse('m {b="c"} 2\n', cache=cache) == [(labels_of("m", b="c"), 2.0, None)]
    assert parse('m {b="c"} 2 3\n', cache=cache) == [(labels_of("m", b="c"), 2.0, 3)]
    # A prefix of a quoted value that contains spaces is never a key.
    assert parse_error('m{a="x y 1\n', cache=cache).reason.startswith("unterminated")
    assert parse('m{a="x y"} 1 2\n', cache=cache) == [(labels_of("m", a="x y"), 1.0, 2)]


# Fragments that make cache-key collisions and near-misses likely.
_FRAGMENTS = [
    "m",
    "in",
    "f",
    "inf",
    "{",
    "}",
    'a="x y"',
    'a="x"',
    'b=""',
    ",",
    "=",
    '"',
    "\\",
    " ",
    " ",
    " ",
    "\t",
    "1",
    "1.5",
    "-2",
    "e3",
    "NaN",
    "+Inf",
    "_",
    "#",
    " # ",
    '{a="x"}',
    "1700000000.5",
    "\u00a0",
    "\x0b",
]
_lines = st.lists(st.sampled_from(_FRAGMENTS), min_size=1, max_size=9).map("".join)


def _outcome(line: str, om: bool, cache: SeriesCache) -> str:
    body, ct = (f"{line}\n# EOF\n", OM) if om else (line, TEXT)
    try:
        return repr(parse(body, ct, cache))
    except ParseError as exc:
        return f"error: {exc}"


@settings(max_examples=400, deadline=None, database=None)
@given(prime=st.lists(_lines, max_size=12), line=_lines, om=st.booleans())
def test_warm_cache_never_changes_the_result(prime: list[str], line: str, om: bool) -> None:
    cache = SeriesCache()
    for p in prime:
        _outcome(p, om, cache)
        _outcome(p, not om, cache)
    assert _outcome(line, om, cache) == _outcome(line, om, SeriesCache())


@pytest.mark.parametrize("content_type", ["", "application/openmetrics-text; version=1.0.0"])
def test_the_series_cache_holds_live_series_and_recent_churn_only(content_type: str) -> None:
    """Pods replaced every scrape: the cache keeps the live series (the same tuples, scrape after
    scrape) and at most two generations of the gone ones, however long the churn goes on."""
    cache = SeriesCache(generation=4)
    om = content_type != ""
    first: list[Labels] = []
    for scrape in range(50):
        lines = [f'up{{i="{i}"}} 1' for i in range(10)]
        lines += [f'pod_cpu_seconds_total{{pod="p{scrape}-{j}"}} {scrape}.5' for j in range(3)]
        lines += [f'stamped{{i="{i}"}} 2 {1_700_000_000_000 + scrape}' for i in range(2)]
        body = "\n".join(lines) + ("\n# EOF\n" if om else "\n")
        samples = parse(body, content_type, cache)
        assert len(samples) == 15
        if scrape == 0:
            first = [labels for labels, _, _ in samples]
        else:
            assert all(samples[k][0] is first[k] for k in (*range(10), 13, 14))  # live: the same tuples
        assert len(cache) <= 12 + 2 * 4 * 3
