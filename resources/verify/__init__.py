"""`rowrelay verify`'s engine, Dagster-free: a table's topic compared with its source rows up to its committed
progress (duplicates, missing, extra, order violations). `verify_channel` is the whole comparison; the
orchestration layer opens the source and refuses what makes a comparison meaningless (orchestration/verify.py)."""

from resources.verify.compare import VerifyReport
from resources.verify.table import verify_channel

__all__ = ["VerifyReport", "verify_channel"]
