"""What must be sent: every row a writer committed, nothing it rolled back, each known by its `tok` column; after
a `rowrelay reset` to W, the rows above W once more (the oracle reads where each reset cut the topic from the
table's progress); rows a `where:` in force when their slice was cut leaves out, never."""

from __future__ import annotations

from dataclasses import dataclass, field

# A drawn `where:` as (its SQL, the lowest `v` it admits): one comparison both databases and Python read alike.
Where = tuple[str, int] | None


def admits(where: Where, v: int | None) -> bool:
    return where is None or (v is not None and v >= where[1])


@dataclass
class TableModel:
    committed: set[str] = field(default_factory=set)
    rolled_back: set[str] = field(default_factory=set)
    pending: dict[int, list[str]] = field(default_factory=dict)  # held transaction (its step) -> its rows
    replays: dict[str, tuple[int, int]] = field(default_factory=dict)  # `rowrelay replay` id -> its range (lo, hi]
    skipped: set[str] = field(default_factory=set)  # rows an entry of `skip_watermarks` names
    resets: list[int] = field(default_factory=list)  # each `rowrelay reset --after W`, in order
    # Each `where:` change: (committed progress when it took effect, the new filter). A row above the newest such
    # progress below its watermark is chosen by that change's filter; rows at or below the first by no filter.
    wheres: list[tuple[int, Where]] = field(default_factory=list)

    def written(self, txn: int | None, toks: list[str]) -> None:
        """Rows inserted: committed at once (`txn` None) or held in transaction `txn` until `ended`."""
        if txn is None:
            self.committed.update(toks)
        else:
            self.pending.setdefault(txn, []).extend(toks)

    def ended(self, txn: int, committed: bool) -> None:
        (self.committed if committed else self.rolled_back).update(self.pending.pop(txn, []))

    def where_for(self, watermark: int) -> Where:
        chosen: Where = None
        for progress, where in self.wheres:
            if watermark > progress:
                chosen = where
        return chosen

    def where_now(self) -> Where:
        return self.wheres[-1][1] if self.wheres else None

    def must_send(self) -> set[str]:
        assert not self.pending, f"transactions still open at a check: {sorted(self.pending)}"
        return self.committed - self.skipped
