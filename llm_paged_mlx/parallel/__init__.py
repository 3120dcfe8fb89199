"""Tensor parallelism over ``mx.distributed``: the model's shards and the collectives of a step
(``collectives``), rank 0's engine calls repeated on every other rank (``mirror``), and the processes of a
group (``ranks``)."""
