"""Topic layout, MQTT filter matching and the KubeEdge collision guard."""

from __future__ import annotations

import paho.mqtt.client as paho
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import topics
from schemas.topics import (
    DEFAULT_PREFIX,
    KUBEEDGE_EDGECORE_SUBSCRIPTIONS,
    ack_topic,
    batch_subscription,
    batch_topic,
    cmd_result_topic,
    cmd_topic,
    collides_with_kubeedge,
    mqtt_topic_matches,
    parse_topic,
    status_subscription,
    status_topic,
    validate_name,
)

# --------------------------------------------------------------------------------------------------
# builders and parser


def test_builders() -> None:
    assert batch_topic(DEFAULT_PREFIX, "lab", "edge-01") == "edgemetrics/v1/lab/edge-01/batch"
    assert ack_topic(DEFAULT_PREFIX, "lab", "edge-01") == "edgemetrics/v1/lab/edge-01/ack"
    assert status_topic("corp/metrics", "lab", "edge-01") == "corp/metrics/v1/lab/edge-01/status"
    assert batch_subscription(DEFAULT_PREFIX, "ingest") == "$share/ingest/edgemetrics/v1/+/+/batch"
    assert batch_subscription(DEFAULT_PREFIX, None) == "edgemetrics/v1/+/+/batch"
    assert batch_subscription(DEFAULT_PREFIX) == "edgemetrics/v1/+/+/batch"
    assert status_subscription(DEFAULT_PREFIX) == "edgemetrics/v1/+/+/status"
    assert cmd_topic(DEFAULT_PREFIX, "lab", "edge-01") == "edgemetrics/v1/lab/edge-01/cmd"
    assert cmd_result_topic(DEFAULT_PREFIX, "lab", "edge-01") == "edgemetrics/v1/lab/edge-01/cmd_result"
    for bad in ("a/b", "+", "#", "$x", ""):
        with pytest.raises(ValueError):
            cmd_topic(DEFAULT_PREFIX, "lab", bad)
        with pytest.raises(ValueError):
            cmd_result_topic(DEFAULT_PREFIX, bad, "edge-01")


def test_subscriptions_match_our_topics() -> None:
    for prefix in (DEFAULT_PREFIX, "corp/metrics/eu"):
        topic = batch_topic(prefix, "lab", "edge-01")
        assert mqtt_topic_matches(batch_subscription(prefix, "ingest"), topic)
        assert mqtt_topic_matches(batch_subscription(prefix), topic)
        assert not mqtt_topic_matches(batch_subscription(prefix), status_topic(prefix, "lab", "edge-01"))
        assert mqtt_topic_matches(status_subscription(prefix), status_topic(prefix, "lab", "edge-01"))
        assert not mqtt_topic_matches(status_subscription(prefix), ack_topic(prefix, "lab", "edge-01"))


@pytest.mark.parametrize("kind", ["batch", "ack", "status", "cmd", "cmd_result"])
def test_parse_round_trip(kind: str) -> None:
    builder = {
        "batch": batch_topic,
        "ack": ack_topic,
        "status": status_topic,
        "cmd": cmd_topic,
        "cmd_result": cmd_result_topic,
    }[kind]
    for prefix in (DEFAULT_PREFIX, "a/b/c"):
        parsed = parse_topic(prefix, builder(prefix, "prod-eu", "edge-ü"))
        assert parsed == ("prod-eu", "edge-ü", kind)
        assert (parsed.cluster, parsed.node, parsed.kind) == ("prod-eu", "edge-ü", kind)


@pytest.mark.parametrize(
    "topic",
    [
        "edgemetrics/v1/lab/edge/other",
        "edgemetrics/v1/lab/edge",
        "edgemetrics/v1/lab/edge/batch/x",
        "edgemetrics/v2/lab/edge/batch",
        "edgemetricsX/v1/lab/edge/batch",
        "other/v1/lab/edge/batch",
        "edgemetrics/v1//edge/batch",
        "edgemetrics/v1/lab//batch",
        "edgemetrics/v1/$lab/edge/batch",
        "edgemetrics/v1/lab/+/batch",
        "edgemetrics/v1/lab/#/batch",
        "",
    ],
)
def test_parse_refuses(topic: str) -> None:
    with pytest.raises(ValueError):
        parse_topic(DEFAULT_PREFIX, topic)


# --------------------------------------------------------------------------------------------------
# name validation


@pytest.mark.parametrize("kind", ["cluster", "node", "share_group"])
@pytest.mark.parametrize(
    "value",
    [
        "",
        "a/b",
        "a+b",
        "a#b",
        "$a",
        "a$",
        "a\x00b",
        "a\nb",
        "a\x7fb",
        "a\x85b",
        "a\ud800b",
        "x" * 129,
        "é" * 65,
    ],
)
def test_invalid_names(kind: str, value: str) -> None:
    with pytest.raises(ValueError):
        validate_name(kind, value)


