"""assets/records.py: the slice recorded in Dagster's event log."""

from __future__ import annotations

from resources.slices import SliceRange


def test_the_recorded_slice_is_the_highest_not_the_latest_materialization() -> None:
    """A roll-up is recorded as a new materialization after the slices above it: the latest event named (0, 4]
    while (4, 6] had committed, and the refusal's reset point would have sent (4, 6] again."""
    from dagster import AssetKey, AssetMaterialization, DagsterInstance

    from assets.records import last_recorded_slice

    key = AssetKey(["src", "public", "t"])
    with DagsterInstance.ephemeral() as instance:
        assert last_recorded_slice(instance, key) is None
        for lo, hi in ((0, 2), (2, 4), (4, 6), (0, 4)):
            instance.report_runless_asset_event(AssetMaterialization(key, partition=SliceRange(lo, hi).key))
        assert last_recorded_slice(instance, key) == SliceRange(4, 6)
