"""The Prometheus text format (0.0.4), written with what stays the same from one scrape to the
next kept: each family's HELP and TYPE lines and each sample's name and labels, formatted
once; a scrape formats the values only. `Exposition` writes a registry's metrics, `Family`
one family of values read at scrape time (the engine's, `engine_metrics.py`).

prometheus_client's `generate_latest` escapes and validates every name and label of every
sample on every scrape (about 3 µs a sample here, some 300 samples a scrape), on the cores
the model decodes on. The output is the same text, without the `_created` series (each
counter's and histogram's creation time, which Prometheus does not read from this format;
`PROMETHEUS_DISABLE_CREATED_SERIES` drops them the same way)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.utils import floatToGoString

# the types prepos exports, as the text format names them (generate_latest's mapping)
_TYPES = {"counter": "counter", "gauge": "gauge", "histogram": "histogram",
          "unknown": "untyped"}
_KEPT = 4096  # samples' formatted names kept at most (labels never seen again: cleared)


def escape(value: str) -> str:
    """A label value as the text format quotes it."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def label_text(pairs) -> str:
    """`{k="v",...}` of (name, value) pairs in the order given, values escaped."""
    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in pairs) + "}"


def help_lines(name: str, doc: str, kind: str) -> str:
    """A family's HELP and TYPE lines (`kind`: as the text format names it)."""
    doc = doc.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


def count_text(n: int) -> str:
    """A count written as `floatToGoString(float(n))` writes it (Go's exponent form from a
    million on)."""
    return f"{n}.0" if n < 1_000_000 else floatToGoString(n)


class Exposition:
    """The text of `registry`, scrape after scrape: counters, gauges and histograms (the
    types prepos exports), whose metric and label names are valid Prometheus names (checked
    where each metric is made)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self._heads: dict[tuple[str, str, str], str] = {}
        self._names: dict[tuple[str, tuple], str] = {}

    def render(self) -> bytes:
        out: list[str] = []
        heads, names = self._heads, self._names
        if len(names) > _KEPT:
            names.clear()
        for metric in self.registry.collect():
            key = (metric.name, metric.documentation, metric.type)
            head = heads.get(key)
            if head is None:
                kind = _TYPES[metric.type]
                suffix = "_total" if metric.type == "counter" else ""
                head = heads[key] = help_lines(metric.name + suffix, metric.documentation, kind)
            out.append(head)
            created = metric.name + "_created"
            for s in metric.samples:
                if s.name == created:
                    continue
                labels = tuple(sorted(s.labels.items())) if s.labels else ()
                name = names.get((s.name, labels))
                if name is None:
                    name = s.name
                    if labels:
                        name += label_text(labels)
                    name = names[(s.name, labels)] = name + " "
                if s.timestamp is None:
                    out.append(f"{name}{floatToGoString(s.value)}\n")
                else:
                    out.append(f"{name}{floatToGoString(s.value)} "
                               f"{int(float(s.timestamp) * 1000):d}\n")
        return "".join(out).encode()


class Family:
    """A counter or gauge family with at most one label, whose values are read at scrape
    time and written here (no metric objects made a scrape): its HELP and TYPE lines, and
    each label value's sample name, formatted once. A counter's samples are named `_total`,
    as prometheus_client names them."""

    __slots__ = ("name", "doc", "kind", "label", "sample", "head", "_names")

    def __init__(self, name: str, doc: str, kind: str, label: str | None = None):
        self.name, self.doc, self.kind, self.label = name, doc, kind, label
        self.sample = name + "_total" if kind == "counter" else name
        self.head = help_lines(self.sample, doc, _TYPES[kind])
        self._names: dict[str, str] = {}

    def text(self, value) -> str:
        """Its lines: `value` a number, or (with a label) (label value, number) pairs."""
        if self.label is None:
            return f"{self.head}{self.sample} {floatToGoString(value)}\n"
        out, names = [self.head], self._names
        for label, v in value:
            name = names.get(label)
            if name is None:
                if len(names) > _KEPT:
                    names.clear()
                name = names[label] = f"{self.sample}{label_text([(self.label, label)])} "
            out.append(f"{name}{floatToGoString(v)}\n")
        return "".join(out)
