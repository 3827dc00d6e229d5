"""The spec cannot drift: its committed listing, its (major, minor) version and each field's,
and the driver's reading of it."""

from __future__ import annotations

import dataclasses

import pytest

from torch_precompile import PrecompileError, spec, spec_listing
from torch_precompile.shipped.driver import core
from torch_precompile.spec.versions import fields_since
from torch_precompile.spec_listing import record_versions


def test_committed_listing_matches_the_records() -> None:
    problem = spec_listing.drift(spec_listing.LISTING_PATH.read_text())
    assert problem is None, problem


def test_a_field_change_without_a_version_bump_is_refused(monkeypatch, tmp_path) -> None:
    committed = spec_listing.listing()
    original = spec_listing.record_lines
    monkeypatch.setattr(spec_listing, "record_lines", lambda: [*original(), "    extra: int"])
    problem = spec_listing.drift(committed)
    assert problem is not None and "SCHEMA_VERSION is still" in problem
    assert spec_listing.WRITE_COMMAND in problem
    # --write will not paper over it either.
    listing = tmp_path / "spec-schema.txt"
    listing.write_text(committed)
    monkeypatch.setattr(spec_listing, "LISTING_PATH", listing)
    assert spec_listing.main(["--write"]) == 1
    assert listing.read_text() == committed


def test_a_bumped_version_asks_for_the_listing_to_be_written(monkeypatch) -> None:
    committed = spec_listing.listing()
    major, minor = spec.SCHEMA_VERSION
    monkeypatch.setattr(spec_listing, "SCHEMA_VERSION", (major, minor + 1))
    problem = spec_listing.drift(committed)
    assert problem == f"docs/spec-schema.txt is out of date: run `{spec_listing.WRITE_COMMAND}`."


def test_history_ends_at_the_version_written() -> None:
    versions = [change.version for change in spec.SCHEMA_HISTORY]
    assert versions[:9] == [(n, 0) for n in range(1, 10)]  # once written as one integer
    assert versions == sorted(set(versions)) and versions[-1] == spec.SCHEMA_VERSION
    assert spec.OLDEST_READABLE_SCHEMA in versions


def test_every_field_names_a_version_of_the_history() -> None:
    """A field's version is one the history has; one added by a minor version has a default,
    since a reader of an older minor of that major never writes it."""
    versions = {change.version for change in spec.SCHEMA_HISTORY}
    for cls, came in record_versions().items():
        for field in dataclasses.fields(cls):
            version = fields_since(cls, came)[field.name]
            assert version in versions, (cls.__name__, field.name, version)
            if version[1] > 0 or version > came:
                assert field.default is not dataclasses.MISSING, (cls.__name__, field.name)


def test_the_listing_names_each_fields_version() -> None:
    listing = spec_listing.listing()
    assert "    is_optimizer: bool = False  (since 4.0)" in listing
    assert "    wrappers: tuple[str, ...] = ()  (since 10.0)" in listing
    assert f"schema_version: {spec.shown_version(spec.SCHEMA_VERSION)}\n" in listing


def test_a_literal_with_fields_later_than_its_version_is_refused(artifacts) -> None:
    literal = spec.to_literal(spec.parse_spec(artifacts.pair("mlp_infer", "inductor")[0]))
    assert literal["schema_version"] == spec.SCHEMA_VERSION and literal["wrappers"]
    with pytest.raises(PrecompileError, match=r"claims schema version 9.0 .*wrappers \(10.0\)"):
        spec.from_literal({**literal, "schema_version": 9})


def test_a_newer_minor_is_read_and_a_newer_major_refused(artifacts) -> None:
    literal = spec.to_literal(spec.parse_spec(artifacts.pair("mlp_infer", "eager")[0]))
    major, minor = spec.SCHEMA_VERSION
    newer = {**literal, "schema_version": (major, minor + 1), "added_later": (1, 2)}
    read = spec.from_literal(newer)
    assert (
        read.schema_version == (major, minor + 1) and read.model == spec.from_literal(literal).model
    )
    # Under its own minor the same field is unknown, and a malformed artifact.
    with pytest.raises(PrecompileError, match="unknown fields \\['added_later'\\]"):
        spec.from_literal({**newer, "schema_version": spec.SCHEMA_VERSION})
    with pytest.raises(PrecompileError, match=f"schema version {major + 1}.0; .*Upgrade"):
        spec.from_literal({**literal, "schema_version": (major + 1, 0)})


def test_fields_at_their_defaults_are_left_out_and_read_back(backend: str, artifacts) -> None:
    read = spec.parse_spec(artifacts.pair("mlp_train", backend)[0])
    literal = spec.to_literal(read)
    assert "meshes" not in literal and "is_optimizer" not in literal["args"][0]
    assert spec.from_literal(literal) == read
    assert core.read_spec(literal).meshes == () and not core.read_spec(literal).args[0].is_optimizer


def test_driver_reads_the_spec_through_a_table_equal_to_its_records() -> None:
    records = [spec.ArtifactSpec, *spec.ArtifactSpec.RECORDS.values()]
    fields = {cls.__name__: tuple(f.name for f in dataclasses.fields(cls)) for cls in records}
    lists = {name: cls.__name__ for name, cls in spec.ArtifactSpec.RECORDS.items()}
    assert (fields, lists) == (core.SPEC_RECORDS, core.SPEC_LISTS)
    defaults = {
        cls.__name__: tuple(
            f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
        )
        for cls in records
    }
    assert {k: v for k, v in defaults.items() if v} == core.SPEC_DEFAULTS


def test_the_drivers_table_of_records_is_generated_from_the_spec() -> None:
    """driver/records.py is what ``spec_listing --write`` makes of the dataclasses."""
    committed = spec_listing.RECORDS_PATH.read_text()
    assert committed == spec_listing.driver_records(), (
        f"driver/records.py is out of date: run `{spec_listing.WRITE_COMMAND}`."
    )


def test_driver_refuses_a_record_whose_fields_are_not_the_table(backend: str, artifacts) -> None:
    literal = spec.to_literal(spec.parse_spec(artifacts.pair("mlp_infer", backend)[0]))
    assert core.read_spec(literal).model[0].name == literal["model"][0]["name"]
    literal["model"][0]["renamed"] = literal["model"][0].pop("shape")
    with pytest.raises(TypeError, match="renamed"):
        core.read_spec(literal)
