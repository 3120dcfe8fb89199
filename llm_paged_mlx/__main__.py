"""``python -m llm_paged_mlx COMMAND``: the same as ``llm paged-mlx COMMAND`` (``serve MODEL``, ``list``, ...)."""

from .cli import paged_mlx

paged_mlx(prog_name="python -m llm_paged_mlx")
