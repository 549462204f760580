"""Code location entry point (workspace.yaml): definitions from the file ROWRELAY_CONFIG names."""

from orchestration.config import load_config
from orchestration.factory import build_definitions

defs = build_definitions(load_config())