@pytest.mark.parametrize(
    "value", ["a", "edge-01", "edge_01.example.com", "Ünïcödé", "x" * 128, "é" * 64, "user"]
)
def test_valid_names(value: str) -> None:
    assert validate_name("node", value) == value
    assert validate_name("cluster", value) == value


def test_validate_name_rejects_unknown_kind_and_non_str() -> None:
    with pytest.raises(ValueError):
        validate_name("topic", "a")
    with pytest.raises(ValueError):
        validate_name("node", 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        validate_name("prefix", None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "prefix",
    [
        "",
        "/",
        "/a",
        "a/",
        "a//b",
        "$hw",
        "$ke/x",
        "$share/g",
        "a/$b",
        "a+",
        "a/#",
        "a\x00",
        "x" * 129,
        # The second level "user" would put our topics under EdgeCore's "+/user/#".
        "a/user",
        "a/user/b",
        "edgemetrics/user",
    ],
)
def test_invalid_prefixes(prefix: str) -> None:
    with pytest.raises(ValueError):
        validate_name("prefix", prefix)
    with pytest.raises(ValueError):
        topics.validate_prefix(prefix)
    with pytest.raises(ValueError):
        batch_topic(prefix, "c", "n")
    with pytest.raises(ValueError):
        batch_subscription(prefix, "g")


@pytest.mark.parametrize(
    "prefix", ["edgemetrics", "user", "a/b/user", "SYS", "SYS/dis", "hw/events", "a/users"]
)
def test_valid_prefixes(prefix: str) -> None:
    assert validate_name("prefix", prefix) == prefix
    for kind in ("batch", "ack", "status", "cmd", "cmd_result"):
        assert not collides_with_kubeedge(f"{prefix}/v1/c/n/{kind}")


def test_default_topics_do_not_collide() -> None:
    for build in (batch_topic, ack_topic, status_topic, cmd_topic, cmd_result_topic):
        assert not collides_with_kubeedge(build(DEFAULT_PREFIX, "lab", "edge-01"))


def test_collides_with_kubeedge_detects_edgecore_topics() -> None:
    assert collides_with_kubeedge("$hw/events/upload/x")
    assert collides_with_kubeedge("$hw/events/device/d1/p/state/update")
    assert collides_with_kubeedge("$hw/events/device/d1/p/twin/get")
    assert collides_with_kubeedge("$hw/events/node/n1/membership/get")
    assert collides_with_kubeedge("SYS/dis/upload_records")
    assert collides_with_kubeedge("x/user/anything")
    assert collides_with_kubeedge("x/user")
    assert not collides_with_kubeedge("$ke/x/user/y")  # '+' never matches a '$' first level
    assert not collides_with_kubeedge("user/x")


# --------------------------------------------------------------------------------------------------
# MQTT filter matching


MATCH_TABLE = [
    # MQTT 3.1.1 §4.7.1.2 / MQTT 5 §4.7.1.2: multi-level wildcard
    ("sport/tennis/player1/#", "sport/tennis/player1", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
    ("sport/#", "sport", True),
    ("sport/tennis/#", "sport/tennis", True),
    ("sport/tennis/#", "sport/tennisx", False),
    ("#", "sport/tennis", True),
    ("#", "/", True),
    ("#", "a", True),
    # §4.7.1.3: single-level wildcard
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player1/tracer", False),
    ("sport/+", "sport", False),
    ("sport/+", "sport/", True),
    ("+", "sport", True),
    ("+/tennis/#", "sport/tennis/player1", True),
    ("sport/+/player1", "sport/tennis/player1", True),
    ("+/+", "/finance", True),
    ("/+", "/finance", True),
    ("+", "/finance", False),
    ("+/+", "/", True),
    ("a/+/c", "a//c", True),
    ("+/+/+", "a/b", False),
    # §4.7.2: topics beginning with '$'
    ("#", "$SYS/monitor/Clients", False),
    ("#", "$SYS", False),
    ("+/monitor/Clients", "$SYS/monitor/Clients", False),
    ("$SYS/#", "$SYS/monitor/Clients", True),
    ("$SYS/#", "$SYS", True),
    ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
    ("a/#", "a/$b", True),
    ("a/+", "a/$b", True),
    # literal matching is exact and case-sensitive
    ("ACCOUNTS", "Accounts", False),
    ("a/b", "a/b", True),
    ("a/b", "a/b/c", False),
    ("a/b/c", "a/b", False),
    ("a/b", "a/b/", False),
    (" a", "a", False),
    # MQTT 5 shared subscriptions: the share group is not part of the match
    ("$share/g/a/+", "a/b", True),
    ("$share/g/#", "a/b", True),
    ("$share/g/#", "$SYS/x", False),
    ("$share/g/a", "$share/g/a", False),
]


@pytest.mark.parametrize(("filt", "topic", "expected"), MATCH_TABLE)
def test_mqtt_topic_matches_table(filt: str, topic: str, expected: bool) -> None:
    assert mqtt_topic_matches(filt, topic) is expected


@pytest.mark.parametrize(
    "filt",
    [
        "",
        "sport/tennis#",
        "sport/tennis/#/ranking",
        "sport+",
        "+a",
        "#/a",
        "a/#/",
        "a\x00",
        "$share/g",
        "$share//a",
        "$share/g+/a",
    ],
)
def test_invalid_filters_raise(filt: str) -> None:
    with pytest.raises(ValueError):
        mqtt_topic_matches(filt, "a")


@pytest.mark.parametrize("topic", ["", "a/+", "a/#", "+", "a\x00b"])
def test_invalid_topic_names_raise(topic: str) -> None:
    with pytest.raises(ValueError):
        mqtt_topic_matches("#", topic)


levels = st.sampled_from(["a", "b", "", "$a", "$SYS", "user"])
filter_levels = st.one_of(levels, st.just("+"))


@st.composite
def filters(draw: st.DrawFn) -> str:
    parts = draw(st.lists(filter_levels, min_size=1, max_size=5))
    if draw(st.booleans()):
        parts.append("#")
    return "/".join(parts)


@settings(max_examples=2000, deadline=None)
@given(filters().filter(bool), st.lists(levels, min_size=1, max_size=6).map("/".join).filter(bool))
def test_mqtt_topic_matches_agrees_with_paho(filt: str, topic: str) -> None:
    # paho-mqtt's matcher is an independent implementation of the same rules.
    assert mqtt_topic_matches(filt, topic) is paho.topic_matches_sub(filt, topic)


# --------------------------------------------------------------------------------------------------
# KubeEdge collision: property tests

# Names that are also levels of EdgeCore's filters are the interesting ones.
_EDGECORE_WORDS = [
    "user",
    "hw",
    "events",
    "upload",
    "device",
    "state",
    "update",
    "twin",
    "node",
    "membership",
]
_EDGECORE_WORDS += ["get", "SYS", "dis", "upload_records", "v1", "batch", "ack", "status"]
_name_chars = st.characters(codec="utf-8", exclude_characters="/+#$", min_codepoint=0x20).filter(
    lambda c: not 0x7F <= ord(c) <= 0x9F
)
names = st.one_of(st.sampled_from(_EDGECORE_WORDS), st.text(_name_chars, min_size=1, max_size=12))
prefix_levels = st.lists(names, min_size=1, max_size=4)


@settings(max_examples=1000, deadline=None)
@given(prefix_levels, names, names)
def test_valid_names_never_collide_with_edgecore(levels_: list[str], cluster: str, node: str) -> None:
    prefix = "/".join(levels_)
    try:
        validate_name("prefix", prefix)
    except ValueError:
        return  # refused prefixes are covered below
    for build in (batch_topic, ack_topic, status_topic, cmd_topic, cmd_result_topic):
        topic = build(prefix, cluster, node)
        assert not collides_with_kubeedge(topic), topic
        for filt in KUBEEDGE_EDGECORE_SUBSCRIPTIONS:
            assert not mqtt_topic_matches(filt, topic)
    # Nothing EdgeCore subscribes to is a topic our ingester's filters would pick up either.
    for filt in (batch_subscription(prefix, "ingest"), status_subscription(prefix)):
        for edge in KUBEEDGE_EDGECORE_SUBSCRIPTIONS:
            concrete = edge.replace("+", cluster).replace("#", node)
            assert not mqtt_topic_matches(filt, concrete)


@settings(max_examples=500, deadline=None)
@given(prefix_levels, names, names)
def test_prefix_refused_exactly_when_topics_would_collide(
    levels_: list[str], cluster: str, node: str
) -> None:
    prefix = "/".join(levels_)
    # Build the topics by hand, bypassing validation, to see what a bad prefix would have done.
    raw_topics = [f"{prefix}/v1/{cluster}/{node}/{kind}" for kind in ("batch", "ack", "status")]
    collide = any(collides_with_kubeedge(t) for t in raw_topics)
    try:
        validate_name("prefix", prefix)
        refused = False
    except ValueError:
        refused = True
    too_long = len(prefix.encode("utf-8")) > topics.MAX_PREFIX_BYTES
    assert refused == (collide or too_long), prefix


@settings(max_examples=300, deadline=None)
@given(names, st.lists(names, max_size=3))
def test_second_level_user_is_always_refused(first: str, rest: list[str]) -> None:
    prefix = "/".join([first, "user", *rest])
    with pytest.raises(ValueError):
        validate_name("prefix", prefix)
