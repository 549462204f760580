"""What must be sent: every row a writer committed, nothing it rolled back, each known by its `tok` column."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TableModel:
    committed: set[str] = field(default_factory=set)
    rolled_back: set[str] = field(default_factory=set)
    pending: dict[int, list[str]] = field(default_factory=dict)  # held transaction (its step) -> its rows
    replays: dict[str, tuple[int, int]] = field(default_factory=dict)  # `rowrelay replay` id -> its range (lo, hi]

    def written(self, txn: int | None, toks: list[str]) -> None:
        """Rows inserted: committed at once (`txn` None) or held in transaction `txn` until `ended`."""
        if txn is None:
            self.committed.update(toks)
        else:
            self.pending.setdefault(txn, []).extend(toks)

    def ended(self, txn: int, committed: bool) -> None:
        (self.committed if committed else self.rolled_back).update(self.pending.pop(txn, []))

    def must_send(self) -> set[str]:
        assert not self.pending, f"transactions still open at a check: {sorted(self.pending)}"
        return set(self.committed)
