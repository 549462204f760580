"""rowrelay as a Dagster Component: `type: orchestration.component.RelayComponent` in a project's `defs.yaml`.

Its `attributes:` are `rowrelay.yaml`'s settings (`sources`, `tables`, `kafka`, `spark`) and go through the same
validator (`resources.config.parse_config`), so a mistake reads the same in `dg check defs` as in `rowrelay`; its
definitions are `build_definitions`' (the same assets, checks, sensors and jobs as the repository's code location).
The attributes model only says which top-level keys exist: the settings' own model is the one that validates them,
so that there is one schema and one set of error texts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dagster import Component, ComponentLoadContext, Definitions, Scaffolder, ScaffoldRequest, scaffold_with
from pydantic import BaseModel, ConfigDict

from orchestration.factory import build_definitions
from resources.config import RelayConfig, component_origin, parse_config

# What `dg scaffold defs orchestration.component.RelayComponent NAME` writes: one table on the local stack's ports,
# each setting commented, to be edited into the user's own.
DEFS_TEMPLATE = """\
type: {type_name}

# The same settings as rowrelay.yaml (docs/configuration.md): `rowrelay --defs {defs} verify` reads this file too.
attributes:
  sources:
    shop:  # a name of your choosing: the tables' asset group
      # ${{VAR}} is resolved where a connection is made, never stored or shown by Dagster
      url: postgresql://${{ROWRELAY_PG_USER:-rowrelay}}:${{ROWRELAY_PG_PASSWORD}}@127.0.0.1:15432/shop
  tables:
    - source: shop
      table: public.orders
      watermark: id          # an increasing integer or time column
      slice_max_rows: 100000 # rows per slice (one run, one Kafka transaction)
  kafka:
    bootstrap_servers: 127.0.0.1:19092
    # transactional_id_prefix: rowrelay  # one per deployment: it names the progress topic
  spark:
    remote: sc://127.0.0.1:15102  # a Spark Connect server; or `master: local[2]`
"""


class RelayAttributes(BaseModel):
    """The keys `attributes:` may hold; their values are validated by `RelayConfig` (see the module's note)."""

    model_config = ConfigDict(extra="forbid")
    sources: Any = None
    tables: Any = None
    kafka: Any = None
    spark: Any = None


class RelayComponentScaffolder(Scaffolder):
    def scaffold(self, request: ScaffoldRequest) -> None:
        defs = request.target_path / "defs.yaml"
        shown = defs.relative_to(request.project_root) if request.project_root in defs.parents else defs
        defs.write_text(DEFS_TEMPLATE.format(type_name=request.type_name, defs=shown))


@scaffold_with(RelayComponentScaffolder)
class RelayComponent(Component):
    """Relays the new rows of append-only SQL tables into Kafka exactly once: one asset per table, partitioned into
    watermark slices, with a sensor that cuts them, checks, and lag."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config

    @classmethod
    def get_model_cls(cls) -> type[BaseModel]:
        return RelayAttributes

    @classmethod
    def load(cls, attributes: BaseModel | None, context: ComponentLoadContext) -> RelayComponent:
        settings = attributes.model_dump(exclude_unset=True) if attributes is not None else {}
        return cls(parse_config(settings, component_origin(Path(context.path))))

    def build_defs(self, context: ComponentLoadContext) -> Definitions:
        return build_definitions(self.config)
