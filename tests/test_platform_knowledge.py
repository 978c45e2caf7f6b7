"""The knowledge file itself: every entry sourced, every arch the issue names present, versions compared right."""

from __future__ import annotations

import pytest

from rocktune.platform import knowledge


def test_every_entry_has_source_and_confidence():
    data = knowledge.load()
    for entry in data["archs"] + data["rules"]:
        assert entry["source"] and entry["confidence"] in ("documented", "reported")


def test_required_archs_are_known():
    required = ["gfx906", "gfx908", "gfx90a", "gfx942", "gfx950", "gfx1030", "gfx1031", "gfx1032", "gfx1100",
                "gfx1101", "gfx1102", "gfx1150", "gfx1151", "gfx1200", "gfx1201", "sm_75", "sm_80", "sm_89",
                "sm_90", "cpu"]
    for arch in required:
        facts = knowledge.arch_facts(arch)
        assert facts is not None, arch
        assert facts["precision"] in ("bf16", "fp16", "fp32")


def test_precision_policy_follows_matrix_units():
    assert knowledge.arch_facts("gfx906")["precision"] == "fp32"  # no MFMA
    assert knowledge.arch_facts("gfx1030")["precision"] == "fp32"  # no WMMA
    assert knowledge.arch_facts("gfx942")["precision"] == "bf16"
    assert knowledge.arch_facts("gfx1100")["precision"] == "bf16"
    assert knowledge.arch_facts("sm_75")["precision"] == "fp16"


def test_rule_ids_are_unique_and_reported_env_never_sets_defaults():
    rules = knowledge.load()["rules"]
    assert len({r["id"] for r in rules}) == len(rules)
    for r in rules:
        assert r.get("message") or r.get("env") or r.get("defaults"), r["id"]
        assert not (r["confidence"] == "reported" and r.get("defaults")), r["id"]  # would be silently ignored


@pytest.mark.parametrize(("version", "spec", "expected"), [
    ("2.5.1+rocm6.2", ">=2.5", True), ("2.4.1+rocm6.0", ">=2.5", False), ("2.6.0", "<2.6", False),
    ("6.2.41133-dd7f95766", ">=7.0", False), ("7.1.52802", ">=7.0", True), ("3.12.3", "!=3.12", False),
    ("3.13.1", ">=3.13", True), ("0.48.2", "<0.49", True), ("2", ">=2", True), (None, "*", False),
    ("6.4.4", ">=6.4,<6.5", True), ("6.5", ">=6.4,<6.5", False), ("2.4.1", "==2.4.1", True),
])
def test_version_matches(version, spec, expected):
    assert knowledge.version_matches(version, spec) is expected


def test_native_override_from_arch_name():
    assert knowledge.native_override("gfx906") == "9.0.6"
    assert knowledge.native_override("gfx90a") == "9.0.10"
    assert knowledge.native_override("gfx1151") == "11.5.1"
    assert knowledge.native_override("sm_89") is None
