"""The paged engine: blocks, scheduler, runner, and the loop that ties them."""
