"""Where a job writes: the destination rule every writing job follows (``rule``: never the source, nothing
but an earlier output of its own kind) and the one-writer lock beside the destination (``lock``)."""
