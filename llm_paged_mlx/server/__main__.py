"""``python -m llm_paged_mlx.server MODEL [options]``: the same as ``llm paged-mlx serve``."""

import sys

from llm.cli import cli

cli(["paged-mlx", "serve", *sys.argv[1:]], prog_name="python -m llm_paged_mlx.server")
