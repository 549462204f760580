"""Code location entry point (workspace.yaml): definitions from the file ROWRELAY_CONFIG names."""

from orchestration.factory import build_definitions
from resources.config import load_config

defs = build_definitions(load_config())
