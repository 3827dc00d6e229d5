"""The spec cannot drift: its committed listing, its version, and the driver's reading of it."""

from __future__ import annotations

import dataclasses

import pytest

from torch_precompile import spec, spec_listing
from torch_precompile.driver import core


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
    monkeypatch.setattr(spec_listing, "SCHEMA_VERSION", spec.SCHEMA_VERSION + 1)
    problem = spec_listing.drift(committed)
    assert problem == f"docs/spec-schema.txt is out of date: run `{spec_listing.WRITE_COMMAND}`."


def test_history_ends_at_the_version_written() -> None:
    versions = [change.version for change in spec.SCHEMA_HISTORY]
    assert versions == list(range(1, spec.SCHEMA_VERSION + 1))
    assert spec.OLDEST_READABLE_SCHEMA in versions


def test_driver_reads_the_spec_through_a_table_equal_to_its_records() -> None:
    records = [spec.ArtifactSpec, *spec.ArtifactSpec.RECORDS.values()]
    fields = {cls.__name__: tuple(f.name for f in dataclasses.fields(cls)) for cls in records}
    lists = {name: cls.__name__ for name, cls in spec.ArtifactSpec.RECORDS.items()}
    assert (fields, lists) == (core.SPEC_RECORDS, core.SPEC_LISTS)


def test_the_drivers_table_of_records_is_generated_from_the_spec() -> None:
    """driver/records.py is what ``spec_listing --write`` makes of the dataclasses."""
    committed = spec_listing.RECORDS_PATH.read_text()
    assert committed == spec_listing.driver_records(), (
        f"driver/records.py is out of date: run `{spec_listing.WRITE_COMMAND}`."
    )


def test_driver_refuses_a_record_whose_fields_are_not_the_table(backend: str, artifacts) -> None:
    literal = spec.parse_spec(artifacts.pair("mlp_infer", backend)[0]).to_literal()
    assert core.read_spec(literal).model[0].name == literal["model"][0]["name"]
    literal["model"][0]["renamed"] = literal["model"][0].pop("shape")
    with pytest.raises(TypeError, match="renamed"):
        core.read_spec(literal)
