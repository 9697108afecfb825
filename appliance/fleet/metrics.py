"""One Prometheus exposition for the fleet: each replica's samples with a `replica` label."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else f"{value:.1f}"


def merge_replica_metrics(texts: dict[str, str]) -> str:
    """Merge the expositions of several replicas (replica id -> text): one HELP/TYPE per family,
    every sample labelled with its replica, plus `appliance_fleet_replicas` (replicas answering)."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            _, _, lines = families.setdefault(family.name, (family.type, family.documentation, []))
            for sample in family.samples:
                labels = {**sample.labels, REPLICA_LABEL: replica}
                rendered = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                lines.append(f"{sample.name}{{{rendered}}} {_number(sample.value)}")
    out = ["# HELP appliance_fleet_replicas Replicas that answered this scrape.",
           "# TYPE appliance_fleet_replicas gauge", f"appliance_fleet_replicas {len(texts)}.0"]
    for name, (kind, doc, lines) in families.items():
        out += [f"# HELP {name} {doc.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + 'n')}",
                f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n"
