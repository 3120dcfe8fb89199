"""``python -m llm_paged_mlx.server MODEL [options]``: the same as ``llm paged-mlx serve``."""

from ..cli import serve

serve(prog_name="python -m llm_paged_mlx.server")
