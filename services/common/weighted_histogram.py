"""A Prometheus histogram whose observations carry a weight: observe(value, weight) adds
weight to the buckets at or above value, value * weight to the sum and weight to the count.

Used for inter-token latency observed once a request (its mean gap, weighted by its gaps):
_sum / _count is then exactly the mean gap over every token, as a per-token histogram's is,
with one observation a request instead of one a token. labels() / remove() follow
prometheus_client's, so TenantLabels can name and drop its series. Thread-safe (a lock), never
called from the engine's step."""
from __future__ import annotations

import bisect
import threading

from prometheus_client import REGISTRY
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class WeightedHistogram:
    def __init__(self, name: str, documentation: str, labelnames=(), buckets=(),
                 registry=REGISTRY):
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self.buckets = tuple(sorted(float(b) for b in buckets))
        self._series: dict[tuple, list[float]] = {}   # labels -> [per bucket..., +Inf, sum]
        self._lock = threading.Lock()
        if not self.labelnames:
            self._series[()] = self._empty()
        if registry is not None:
            registry.register(self)

    def _empty(self) -> list[float]:
        return [0.0] * (len(self.buckets) + 2)

    def labels(self, *values: str) -> "_Child":
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: labels {self.labelnames}, got {values}")
        key = tuple(str(v) for v in values)
        with self._lock:
            self._series.setdefault(key, self._empty())
        return _Child(self, key)

    def remove(self, *values: str) -> None:
        with self._lock:
            del self._series[tuple(str(v) for v in values)]

    def observe(self, value: float, weight: float = 1.0, key: tuple = ()) -> None:
        if weight <= 0:
            return
        i = bisect.bisect_left(self.buckets, value)        # first bucket with le >= value
        with self._lock:
            series = self._series.setdefault(key, self._empty())
            series[i] += weight
            series[-1] += value * weight

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            snapshot = [(k, list(v)) for k, v in self._series.items()]
        edges = [floatToGoString(b) for b in self.buckets] + ["+Inf"]
        for key, series in snapshot:
            acc, buckets = 0.0, []
            for edge, n in zip(edges, series[:-1]):
                acc += n
                buckets.append((edge, acc))
            family.add_metric(list(key), buckets, sum_value=series[-1])
        yield family


class _Child:
    __slots__ = ("_parent", "_key")

    def __init__(self, parent: WeightedHistogram, key: tuple):
        self._parent, self._key = parent, key

    def observe(self, value: float, weight: float = 1.0) -> None:
        self._parent.observe(value, weight, self._key)
