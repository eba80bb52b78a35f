"""MQTT topic layout shared by the edge relay and the cloud ingester.

Topics are ``<prefix>/v1/<cluster>/<node>/{batch,ack,status,cmd,cmd_result}`` (``cmd``: commands
from the ingester's identity to one node, ``cmd_result``: the node's answers; ``schemas.codec.command``).
The node name is a whole topic level so a broker ACL can pin each node to its own topics.  Nothing we
publish or subscribe to may overlap KubeEdge EdgeCore's own MQTT traffic (``$hw/...``, ``$ke/...``,
``+/user/#``, ...): names and prefixes that could make that happen are refused here, in one place.
"""

from __future__ import annotations

import functools
from typing import Final, Literal, NamedTuple

DEFAULT_PREFIX: Final = "edgemetrics"
TOPIC_VERSION: Final = "v1"
KINDS: Final = ("batch", "ack", "status", "cmd", "cmd_result")
Kind = Literal["batch", "ack", "status", "cmd", "cmd_result"]

MAX_NAME_BYTES: Final = 128
MAX_PREFIX_BYTES: Final = 128

# Filters EdgeCore's MQTT bridge (eventbus) subscribes to on the node's broker.
KUBEEDGE_EDGECORE_SUBSCRIPTIONS: Final[list[str]] = [
    "$hw/events/upload/#",
    "$hw/events/device/+/+/state/update",
    "$hw/events/device/+/+/twin/+",
    "$hw/events/node/+/membership/get",
    "SYS/dis/upload_records",
    "+/user/#",
]

NameKind = Literal["prefix", "cluster", "node", "share_group"]
_NAME_KINDS: Final = frozenset({"prefix", "cluster", "node", "share_group"})
_FORBIDDEN_CHARS: Final = frozenset("/+#$\x00")


class ParsedTopic(NamedTuple):
    cluster: str
    node: str
    kind: str


def _bad_char(ch: str) -> bool:
    code = ord(ch)
    # C0/C1 controls are discouraged by MQTT 5 §1.5.4; lone surrogates are not encodable as UTF-8.
    return ch in _FORBIDDEN_CHARS or code < 0x20 or 0x7F <= code <= 0x9F or 0xD800 <= code <= 0xDFFF


def _check_level(kind: str, value: str, level: str) -> None:
    if not level:
        raise ValueError(f"{kind} {value!r}: empty topic level")
    for ch in level:
        if _bad_char(ch):
            raise ValueError(f"{kind} {value!r}: character {ch!r} is not allowed")


def validate_name(kind: NameKind | str, value: str) -> str:
    """Validate one name used in our topics and return it unchanged; raise ValueError otherwise.

    ``cluster``, ``node`` and ``share_group`` are single topic levels: non-empty, at most
    ``MAX_NAME_BYTES`` UTF-8 bytes, none of ``/ + # $``, NUL or control characters.  ``prefix`` may
    have several levels (same rules per level), must not start with ``$`` (brokers reserve it) and
    must not make any of our topics or subscriptions overlap a KubeEdge EdgeCore subscription.
    """
    if kind not in _NAME_KINDS:
        raise ValueError(f"unknown name kind {kind!r}")
    if not isinstance(value, str):
        raise ValueError(f"{kind} must be a str, not {type(value).__name__}")
    if kind == "prefix":
        _validate_prefix(value)
        return value
    _check_level(kind, value, value)
    if len(value.encode("utf-8")) > MAX_NAME_BYTES:
        raise ValueError(f"{kind} {value!r} is longer than {MAX_NAME_BYTES} bytes")
    return value


def validate_prefix(prefix: str) -> str:
    """Shorthand for ``validate_name("prefix", prefix)``."""
    return validate_name("prefix", prefix)


def _is_valid_level_name(level: str) -> bool:
    try:
        validate_name("node", level)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=64)
def _validate_prefix(prefix: str) -> None:
    if not prefix:
        raise ValueError("prefix must not be empty")
    if len(prefix.encode("utf-8", "surrogatepass")) > MAX_PREFIX_BYTES:
        raise ValueError(f"prefix {prefix!r} is longer than {MAX_PREFIX_BYTES} bytes")
    levels = prefix.split("/")
    for level in levels:
        _check_level("prefix", prefix, level)
    for kind in KINDS:
        pattern = [*levels, TOPIC_VERSION, _ANY, _ANY, kind]
        for filt in KUBEEDGE_EDGECORE_SUBSCRIPTIONS:
            if _filter_overlaps_pattern(filt, pattern):
                raise ValueError(
                    f"prefix {prefix!r}: topics {'/'.join(str(p) for p in pattern)} collide with "
                    f"KubeEdge EdgeCore subscription {filt!r}"
                )


class _AnyName:
    """Placeholder for a topic level that may hold any valid cluster/node name."""

    def __str__(self) -> str:
        return "<name>"


_ANY: Final = _AnyName()


