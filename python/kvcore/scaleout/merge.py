"""Merge the Prometheus texts of several replicas into one, each series labelled ``replica``."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def merge_metrics(texts: dict[str, str]) -> str:
    """One exposition (text format 0.0.4) of every replica's families, in a stable order;
    a family's HELP/TYPE appear once, its samples gain ``replica="<name>"``."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica in sorted(texts):
        for fam in text_string_to_metric_families(texts[replica]):
            # The parser strips a counter's _total; the exposition names it in HELP/TYPE.
            head = fam.name + "_total" if fam.type == "counter" else fam.name
            kind = fam.type if fam.type != "unknown" else "untyped"
            entry = families.setdefault(head, (fam.documentation, kind, []))
            for s in fam.samples:
                labels = {**s.labels, "replica": replica}
                body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
                entry[2].append(f"{s.name}{{{body}}} {floatToGoString(s.value)}")
    lines = []
    for head, (doc, kind, samples) in families.items():
        lines.append(f"# HELP {head} {_escape(doc)}")
        lines.append(f"# TYPE {head} {kind}")
        lines.extend(samples)
    return "\n".join(lines) + "\n"
