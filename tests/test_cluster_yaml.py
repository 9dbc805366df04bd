"""cluster.yaml is a valid Ray cluster launcher file (Ray's own schema) for a GPU cluster that installs
this project the way the README does."""

from __future__ import annotations

from pathlib import Path

import yaml
from ray.autoscaler._private.util import fillout_defaults, validate_config

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"


def test_cluster_yaml_is_valid_for_ray():
    cfg = yaml.safe_load(CLUSTER_YAML.read_text())
    validate_config(fillout_defaults(cfg))      # raises on any schema violation
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    gpu = [t for t in types.values() if t.get("resources", {}).get("GPU", 0) > 0]
    assert gpu and all(t["max_workers"] >= 1 for t in gpu)
    assert any("scripts/setup.sh" in c for c in cfg["setup_commands"])
    assert any("--dashboard-host=0.0.0.0" in c for c in cfg["head_start_ray_commands"])


def test_every_key_is_commented():
    """Each top-level key carries a comment right above it (the file documents itself)."""
    lines = CLUSTER_YAML.read_text().splitlines()
    for i, line in enumerate(lines):
        if line[:1].isalpha() and ":" in line:
            assert i > 0 and lines[i - 1].lstrip().startswith("#"), f"line {i + 1} ({line!r}) has no comment above it"