def _filter_overlaps_pattern(filt: str, pattern: list[str | _AnyName]) -> bool:
    """True if some topic built from ``pattern`` (with valid names for the placeholders) matches ``filt``."""
    flevels = filt.split("/")
    first = pattern[0]
    # MQTT 4.7.2: wildcards at the first level never match topics starting with '$'.
    if flevels[0] in ("+", "#") and isinstance(first, str) and first.startswith("$"):
        return False
    for i, fl in enumerate(flevels):
        if fl == "#":
            return True
        if i >= len(pattern):
            return False
        level = pattern[i]
        if fl == "+":
            continue
        if isinstance(level, _AnyName):
            if not _is_valid_level_name(fl):
                return False
        elif fl != level:
            return False
    return len(flevels) == len(pattern)


def _topic(prefix: str, cluster: str, node: str, kind: str) -> str:
    validate_name("prefix", prefix)
    validate_name("cluster", cluster)
    validate_name("node", node)
    return f"{prefix}/{TOPIC_VERSION}/{cluster}/{node}/{kind}"


def batch_topic(prefix: str, cluster: str, node: str) -> str:
    return _topic(prefix, cluster, node, "batch")


def ack_topic(prefix: str, cluster: str, node: str) -> str:
    return _topic(prefix, cluster, node, "ack")


def status_topic(prefix: str, cluster: str, node: str) -> str:
    return _topic(prefix, cluster, node, "status")


def cmd_topic(prefix: str, cluster: str, node: str) -> str:
    """Commands for one node (backfill requests), QoS 1, never retained: only the ingester may publish."""
    return _topic(prefix, cluster, node, "cmd")


def cmd_result_topic(prefix: str, cluster: str, node: str) -> str:
    """The node's answers to its commands, QoS 1, not retained."""
    return _topic(prefix, cluster, node, "cmd_result")


def batch_subscription(prefix: str, share_group: str | None = None) -> str:
    """Ingester subscription for every node's batches, as an MQTT 5 shared subscription if grouped."""
    validate_name("prefix", prefix)
    filt = f"{prefix}/{TOPIC_VERSION}/+/+/batch"
    if share_group is None:
        return filt
    validate_name("share_group", share_group)
    return f"$share/{share_group}/{filt}"


def status_subscription(prefix: str) -> str:
    validate_name("prefix", prefix)
    return f"{prefix}/{TOPIC_VERSION}/+/+/status"


def parse_topic(prefix: str, topic: str) -> ParsedTopic:
    """Split one of our topics into (cluster, node, kind); ValueError if it is not one of ours."""
    validate_name("prefix", prefix)
    head = f"{prefix}/{TOPIC_VERSION}/"
    if not isinstance(topic, str) or not topic.startswith(head):
        raise ValueError(f"topic {topic!r} is not under {head!r}")
    parts = topic[len(head) :].split("/")
    if len(parts) != 3:
        raise ValueError(f"topic {topic!r}: expected <cluster>/<node>/<kind> after {head!r}")
    cluster, node, kind = parts
    if kind not in KINDS:
        raise ValueError(f"topic {topic!r}: unknown kind {kind!r}")
    validate_name("cluster", cluster)
    validate_name("node", node)
    return ParsedTopic(cluster, node, kind)


def _validate_filter(filt: str) -> list[str]:
    if not isinstance(filt, str) or not filt:
        raise ValueError("topic filter must be a non-empty str")
    if "\x00" in filt:
        raise ValueError("topic filter must not contain NUL")
    levels = filt.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise ValueError(f"filter {filt!r}: '#' must be a whole, last level")
        if "+" in level and level != "+":
            raise ValueError(f"filter {filt!r}: '+' must be a whole level")
    return levels


def mqtt_topic_matches(filt: str, topic: str) -> bool:
    """MQTT 3.1.1 / 5.0 topic-filter matching (§4.7), including ``$share/<group>/<filter>``.

    Raises ValueError for an invalid filter or a topic name that contains wildcards.
    """
    if isinstance(filt, str) and filt.startswith("$share/"):
        parts = filt.split("/", 2)
        if len(parts) != 3 or not parts[1] or "+" in parts[1] or "#" in parts[1]:
            raise ValueError(f"invalid shared subscription {filt!r}")
        filt = parts[2]
    flevels = _validate_filter(filt)
    if not isinstance(topic, str) or not topic:
        raise ValueError("topic name must be a non-empty str")
    if "+" in topic or "#" in topic or "\x00" in topic:
        raise ValueError(f"topic name {topic!r} must not contain wildcards or NUL")
    tlevels = topic.split("/")
    if tlevels[0].startswith("$") and flevels[0] in ("+", "#"):
        return False
    for i, fl in enumerate(flevels):
        if fl == "#":
            # '#' also matches the parent level itself: "a/#" matches "a".
            return True
        if i >= len(tlevels):
            return False
        if fl != "+" and fl != tlevels[i]:
            return False
    return len(flevels) == len(tlevels)


def collides_with_kubeedge(topic: str) -> bool:
    """True if any KubeEdge EdgeCore subscription filter matches ``topic``."""
    return any(mqtt_topic_matches(f, topic) for f in KUBEEDGE_EDGECORE_SUBSCRIPTIONS)
