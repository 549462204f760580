"""The source's side of `rowrelay verify`: the rows of a compared range, each slice's by the row filter it was
published with. `source` is the table's SourceDatabaseResource and `shape` its reflected TableShape, opened by the
caller: this package imports no Dagster."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from resources.config import TableConfig
from resources.exactly_once import ProgressRecord
from resources.verify.compare import FilterPiece, SourceRows, filter_pieces, tie_fingerprints
from resources.verify.topic import tie_text


def shaped_pieces(shape: Any, table: TableConfig, start: int | None, upto: int,
                  slices: list[ProgressRecord] | None) -> list[tuple[Any, FilterPiece]]:
    """(start, upto] in pieces, each with the table shape of the row filter its slices were published with
    (`filter_pieces`)."""
    return [(replace(shape, where=piece.where or None), piece)
            for piece in filter_pieces(start, upto, slices or [], table.where, table.skip_rows)]


def source_watermarks(source: Any, shape: Any, table: TableConfig, start: int | None, upto: int,
                      slices: list[ProgressRecord] | None = None) -> SourceRows:
    """The source's rows in (start, upto], each slice's by the row filter it was published with: counted per
    watermark, and fingerprinted by tie_break where they share one (`SourceRows`)."""
    pieces = shaped_pieces(shape, table, start, upto, slices)
    skipped = sum(source.count_skipped(piece_shape, piece.lo, piece.hi, piece.skip) for piece_shape, piece in pieces)
    if table.tie_break is None:
        counts: Counter[int] = Counter()
        for piece_shape, piece in pieces:
            counts.update(source.iter_watermarks(piece_shape, piece.lo, piece.hi, skip=list(piece.skip)))
        return SourceRows(counts, shape.watermark_kind, skipped=skipped)
    found = tie_fingerprints((row for piece_shape, piece in pieces
                              for row in source.iter_watermark_ties(piece_shape, piece.lo, piece.hi, list(piece.skip))),
                             table.tie_break)
    found.watermark_kind, found.skipped = shape.watermark_kind, skipped
    return found


def source_ties(source: Any, shape: Any, table: TableConfig, start: int | None, upto: int,
                slices: list[ProgressRecord] | None, values: Sequence[int]) -> dict[int, Counter[str]]:
    """The rows of the watermark `values` (those whose fingerprints differed) by tie_break text, read with bounded
    IN lists, each from the pieces it falls in."""
    ties: dict[int, Counter[str]] = {}
    wanted = sorted(values)
    pieces = shaped_pieces(shape, table, start, upto, slices)
    for chunk in (wanted[i:i + 1000] for i in range(0, len(wanted), 1000)):
        for piece_shape, piece in pieces:
            if (piece.lo is not None and chunk[-1] <= piece.lo) or chunk[0] > piece.hi:
                continue
            for w, tie in source.iter_watermark_ties(piece_shape, piece.lo, piece.hi, list(piece.skip), only=chunk):
                text = tie_text(tie)
                ties.setdefault(w, Counter())[text if text is not None else repr(tie)] += 1
    return ties
