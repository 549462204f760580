"""The Dagster component: its attributes are rowrelay.yaml's settings, checked by the same validator with the same
texts, and it builds the same definitions as the repository's code location."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from dagster import ScaffoldRequest

from orchestration.cli.arguments import build_parser
from orchestration.component import RelayComponent, RelayComponentScaffolder
from orchestration.factory import build_definitions
from resources.config import ConfigError, load_component_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
TYPE = "orchestration.component.RelayComponent"


def demo_settings() -> dict:
    return yaml.safe_load((ROOT / "stack" / "demo.yaml").read_text())


def names(defs) -> tuple[set, set, set]:
    repo = defs.get_repository_def()
    return (set(repo.asset_graph.get_all_asset_keys()), set(repo.asset_checks_defs_by_key),
            {s.name for s in repo.sensor_defs})


def test_the_component_builds_what_the_code_location_builds() -> None:
    component = RelayComponent.from_attributes_dict(attributes=demo_settings())
    built = names(component.build_defs(None))  # type: ignore[arg-type]
    assert built == names(build_definitions(parse_config(demo_settings())))
    assert len(built[0]) == 3 and built[2], built


def test_a_mistake_reads_as_it_does_in_rowrelay_yaml(tmp_path: Path) -> None:
    settings = demo_settings()
    settings["tables"][0]["slice_max_rows"] = "many"
    with pytest.raises(ConfigError) as in_yaml:
        parse_config(settings, "X")
    with pytest.raises(ConfigError) as in_component:
        RelayComponent.from_attributes_dict(attributes=settings)
    assert "slice_max_rows" in str(in_yaml.value)
    assert str(in_component.value).split(" is invalid:")[1] == str(in_yaml.value).split(" is invalid:")[1]


def test_an_unknown_attribute_is_refused() -> None:
    with pytest.raises(Exception, match="tabels"):
        RelayComponent.from_attributes_dict(attributes={**demo_settings(), "tabels": []})


def test_the_scaffolded_defs_yaml_is_a_valid_component(tmp_path: Path) -> None:
    RelayComponentScaffolder().scaffold(ScaffoldRequest(type_name=TYPE, target_path=tmp_path, scaffold_format="yaml",
                                                        project_root=tmp_path, params=None))
    written = yaml.safe_load((tmp_path / "defs.yaml").read_text())
    assert written["type"] == TYPE
    config = load_component_config(tmp_path)
    assert [t.table_id for t in config.tables] == ["shop.public.orders"]
    assert "#" in (tmp_path / "defs.yaml").read_text()  # commented for the user who edits it


def test_the_cli_reads_a_component_among_other_documents(tmp_path: Path) -> None:
    defs = tmp_path / "defs.yaml"
    other = {"type": "dagster.DefinitionsComponent", "attributes": {"path": "x.py"}}
    defs.write_text(yaml.safe_dump(other) + "---\n" + yaml.safe_dump({"type": TYPE, "attributes": demo_settings()}))
    assert len(load_component_config(defs).tables) == 3
    defs.write_text(yaml.safe_dump(other))
    with pytest.raises(ConfigError, match="expected one component of type"):
        load_component_config(defs)
    with pytest.raises(ConfigError, match="not found"):
        load_component_config(tmp_path / "missing.yaml")


def test_defs_and_config_exclude_each_other() -> None:
    parser = build_parser("")
    assert parser.parse_args(["--defs", "d.yaml", "status"]).defs == "d.yaml"
    with pytest.raises(SystemExit):
        parser.parse_args(["--defs", "d.yaml", "--config", "r.yaml", "status"])
