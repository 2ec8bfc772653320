"""Rewrites the vendored CRD schemas of this directory from the CRD YAML files of their projects.

    python tests/unit/deploy/schemas/vendor.py LWS_CRD.yaml KEDA_SCALEDOBJECT_CRD.yaml SERVICEMONITOR_CRD.yaml

Each output file keeps one served version's openAPIV3Schema (descriptions dropped: they are
most of the bytes and validate nothing) with where it came from. To move to a new release,
take the files at that release's tag, change SOURCES and run this again.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).parent
# CRD name -> (output file, served version, where the YAML was taken from)
SOURCES = {
    "leaderworkersets.leaderworkerset.x-k8s.io": (
        "lws-v0.10.0-leaderworkerset-v1.json", "v1",
        "github.com/kubernetes-sigs/lws v0.10.0 "
        "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"),
    "scaledobjects.keda.sh": (
        "keda-v2.20.2-scaledobject-v1alpha1.json", "v1alpha1",
        "github.com/kedacore/keda v2.20.2 config/crd/bases/keda.sh_scaledobjects.yaml"),
    "servicemonitors.monitoring.coreos.com": (
        "prometheus-operator-v0.93.0-servicemonitor-v1.json", "v1",
        "github.com/prometheus-operator/prometheus-operator v0.93.0 "
        "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml"),
}


def strip_descriptions(node: Any, in_properties: bool = False) -> Any:
    """The schema without its prose; a *property* named "description" is kept."""
    if isinstance(node, dict):
        return {k: strip_descriptions(v, k == "properties" and not in_properties)
                for k, v in node.items()
                if in_properties or not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def main(paths: list[str]) -> None:
    for path in paths:
        crd = yaml.safe_load(Path(path).read_text())
        out, version, source = SOURCES[crd["metadata"]["name"]]
        ver = next(v for v in crd["spec"]["versions"] if v["name"] == version)
        doc = {"source": source, "group": crd["spec"]["group"], "version": version,
               "kind": crd["spec"]["names"]["kind"],
               "openAPIV3Schema": strip_descriptions(ver["schema"]["openAPIV3Schema"])}
        (HERE / out).write_text(json.dumps(doc, separators=(",", ":"), sort_keys=True) + "\n")
        print(out, (HERE / out).stat().st_size, "bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
