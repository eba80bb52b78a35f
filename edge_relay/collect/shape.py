"""Turn one parsed scrape into the samples the cloud should store.

What it does, per target and scrape, the way a Prometheus server does at scrape time:
- attaches ``job``, ``instance`` and the target's labels (an exposed label of the same name is kept as
  ``exported_<name>``, like ``honor_labels: false``), then ``cluster``/``node`` and external labels
  where the series has no such label (like ``external_labels``); between the two, the target's
  ``metric_relabel_configs`` (``relay_common.relabel``), where Prometheus runs them;
- adds the synthetic series ``up``, ``scrape_duration_seconds``, ``scrape_samples_scraped``;
- emits a stale marker (the exact NaN 0x7ff0000000000002) for each series that vanished since the
  previous scrape, and for every series when the scrape failed;
- drops a second sample of the same series in one scrape (Prometheus drops it too), counted;
- drops series the cloud would refuse (more labels or longer label values than the wire limits),
  counted, instead of letting one bad series fail the whole batch;
- drops samples whose own timestamp the wire cannot carry (negative: `bad_metric 1 -1`), counted.

Why the validation lives here: this is the last stage that sees one scrape of one target, sample by
sample. Past it, samples travel as whole scrapes, cycles and windows, and the codec refuses a batch as
a whole: one bad sample would take its cycle (and with a budget, its batch window) with it. The checks
are the codec's own (``schemas.codec.SeriesChecker``, ``timestamp_in_range``), not a copy, so the
edge drops exactly what the wire would refuse and nothing more; the relay records the counts in the
loss ledger (``label_limits``, ``invalid_timestamp``). Whatever the codec still refuses later (a whole
scrape, e.g. one series alone over ``batch.max_bytes``) is the encoder's fallback's business
(``encode_error``).

Samples that carry their own timestamp keep it and get no stale marker (as in Prometheus).

With a bandwidth budget, ``edge_relay.budget.shaper.BudgetShaper`` then applies the budget's classes
to every target's output.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

from relay_common import relabel as relabel_mod
from schemas.codec import DEFAULT_LIMITS, Limits, SeriesChecker, timestamp_in_range
from schemas.model import STALE_NAN, Labels

ParsedSample = tuple[Labels, float, int | None]
_LABELS, _VALUE, _TIMESTAMP = itemgetter(0), itemgetter(1), itemgetter(2)
# What ``decorate`` returns for a series metric relabeling dropped (Prometheus too signals "drop" with an
# empty label set). A series relabeling left without ``__name__``, or with a metric or label name that
# is not valid, fails the whole scrape, as in Prometheus (its scrape loop checks ``lset.IsValid()``):
# ``decorate`` returns a marker whose one pair has the empty name (no real label set has it) and the
# failure's text as its value.
RELABEL_DROPPED: Labels = ()
NAMELESS: Labels = (("", "metric relabeling left a series without __name__"),)
# The codec's refusals that are relabeling's fault (an exposed name the parser already checked).
_NAME_ERRORS = frozenset({"invalid_label_name", "invalid_metric_name"})
# Scrapes per generation of ``TargetShaper``'s decoration cache (as ``parse.SeriesCache``'s bodies).
DECORATE_GENERATION = 16


@dataclass(slots=True)
class ShapedScrape:
    target: str
    timestamp_ms: int
    labels: list[Labels] = field(default_factory=list)
    values: array = field(default_factory=lambda: array("d"))
    # Per-sample timestamps, only when some sample carried an explicit one.
    timestamps: list[int] | None = None
    stale_markers: int = 0
    duplicates: int = 0
    over_label_limits: int = 0
    invalid_timestamps: int = 0  # own timestamps the wire cannot carry (ledger: invalid_timestamp)
    # Samples a stateful budget class dropped because their series' own timestamp did not advance
    # (ledger: duplicate_sample); set by ``BudgetShaper`` only.
    repeated_timestamps: int = 0
    relabel_dropped: int = 0  # series metric_relabel_configs dropped: wanted by nobody, not a loss
    relabel_error: str = ""  # set when relabeling failed the scrape (a series left without __name__)

    def __len__(self) -> int:
        return len(self.values)


class TargetShaper:
    """Per-target state: label decoration cache and the series of the previous scrape.

    The decoration cache has two generations, like ``parse.SeriesCache``: every
    ``DECORATE_GENERATION`` decorated scrapes (those the same-series shortcut took do not count) the
    current map becomes the old one and the old one is dropped; a series found in the old map moves
    back. So it holds the live series plus at most two generations
    of churn. (A single map cleared only at ``4 * max(live, 50_000)`` entries held every series a
    churning target had for hundreds of scrapes, each entry two label sets the parser's cache had long
    dropped: at 20,000 series on the simulator ~1 MiB a cycle, some 300 MiB before it was cleared.)
    """

    def __init__(
        self,
        target: str,
        target_labels: dict[str, str],
        fill_labels: dict[str, str],
        limits: Limits = DEFAULT_LIMITS,
        metric_relabel: tuple[relabel_mod.Rule, ...] = (),
    ) -> None:
        self.target = target
        self.limits = limits
        self.metric_relabel = metric_relabel
        # job/instance/... override exposed labels; fill labels only fill gaps.
        self.target_labels = dict(sorted(target_labels.items()))
        self.fill_labels = dict(sorted(fill_labels.items()))
        self._decorated: dict[Labels, Labels | None] = {}
        self._decorated_old: dict[Labels, Labels | None] = {}
        self._scrapes = 0
        self._checker = SeriesChecker(limits)
        self._previous: set[Labels] = set()
        # The last scrape's series as the parser gave them, which of them it kept (None: all), what it
        # made of them and its drop counts: a scrape of the very same series in the same order
        # (identical tuples from the parser's cache) comes out the same, without a step per sample.
        self._last: tuple[list[Labels], list[int] | None, list[Labels], tuple[int, int, int]] | None = None
        base = {**self.fill_labels, **self.target_labels}
        self._up = self._synthetic(base, "up")
        self._duration = self._synthetic(base, "scrape_duration_seconds")
        self._scraped = self._synthetic(base, "scrape_samples_scraped")
        self._reserved = frozenset((self._up, self._duration, self._scraped))

    @staticmethod
    def _synthetic(base: dict[str, str], name: str) -> Labels:
        return tuple(sorted({**base, "__name__": name}.items()))

    def decorate(self, labels: Labels) -> Labels | None:
        """Final labels, or None for a series over the wire limits."""
        try:
            return self._decorated[labels]
        except KeyError:
            pass
        if labels in self._decorated_old:  # seen in the last generation: moves back to this one
            known = self._decorated[labels] = self._decorated_old.pop(labels)
            return known
        result = dict(labels)
        for name, value in self.target_labels.items():
            if name in result:
                # Like Prometheus: an exposed `exported_job` moves on to `exported_exported_job`.
                exported = f"exported_{name}"
                while exported in result:
                    exported = f"exported_{exported}"
                result[exported] = result[name]
            result[name] = value
        decorated: Labels | None
        # Like Prometheus: relabeling sees the target labels, not the external ones filled in below;
        # a rule that drops the series, or removes every label, drops it.
        if self.metric_relabel and (not relabel_mod.apply(self.metric_relabel, result) or not result):
            decorated = RELABEL_DROPPED
        elif "__name__" not in result:
            decorated = NAMELESS
        else:
            for name, value in self.fill_labels.items():
                result.setdefault(name, value)
            decorated = tuple(sorted(result.items()))
            # Checked once per series (the result is cached): the codec's own rules, limits among them.
            error = self._checker.labels_error(decorated)
            if error in _NAME_ERRORS and self.metric_relabel:
                made = dict(decorated)
                decorated = (
                    ("", f"metric relabeling made an invalid metric or label name ({error}: {made})"),
                )
            elif error is not None:
                decorated = None
        if len(self._decorated) + len(self._decorated_old) > 4 * max(len(self._previous), 50_000):
            self._decorated.clear()  # a hard bound within one generation (exploding cardinality)
            self._decorated_old.clear()
            self._checker = SeriesChecker(self.limits)  # it remembers label names: bound it too
        self._decorated[labels] = decorated
        return decorated

    def _again(
        self, timestamp_ms: int, samples: Sequence[ParsedSample], duration_s: float
    ) -> ShapedScrape | None:
        """``shape`` of a scrape with the last one's series, in the same order and without their own
        timestamps: the same labels out, no stale markers (the same series are there); else None."""
        assert self._last is not None
        raw, kept, finals, counts = self._last
        if len(samples) != len(raw) or list(map(_LABELS, samples)) != raw:
            return None
        if list(map(_TIMESTAMP, samples)).count(None) != len(samples):
            return None
        out = ShapedScrape(self.target, timestamp_ms, finals[:])
        values = list(map(_VALUE, samples))
        out.values.extend(values if kept is None else map(values.__getitem__, kept))
        out.over_label_limits, out.relabel_dropped, out.duplicates = counts
        self._add_synthetic(out, True, duration_s, len(samples))
        return out

    def _add_synthetic(self, out: ShapedScrape, up: bool, duration_s: float, scraped: int) -> None:
        """``up``, ``scrape_duration_seconds`` and ``scrape_samples_scraped``, at the end of ``out``."""
        out.labels += (self._up, self._duration, self._scraped)
        out.values.extend((1.0 if up else 0.0, duration_s, float(scraped)))

    def shape(
        self,
        timestamp_ms: int,
        samples: Sequence[ParsedSample] | None,
        duration_s: float,
    ) -> ShapedScrape:
        """``samples`` is None for a failed scrape."""
        if samples is not None and self._last is not None:
            again = self._again(timestamp_ms, samples, duration_s)
            if again is not None:
                return again
        # Generations count the scrapes that went through ``decorate``: a scrape the shortcut took
        # brought no churn, and counting it would age a stable target's whole cache out, so that the
        # first change after a quiet hour decorated and checked every series again.
        self._scrapes += 1
        if self._scrapes >= DECORATE_GENERATION:
            self._scrapes = 0
            self._decorated_old, self._decorated = self._decorated, {}
            self._checker = SeriesChecker(self.limits)  # it remembers label names: bound it too
        self._last = None
        out = ShapedScrape(self.target, timestamp_ms)
        labels_out, values_out = out.labels, out.values
        explicit: dict[int, int] = {}
        skipped: list[int] = []
        current: set[Labels] = set()  # series without own timestamps: they get stale markers later
        # A series appears once per scrape; the synthetic series' labels are taken already.
        seen: set[Labels] = set(self._reserved)
        decorate = self.decorate
        for position, (labels, value, ts) in enumerate(samples or ()):
            if ts is not None and not timestamp_in_range(ts):
                # Before the series is claimed: the bad sample alone goes, nothing else of its scrape.
                out.invalid_timestamps += 1
                continue
            final = decorate(labels)
            if final is None:
                out.over_label_limits += 1
                skipped.append(position)
                continue
            if not final:
                out.relabel_dropped += 1
                skipped.append(position)
                continue
            if not final[0][0]:  # relabeling made the series unusable: the scrape fails
                failed = self.shape(timestamp_ms, None, duration_s)
                failed.relabel_error = f"{final[0][1]}: {labels}"
                return failed
            if final in seen:
                out.duplicates += 1
                skipped.append(position)
                continue
            seen.add(final)
            if ts is None:
                current.add(final)
            else:
                explicit[len(values_out)] = ts
            labels_out.append(final)
            values_out.append(value)
        scraped = len(samples) if samples is not None else 0
        if samples is not None and not explicit and not out.invalid_timestamps:
            kept = None
            if skipped:
                dropped = set(skipped)
                kept = [i for i in range(scraped) if i not in dropped]
            counts = (out.over_label_limits, out.relabel_dropped, out.duplicates)
            self._last = (list(map(_LABELS, samples)), kept, labels_out[:], counts)
        for final in self._previous - seen:
            labels_out.append(final)
            values_out.append(STALE_NAN)
            out.stale_markers += 1
        self._previous = current
        self._add_synthetic(out, samples is not None, duration_s, scraped)
        if explicit:
            out.timestamps = [explicit.get(i, timestamp_ms) for i in range(len(values_out))]
        return out


def fill_labels_for(
    cluster: str, node: str, add_node_labels: bool, external_labels: dict[str, str]
) -> dict[str, str]:
    fill = dict(external_labels)
    if add_node_labels:
        fill.setdefault("cluster", cluster)
        fill.setdefault("node", node)
    return fill


def total_samples(scrapes: Iterable[ShapedScrape]) -> int:
    return sum(len(s) for s in scrapes)
