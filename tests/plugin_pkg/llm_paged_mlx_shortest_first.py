"""A third-party llm-paged-mlx plugin: the ``shortest-first`` scheduling policy.

It exists to test plugin discovery through the ``llm_paged_mlx`` entry-point group.
"""

from llm_paged_mlx import hookimpl


class ShortestFirst:
    """Shorter prompts first, then arrival order."""

    name = "shortest-first"

    def key(self, request):
        return (len(request.prompt_token_ids), request.arrival)


@hookimpl
def register_schedulers(register):
    register("shortest-first", ShortestFirst)
